"""The provider interface: every call the pool makes of the provider that runs its
sandboxes (bind, create, reset, delete, list, shutdown, close).

A provider owns the side effects (processes, containers, pods); the pool owns the
decisions. Every failure a provider raises is a ``ProviderError`` whose ``kind`` says
what the pool should do: ``throttled`` (slow down), ``transient`` (retry later, with
jitter) or ``fatal`` (give up on this request and say why).
"""

import abc
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from sandman_ray.errors import NotSupported, ProviderError, SandmanError
# the kinds of ProviderError, beside it in errors.py, as every provider raises them
from sandman_ray.errors import fatal, throttled, transient  # noqa: F401
from sandman_ray.spec import DEFAULT_PACING, SandboxSpec, check_pool_name

# How long a daemon may take to answer the readiness check (connect, ping, ``true``).
CHECK_TIMEOUT_S = 10.0
# Labels every provider sets on its sandboxes, so the pool can reconcile after a restart.
POOL_LABEL = "sandman.pool"
SANDBOX_LABEL = "sandman.sandbox"


@dataclass(frozen=True)
class SandboxInfo:
    """Where a sandbox is and how to talk to it.

    sandbox_id: the pool's name for it (unique in the pool).
    address: the daemon's address (``unix:PATH`` or ``tcp:HOST:PORT``), valid on
        ``node_id`` (a unix socket) or anywhere that can reach it (TCP).
    token: the daemon's per-sandbox token.
    node_id: the Ray node the sandbox runs on (None when not on a Ray node).
    labels: the labels it was created with, including POOL_LABEL and SANDBOX_LABEL.
    created_at: wall-clock seconds when it was created (or last reset).
    spec: the spec it was created from, whole (a restarted pool adopts the sandbox
        with it); None when the provider cannot tell (then the pool deletes it).
    alive: False once the provider knows it has stopped (the pool deletes it).
    details: provider-specific facts (image digest, limits applied, timings).
    """

    sandbox_id: str
    address: str
    token: str
    node_id: Optional[str] = None
    labels: Dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    spec: Optional[SandboxSpec] = None
    alive: bool = True
    details: Dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotInfo:
    """A sandbox's files, captured: what ``Provider.snapshot`` makes and the pool owns.

    name: the pool's name for it (unique in the pool).
    image: the image reference a SandboxSpec takes to start sandboxes from it
        (``snapshot:<pool>/<name>`` for the LocalProvider, the committed image's
        reference for the DockerProvider).
    base: the image the captured sandbox ran (a snapshot's own base, for a snapshot of
        a sandbox started from a snapshot).
    size_bytes: what the snapshot holds on disk beyond its base image.
    node_id: the Ray node whose disk holds it (None: wherever the provider's engine
        or registry serves it).
    source: the sandbox it was taken from.
    created_at: wall-clock seconds when it was taken.
    """

    name: str
    image: str
    base: str
    size_bytes: int
    node_id: Optional[str] = None
    source: str = ""
    created_at: float = 0.0

    def to_dict(self) -> Dict[str, object]:
        return {"name": self.name, "image": self.image, "base": self.base,
                "size_bytes": self.size_bytes, "node_id": self.node_id,
                "source": self.source, "created_at": self.created_at}


def reachable(info, node: Optional[str]) -> bool:
    """Whether a host on Ray node ``node`` reaches the daemon of ``info`` (a lease or a
    SandboxInfo: TCP from anywhere, a unix socket on its own node only)."""
    return info.address.startswith("tcp:") or (node is not None and info.node_id == node)


async def _daemon(info: SandboxInfo):
    """A client of the daemon of ``info``, connected with its token, or a transient
    ProviderError."""
    from sandman_ray.client import AsyncDaemonClient
    try:
        return await AsyncDaemonClient.connect(info.address, info.token,
                                               connect_timeout=CHECK_TIMEOUT_S,
                                               default_timeout=CHECK_TIMEOUT_S)
    except (ConnectionError, OSError, SandmanError) as exc:
        raise transient("sandbox %s does not answer: %s" % (info.sandbox_id, exc)) from exc


async def check_answers(info: SandboxInfo) -> None:
    """Raise (transient) unless the sandbox's daemon answers a ping and a trivial exec:
    what READY means, checked where the address is reachable (a provider's create and
    reset end with it, on the sandbox's node for a unix socket), within
    CHECK_TIMEOUT_S."""
    client = await _daemon(info)
    try:
        await client.ping()
        result = await client.exec("true")
        if result.exit_code != 0:
            raise transient("sandbox %s: `true` exited %s" % (info.sandbox_id, result.exit_code))
    except (ConnectionError, OSError, SandmanError) as exc:
        if isinstance(exc, ProviderError):
            raise
        raise transient("sandbox %s does not answer: %s" % (info.sandbox_id, exc)) from exc
    finally:
        client.close()


async def bind_daemon(info: SandboxInfo, env: Dict[str, str], workdir: Optional[str]) -> None:
    """The daemon of ``info`` takes a lease's ``env`` and ``workdir`` (its ``bind`` op),
    where the address is reachable; a ProviderError says why it did not: fatal for a
    request the daemon refuses (a workdir it cannot make: the spec's fault), transient
    otherwise."""
    from sandman_ray.errors import DaemonError
    client = await _daemon(info)
    try:
        await client.bind(env or None, workdir)
    except DaemonError as exc:
        if exc.type != "BadRequest":
            raise transient("sandbox %s: bind: %s" % (info.sandbox_id, exc)) from exc
        raise fatal("sandbox %s: %s" % (info.sandbox_id, exc)) from exc
    except (ConnectionError, OSError, SandmanError) as exc:
        raise transient("sandbox %s does not answer: %s" % (info.sandbox_id, exc)) from exc
    finally:
        client.close()


class Provider(abc.ABC):
    """Creates and deletes one pool's sandboxes. Methods that do I/O are coroutines:
    they run on the pool's event loop and must never block it (blocking calls go to a
    thread or to another actor). The pool calls, in its life:

    ``bind`` once, in the pool's process; ``create``, ``reset`` (when
    ``supports_reset``), ``delete`` and ``list`` any number of times, concurrently;
    ``shutdown`` once, when the pool is shut down, then ``close``."""

    #: True when ``reset`` returns a sandbox to its initial state faster than a new one.
    supports_reset: bool = False
    #: True when ``weigh`` sets sandboxes' shares of their node's CPU.
    weighs: bool = False
    #: True when ``bind_task`` gives a running sandbox a lease's env, workdir and
    #: labels: a pool's warm sandboxes then serve specs that differ only in those.
    binds_late: bool = False
    #: the pool's pacing of creates when its PoolConfig leaves it to the provider: what
    #: the provider's control plane takes (an API server, a container engine)
    pacing = DEFAULT_PACING
    #: the pool whose sandboxes these are (set by ``bind``)
    pool: str = "default"
    #: that pool's config (set by ``bind``; None for a provider used without a pool),
    #: for a provider that checks its nodes against the pool's limits
    pool_config = None

    def bind(self, pool: str, config=None) -> "Provider":
        """Name the pool whose sandboxes this provider runs, and give its PoolConfig
        (before any other call)."""
        self.pool = check_pool_name(pool)
        self.pool_config = config
        return self

    @abc.abstractmethod
    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        """Start a sandbox and return once its daemon answers (``check_answers``), with
        ``labels`` set and ``spec`` reported in its SandboxInfo. Idempotent per
        ``sandbox_id``: a retry after a timeout returns the existing sandbox instead of
        a second one."""

    @abc.abstractmethod
    async def delete(self, sandbox_id: str) -> None:
        """Stop the sandbox and remove everything it left; deleting a sandbox that is
        already gone is not an error."""

    @abc.abstractmethod
    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """Every sandbox this provider runs whose labels include ``labels``, each with
        its spec and liveness."""

    async def endpoint(self, sandbox_id: str) -> SandboxInfo:
        """Where ``sandbox_id`` is now; ``fatal`` ProviderError if it does not exist."""
        for info in await self.list({SANDBOX_LABEL: sandbox_id}):
            return info
        raise fatal("sandbox %s does not exist" % sandbox_id)

    async def warm_up(self) -> None:
        """Start what a first create would otherwise wait for (a node agent, a
        connection): the pool calls it once as it starts, without waiting for it, so
        that a first burst finds the provider running. Failures are the create's to
        report."""

    async def nodes(self) -> Optional[List[str]]:
        """The Ray nodes this provider can place a sandbox on (``place``), or None when
        it does not place sandboxes on Ray nodes (a Kubernetes cluster's pods)."""
        return None

    def place(self, sandbox_id: str, node_id: str) -> None:
        """Create ``sandbox_id`` on Ray node ``node_id`` (one of ``nodes()``) when it is
        created next: what an acquire on that node, or asking for it, wants. A provider
        that does not place sandboxes ignores it."""

    async def weigh(self, weights: Dict[str, tuple]) -> None:
        """sandbox id -> (its client, its share of its node's CPU when the CPU is
        contended, as a weight: 1.0 a sandbox's default share, 0.5 half of it), for
        leased sandboxes. A reset sandbox is back at 1.0. Where ``weighs`` is False:
        nothing."""
        return None

    async def bind_task(self, info: SandboxInfo, env: Dict[str, str], workdir: Optional[str],
                        labels: Dict[str, str]) -> None:
        """Give the sandbox of ``info`` one lease's own settings (where ``binds_late``): ``env`` over
        its environment and ``workdir`` (made when missing) for every command from now
        on, ``labels`` beside its own in listings; its next ``reset`` forgets them."""
        raise NotSupported("%s cannot bind a lease's settings late" % type(self).__name__)

    async def prefetch(self, image: str, node_id: str) -> Dict[str, object]:
        """Fetch and unpack ``image`` on Ray node ``node_id`` (one of ``nodes()``) for the
        sandboxes to come, and say what was made (``digest``, ``unpacked_by``)."""
        raise NotSupported("%s cannot prefetch images" % type(self).__name__)

    async def image_cache(self) -> Optional[Dict[str, Dict[str, int]]]:
        """Per node, its image cache's bytes, entries, budget, hits, misses and
        evictions (the LocalProvider's); None where the provider keeps no cache."""
        return None

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """Return the sandbox to the state of a new one (files, processes, a new token),
        keeping its id, and return once its daemon answers."""
        raise fatal("%s cannot reset sandboxes" % type(self).__name__)

    # ---- snapshots and pauses (a provider that has them says so and overrides all)
    #: True when ``snapshot``, ``delete_snapshot`` and ``snapshots`` work
    supports_snapshots: bool = False

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Capture the files of ``sandbox_id`` (its writable layer over its image) as
        the snapshot ``name`` of this pool, which a SandboxSpec's image can then name
        (``SnapshotInfo.image``). Its processes are not captured. A name this pool
        already has is a fatal error."""
        raise NotSupported("%s cannot snapshot sandboxes" % type(self).__name__)

    async def delete_snapshot(self, name: str) -> None:
        """Remove the snapshot ``name`` of this pool (no sandbox may still run from it);
        one that is gone already is not an error."""
        raise NotSupported("%s has no snapshots" % type(self).__name__)

    async def snapshots(self) -> List[SnapshotInfo]:
        """Every snapshot of this pool the provider keeps (a restarted pool adopts
        them)."""
        return []

    def controller(self, node_id: Optional[str]) -> Optional[str]:
        """The name (in Ray namespace ``sandman``) of an actor on Ray node ``node_id``
        whose ``pause_held(sandbox_id, token, reclaim)`` and ``resume_held(sandbox_id,
        token)`` pause and resume a sandbox there for a caller that shows the
        sandbox's token (True; False for a token it does not take): a holder on that
        node pauses its sandbox in one hop, and tells the pool after. None: pauses go
        through the pool."""
        return None

    async def pause(self, sandbox_id: str, reclaim: bool = False) -> None:
        """Stop every process of the sandbox from running, keeping its memory, until
        ``resume``; with ``reclaim``, then push out what of its memory the kernel can
        (to swap, where the node has it). Its daemon is paused too."""
        raise NotSupported("%s cannot pause sandboxes" % type(self).__name__)

    async def resume(self, sandbox_id: str) -> None:
        """Let a paused sandbox's processes run again where they stopped."""
        raise NotSupported("%s cannot pause sandboxes" % type(self).__name__)

    async def shutdown(self) -> int:
        """Delete every sandbox of the pool, also those still being created; returns
        how many. No create succeeds afterwards."""
        infos = await self.list({POOL_LABEL: self.pool})
        for info in infos:
            await self.delete(info.sandbox_id)
        return len(infos)

    async def close(self) -> None:
        """Release what the provider holds in this process (connections, threads)."""
