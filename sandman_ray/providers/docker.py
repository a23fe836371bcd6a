"""DockerProvider: sandboxes as containers through the Docker Engine API.

Works against Docker and against Podman's compatible service (``podman system service``).
One ``DockerAgent`` actor per pool and node (``sandman:docker-agent:<pool>:<node id>``)
talks to that node's engine; the pool-side half is shared with the LocalProvider
(``providers/nodes.py``). Each container runs the task image unmodified:

- the daemon bundle is bind-mounted read-only at ``/.sandman`` and the daemon is the
  entrypoint (PID 1 of the container, so it reaps zombies); the image's own entrypoint
  and cmd are not run, its Env, WorkingDir and User are honoured by the engine;
- the daemon listens on a unix socket in a per-sandbox host directory bind-mounted at
  ``/run/sandman`` (``transport="unix"``, for handles on the same node), or on TCP
  published on the node's address (``transport="tcp"``, needs ``network=True``); the
  per-sandbox token is a file in that directory that the daemon removes once read,
  never a label or an env var. The sandbox can write that directory, so the host
  connects to the socket without following a symlink (``client._SocketPath``);
- root inside is not host root (``user_namespace="auto"``): Podman gives each
  container a range of 65536 host ids of its own (``--userns=auto``, from the
  ``containers`` entry of /etc/subuid and /etc/subgid, read through idmapped mounts
  with no copy of the image); Docker does so only with ``userns-remap`` in its daemon
  configuration, and a create says so rather than run as host root;
- ``network=True`` is Podman's slirp4netns (no host loopback, no IPv6) or Docker's
  bridge, with the LocalProvider's filter loaded into the container's network
  namespace before the daemon is reachable (``providers/network.py``): no host or
  cluster address, no private, link-local or metadata range unless
  ``SandboxSpec.network_allow`` names it. Containers get no CAP_NET_ADMIN to undo it;
- no nested user namespaces: ``user.max_user_namespaces`` is 0 inside the container's
  own (``userns.forbid_nested_user_namespaces``), which its root cannot raise;
- ``runtime`` picks the OCI runtime (``runsc``: gVisor); Podman's Docker API takes
  the runtime from its containers.conf rather than from the request, so with Podman
  the engine's default runtime must be the one asked for (``PodmanService(runtime=)``).
  Under runsc, root inside is root of gVisor's kernel, whose sentry runs unprivileged
  on the host; Podman's user namespace is not added there (runsc's gofer, which serves
  the bind mounts, would then lose access to the bundle), and files made inside stay
  in gVisor's memory-backed overlay;
- labels carry the pool, the sandbox id, the node and the agent's incarnation, so the
  pool lists and reconciles by label, and whatever an agent leaves when it dies is
  removed by its janitor (``providers/janitor.py``);
- no network unless the spec asks (``network_mode=none``); cpu, memory and pids limits
  from the spec; a disk limit (``storage_opt size``) where the engine's storage has
  quotas (``disk_quota=True``: overlay on xfs with pquota, btrfs, zfs), else none;
- an image is pulled at most once per node at a time: thirty creates of a cold image
  wait for one pull. Pull failures say which of unknown image, refused credentials or
  unreachable registry it was;
- engine errors are classified for the pool's pacing: 429 throttled; 5xx, timeouts and
  an unreachable engine transient; other 4xx fatal. Every SDK call is blocking and runs
  on the agent's thread pool, at most ``max_engine_calls`` at once per node;
- reset removes the container and creates it again from the same image under the same
  name (engines offer no cheaper way back to the image's state); delete removes the
  container with its anonymous volumes.

Measured here with Podman 4.3 (runc): create 13 ms, start 63 ms, daemon listening 21 ms
later; the daemon over the bind-mounted socket answers ``exec true`` in ~1 ms, where the
engine's own exec takes 82-92 ms.
"""

import asyncio
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import ray

from sandman_ray.errors import ProviderError, SandboxLost, SandmanError
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, Provider, SandboxInfo, fatal, throttled, transient)
from sandman_ray.providers.nodes import NodeAgentProvider, SingleFlight
from sandman_ray.spec import SandboxSpec, parse_image

logger = logging.getLogger(__name__)

DEFAULT_STATE_ROOT = "/tmp/sandman-ray/docker-state"
DEFAULT_CACHE_ROOT = "/tmp/sandman-ray/cache"
NODE_LABEL = "sandman.node"
AGENT_LABEL = "sandman.agent"   # the incarnation of the agent that created the container
SOCKET_DIR = "/run/sandman"
TCP_PORT = 7000                 # where the daemon listens inside the container (tcp)
PULLS_AT_ONCE = 4               # image pulls in flight per node (each holds a thread)
API_VERSION = "1.41"            # Docker 20.10+ and Podman 4 speak it
IDS_PER_CONTAINER = 65536       # host ids of a container's user namespace (Podman)
# Podman's slirp4netns: the host's loopback (10.0.2.2) and IPv6 off; the filter does the rest
PODMAN_NETWORK = "slirp4netns:allow_host_loopback=false,enable_ipv6=false"
NO_SUBIDS = ("Podman has no subordinate ids for the user 'containers', which "
             "DockerProvider(user_namespace='auto') needs: add a line such as "
             "'containers:2147483648:1073741824' to /etc/subuid and /etc/subgid (the "
             "Makefile's set-up does), or pass user_namespace='host' for trusted code only")


def default_engine_url() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def engine_client(base_url: str, pool_size: int = 10):
    """A Docker SDK client that does not talk to the engine until it is used."""
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - the extra is part of the test set-up
        raise fatal("the DockerProvider needs the docker SDK: pip install 'sandman-ray[docker]'"
                    ) from exc
    return docker.DockerClient(base_url=base_url, version=API_VERSION, timeout=300,
                               max_pool_size=pool_size)


class EngineFacts(NamedTuple):
    """What a create needs to know of the engine, asked once per agent."""
    podman: bool
    default_runtime: str
    userns_remap: bool  # Docker's daemon maps every container's root to a range


def engine_facts(engine) -> EngineFacts:
    version, info = engine.version(), engine.info()
    names = [c.get("Name", "") for c in version.get("Components") or []]
    return EngineFacts(podman=any("Podman" in name for name in names),
                       default_runtime=info.get("DefaultRuntime") or "runc",
                       userns_remap=any("name=userns" in option
                                        for option in info.get("SecurityOptions") or []))


def container_name(pool: str, sandbox_id: str) -> str:
    """Engines allow [a-zA-Z0-9_.-]; a short hash of the pool's name keeps two pools
    whose names differ only in other characters apart."""
    return "sandman-%s-%s-%s" % (re.sub(r"[^a-zA-Z0-9_.-]", "-", pool)[:40],
                                 hashlib.sha256(pool.encode()).hexdigest()[:6],
                                 re.sub(r"[^a-zA-Z0-9_.-]", "-", sandbox_id))


def _short(pool: str, node_id: str) -> str:
    """A pool and node's directory name: fixed length, whatever the pool is called."""
    return "%s-%s" % (hashlib.sha256(pool.encode()).hexdigest()[:8], node_id[:8])


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost of an exception's arguments and causes (requests wraps urllib3,
    which wraps the socket's OSError)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = exc.__cause__ or exc.__context__ or next(
            (a for a in getattr(exc, "args", ()) if isinstance(a, BaseException)), None)
        if inner is None:
            return exc
        exc = inner
    return exc


def engine_error(exc: BaseException, what: str) -> ProviderError:
    """``exc`` from the SDK as a ProviderError whose kind tells the pool how to pace."""
    import docker.errors
    import requests.exceptions
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, requests.exceptions.ConnectionError):
        reason = _root_cause(exc)
        if isinstance(reason, PermissionError):
            return fatal("%s: no permission to use the container engine's socket (is this "
                         "user in the docker group?): %s" % (what, exc))
        if isinstance(reason, FileNotFoundError):
            return fatal("%s: no container engine listens at this address (DockerProvider's "
                         "base_url, or $DOCKER_HOST): %s" % (what, exc))
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return transient("%s: the container engine is unreachable or busy: %s" % (what, exc))
    if isinstance(exc, docker.errors.APIError):
        code = exc.status_code or 0
        reason = exc.explanation or str(exc)
        if code == 429:
            return throttled("%s: the engine asks to slow down: %s" % (what, reason))
        if code >= 500 or code == 0:
            return transient("%s: engine error %s: %s" % (what, code, reason))
        return fatal("%s: the engine refused it (%s): %s" % (what, code, reason))
    if isinstance(exc, docker.errors.DockerException):
        return transient("%s: %s" % (what, exc))
    return fatal("%s: %s: %s" % (what, type(exc).__name__, exc))


def _no_such_container(exc) -> bool:
    """A NotFound, or the 500 Podman answers for a container removed meanwhile."""
    import docker.errors
    return isinstance(exc, docker.errors.NotFound) or (
        isinstance(exc, docker.errors.APIError) and "no such container" in str(exc).lower())


def list_containers(engine, labels: List[str]) -> List[dict]:
    """The engine's containers (running or not) carrying every ``key=value`` of
    ``labels``, as the list call reports them: one request, no inspect per container
    (which races with removals)."""
    return engine.api.containers(all=True, filters={"label": labels})


def remove_container(engine, name: str) -> bool:
    """Remove a container (running or not) with its anonymous volumes; False if there
    was none. Podman, for a container with a user namespace, can answer 500 "device or
    resource busy" (its shm directory) for a removal that did happen: asked again, it
    says whether the container is gone."""
    import docker.errors
    try:
        engine.api.remove_container(name, force=True, v=True)
        return True
    except docker.errors.APIError as exc:
        if _no_such_container(exc):
            return False
        if "resource busy" not in str(exc):
            raise
    try:
        engine.api.inspect_container(name)
    except docker.errors.APIError as exc:
        if _no_such_container(exc):
            return True
        raise
    engine.api.remove_container(name, force=True, v=True)  # still there: once more
    return True


def remove_containers(engine, labels: List[str], keep=lambda labels: False) -> int:
    """Remove the engine's containers carrying every ``key=value`` of ``labels``, with
    their anonymous volumes, except those whose labels ``keep`` accepts; how many were
    removed. One that cannot be removed (gone meanwhile, engine trouble) is logged."""
    removed = 0
    for container in list_containers(engine, labels):
        if keep(container.get("Labels") or {}):
            continue
        try:
            removed += remove_container(engine, container["Id"])
        except Exception as exc:
            logger.warning("cannot remove container %s: %s", container["Id"][:12], exc)
    return removed


class PullFailed(Exception):
    """The engine's own account of a failed pull."""


# What registries and engines say, matched on whole words (a digest or a port number
# must not read as an HTTP status).
_PULL_FAILURES = (
    (r"toomanyrequests|too many requests|\b429\b", throttled,
     "the registry of image %s asks to slow down"),
    (r"manifest unknown|name unknown|not found|no such image|does not exist|\b404\b", fatal,
     "image %s does not exist in its registry"),
    (r"unauthorized|authentication required|access (to the resource )?is denied|access denied"
     r"|forbidden|\b401\b|\b403\b", fatal,
     "the registry refused to serve image %s (credentials?)"),
    (r"connection refused|no such host|dial tcp|i/o timeout|tls:|network is unreachable"
     r"|server gave http response|lookup |timeout", fatal,
     "the registry of image %s is unreachable"),
)


def pull_error(image: str, exc: BaseException) -> ProviderError:
    """A failed pull, saying which failure it was. An unknown image, refused
    credentials or an unreachable registry are fatal: the engine already retried, and
    every caller waiting for the image should learn why at once. A registry that asks
    to slow down is throttled; an engine that is itself unreachable or busy, or a
    progress stream cut off, is transient."""
    import requests.exceptions
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                        requests.exceptions.ChunkedEncodingError)):
        return transient("pull %s: the engine's answer broke off: %s" % (image, exc))
    text = str(getattr(exc, "explanation", None) or exc)
    for pattern, kind, message in _PULL_FAILURES:
        if re.search(pattern, text, re.I):
            return kind("%s: %s" % (message % image, text))
    return engine_error(exc, "pull %s" % image)


@ray.remote(num_cpus=0, max_restarts=0)
class DockerAgent:
    """Creates, resets and deletes one pool's containers on one node's engine."""

    def __init__(self, pool: str, node_id: str, base_url: str, state_root: str,
                 cache_root: str, ready_timeout_s: float, transport: str,
                 max_engine_calls: int, user_namespace: str = "auto",
                 runtime: Optional[str] = None, disk_quota: bool = False):
        from sandman_ray.bundle import ensure_bundle
        self.pool, self.node_id, self.base_url = pool, node_id, base_url
        self.ready_timeout_s, self.transport = ready_timeout_s, transport
        self.user_namespace, self.runtime, self.disk_quota = user_namespace, runtime, disk_quota
        self.facts: Optional[EngineFacts] = None  # asked at the first create
        self.incarnation = secrets.token_hex(8)
        # <root>/<pool and node>/<incarnation>/<sandbox id>/sock, of any length (the
        # host reaches a socket through /proc/self/fd); a directory per incarnation, so
        # the janitor of a dead agent removes its own directory, never that of the
        # agent that replaced it
        self.state = Path(state_root) / _short(pool, node_id) / self.incarnation[:8]
        self.engine = engine_client(base_url, pool_size=max_engine_calls + PULLS_AT_ONCE + 2)
        self.max_engine_calls = max_engine_calls
        self.executor = ThreadPoolExecutor(max_engine_calls, thread_name_prefix="engine")
        self.pull_executor = ThreadPoolExecutor(PULLS_AT_ONCE, thread_name_prefix="pull")
        self._slots: Optional[asyncio.Semaphore] = None  # made on the actor's loop
        self.node_ip = ray.util.get_node_ip_address()
        self.creating = SingleFlight()
        self.pulling = SingleFlight()
        self.closing = False          # shutdown began: no new containers
        self.deleted: set = set()     # ids deleted while their create was in flight
        self.present: set = set()     # images known to be on this engine
        self.specs: Dict[str, tuple] = {}        # sandbox id -> (spec, labels), for reset
        self.infos: Dict[str, SandboxInfo] = {}  # sandbox id -> what its create returned
        self.stats = {"pulls": 0, "creates": 0, "deletes": 0}
        self._remove_leftovers()
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state.parent, 0o700)
        self.bundle = ensure_bundle(Path(cache_root) / "bundle")
        self.janitor = self._start_janitor()

    # ---- lifecycle of the agent
    def _mine(self, extra: Optional[Dict[str, str]] = None) -> List[str]:
        labels = {POOL_LABEL: self.pool, NODE_LABEL: self.node_id}
        labels.update(extra or {})
        return ["%s=%s" % kv for kv in sorted(labels.items())]

    def _remove_leftovers(self) -> None:
        """Containers of this pool that no live agent owns: those an earlier agent on
        this node left (its janitor normally removes them; this covers a janitor that
        died too) and those of nodes no longer in the cluster (an earlier Ray session,
        a node removed). Then the directory of this pool and node."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

        def owned_elsewhere(labels: Dict[str, str]) -> bool:  # by a live agent of another node
            return labels.get(NODE_LABEL) in alive and labels.get(NODE_LABEL) != self.node_id
        try:
            remove_containers(self.engine, ["%s=%s" % (POOL_LABEL, self.pool)], owned_elsewhere)
        except Exception as exc:  # the engine may be down now; creates will say so
            logger.warning("docker agent %s: could not remove leftovers: %s", self.node_id, exc)
        shutil.rmtree(self.state.parent, ignore_errors=True)

    def _start_janitor(self):
        from sandman_ray.providers import janitor
        return janitor.start([str(self.state), "--containers", self.base_url,
                              "%s=%s" % (AGENT_LABEL, self.incarnation)])

    def ready(self) -> str:
        return self.node_id

    def engine_stats(self) -> Dict[str, int]:
        return dict(self.stats)

    async def _engine(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the thread pool, at most ``max_engine_calls`` at
        once, errors classified."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_engine_calls)
        loop = asyncio.get_running_loop()
        async with self._slots:
            try:
                return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))
            except Exception as exc:
                raise engine_error(exc, what) from exc

    # ---- images
    async def _ensure_image(self, image: str) -> None:
        if image not in self.present:
            await self.pulling.run(image, lambda: self._pull(image))
            self.present.add(image)

    async def _pull(self, image: str) -> None:
        import docker.errors
        from docker.utils import parse_repository_tag
        try:
            await self._engine("inspect image %s" % image, self.engine.images.get, image)
            return
        except ProviderError as exc:
            if not isinstance(exc.__cause__, docker.errors.ImageNotFound):
                raise
        repository, tag = parse_repository_tag(image)
        self.stats["pulls"] += 1
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:  # threads of their own: a long pull must not hold up deletes and probes
            await loop.run_in_executor(self.pull_executor, self._pull_blocking, repository,
                                       tag or "latest")
        except Exception as exc:
            raise pull_error(image, exc) from exc
        logger.info("docker agent %s: pulled %s in %.1f s", self.node_id, image,
                    time.monotonic() - started)

    def _pull_blocking(self, repository: str, tag: str) -> None:
        """Pull, reading the engine's progress stream to its end: the engine answers
        200 at once and reports a failed pull as an ``error`` line in the stream."""
        for line in self.engine.api.pull(repository, tag=tag, stream=True, decode=True):
            if isinstance(line, dict) and line.get("error"):
                raise PullFailed(line.get("errorDetail", {}).get("message") or line["error"])

    # ---- sandboxes
    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        """Idempotent: a retry while the first create runs joins it; a retry after it
        finished returns the same sandbox."""
        if sandbox_id in self.infos and sandbox_id not in self.creating.running:
            return self.infos[sandbox_id]
        self.deleted.discard(sandbox_id)
        return await self.creating.run(sandbox_id,
                                       lambda: self._create(sandbox_id, spec, labels))

    def _image_of(self, spec: SandboxSpec) -> str:
        kind, location, _ = parse_image(spec.image)
        if kind != "registry":
            raise fatal("image %r: the DockerProvider runs images its engine has or can pull "
                        "(a reference such as docker.io/library/debian:12 or localhost/name:tag)"
                        % spec.image)
        if self.transport == "tcp" and not spec.network:
            raise fatal("image %r: transport='tcp' needs SandboxSpec(network=True); a container "
                        "without a network cannot publish its daemon's port" % spec.image)
        return location

    def _container_config(self, sandbox_id: str, spec: SandboxSpec, image: str,
                          labels: Dict[str, str], run_dir: Path) -> dict:
        from docker.types import Mount
        if self.transport == "tcp":
            listen = "tcp:0.0.0.0:%d" % TCP_PORT
        else:
            listen = "unix:%s/sock" % SOCKET_DIR
        config = dict(
            image=image, name=container_name(self.pool, sandbox_id),
            entrypoint=["/.sandman/bin/sandmand"],
            # the socket is 0666: the host directory (0700 above it) and the token guard
            # it, and the client need not be the user the image runs as
            command=["--listen", listen, "--socket-mode", "0666",
                     "--token-file", "%s/token" % SOCKET_DIR],
            labels=dict(labels, **{NODE_LABEL: self.node_id, AGENT_LABEL: self.incarnation}),
            hostname=re.sub(r"[^a-z0-9-]", "-", sandbox_id.lower())[:63],
            mounts=[Mount("/.sandman", str(self.bundle), type="bind", read_only=True),
                    Mount(SOCKET_DIR, str(run_dir), type="bind")],
            environment=dict(spec.env), detach=True)
        if spec.workdir:
            config["working_dir"] = spec.workdir
        if spec.user:
            config["user"] = spec.user
        if spec.network:
            if self.transport == "tcp":
                config["ports"] = {"%d/tcp" % TCP_PORT: None}  # a free port, every address
            if self.facts.podman:
                config["network_mode"] = PODMAN_NETWORK
        else:
            config["network_mode"] = "none"
        if self.runtime and not self.facts.podman:
            config["runtime"] = self.runtime
        if spec.disk and self.disk_quota:
            config["storage_opt"] = {"size": str(spec.disk)}
        if spec.cpu:
            config["nano_cpus"] = int(spec.cpu * 1e9)
        if spec.memory:
            config["mem_limit"] = config["memswap_limit"] = spec.memory
        if spec.pids:
            config["pids_limit"] = spec.pids
        return config

    async def _check_engine(self, spec: SandboxSpec) -> None:
        """Refuse, naming the fix, what this engine cannot run as the provider promises."""
        if self.facts is None:
            self.facts = await self._engine("ask the engine's version", engine_facts, self.engine)
        facts = self.facts
        if self.user_namespace == "auto" and not facts.podman and not facts.userns_remap \
                and self.runtime != "runsc":  # under runsc, gVisor's kernel is the boundary
            raise fatal("the Docker daemon at %s runs containers as host root: configure "
                        "userns-remap in its daemon.json, or pass "
                        "DockerProvider(user_namespace='host') for trusted code only"
                        % self.base_url)
        if self.runtime and facts.podman and facts.default_runtime != self.runtime:
            raise fatal("runtime %r: Podman's Docker API runs every container with the "
                        "engine's default runtime (%r here); set [engine] runtime = %r in its "
                        "containers.conf (PodmanService(runtime=%r) does)"
                        % (self.runtime, facts.default_runtime, self.runtime, self.runtime))
        if self.runtime == "runsc" and facts.podman and spec.network:
            raise fatal("image %r: under gVisor through Podman a container has no network "
                        "(runsc needs a network namespace that Podman's compat API does not "
                        "hand it); use network=False, or LocalProvider(isolation='gvisor')"
                        % spec.image)

    def _still_wanted(self, sandbox_id: str) -> None:
        if self.closing:
            raise fatal("sandbox %s: pool %s is shutting down" % (sandbox_id, self.pool))
        if sandbox_id in self.deleted:
            raise fatal("sandbox %s was deleted while it was being created" % sandbox_id)

    async def _create(self, sandbox_id: str, spec: SandboxSpec,
                      labels: Dict[str, str]) -> SandboxInfo:
        self._still_wanted(sandbox_id)
        image = self._image_of(spec)
        started = time.monotonic()
        await self._check_engine(spec)
        await self._ensure_image(image)
        self._still_wanted(sandbox_id)  # a pull can take minutes
        pulled = time.monotonic()
        run_dir = self.state / sandbox_id
        token = secrets.token_hex(16)
        config = self._container_config(sandbox_id, spec, image, labels, run_dir)
        self.specs[sandbox_id] = (spec, labels)
        try:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            # the image's user, whoever it is (a range id under a user namespace), makes
            # the socket here and removes the token once read; 0700 above it
            os.chmod(run_dir, 0o777)
            _write_token(run_dir / "token", token)
            container = await self._create_container(sandbox_id, config)
            created = time.monotonic()
            self._still_wanted(sandbox_id)
            await self._engine("start %s" % sandbox_id, container.start)
            pid = await self._started_pid(sandbox_id, container)
            await self._seal(sandbox_id, pid, spec)
            address = await self._wait_listening(sandbox_id, container, run_dir, token)
            self._still_wanted(sandbox_id)
        except BaseException:
            try:
                await asyncio.shield(self._remove_container(sandbox_id))
            except Exception as exc:  # keep the create's own error; the janitor tries later
                logger.warning("docker agent %s: cannot remove %s after a failed create: %s",
                               self.node_id, sandbox_id, exc)
            self._forget(sandbox_id)
            raise
        self.stats["creates"] += 1
        info = self.infos[sandbox_id] = self._info(
            sandbox_id, address, token, config["labels"], details={
                "container": container.id[:12], "engine": self.base_url, "image": image,
                "spec": spec, "alive": True, "runtime": self.runtime or self.facts.default_runtime,
                "user_namespace": "gvisor" if self.runtime == "runsc" else self.user_namespace,
                "host_root_id": _host_root_id(pid) if self.runtime != "runsc" else None,
                "disk_limit": spec.disk if self.disk_quota else None,
                "timings": {"image_s": pulled - started, "create_s": created - pulled,
                            "start_ready_s": time.monotonic() - created}})
        return info

    async def _started_pid(self, sandbox_id: str, container) -> int:
        """The host pid of the started container's first process (its daemon)."""
        await self._engine("inspect %s" % sandbox_id, container.reload)
        pid = (container.attrs.get("State") or {}).get("Pid") or 0
        if not pid:
            raise transient("sandbox %s: its container stopped as it started" % sandbox_id)
        return pid

    async def _seal(self, sandbox_id: str, pid: int, spec: SandboxSpec) -> None:
        """Before the daemon is reachable (nothing inside runs before a client
        connects): no nested user namespaces, and the network filter loaded into the
        container's namespace."""
        from sandman_ray.providers.network import load_filter, ray_node_addresses, ruleset
        from sandman_ray.providers.userns import forbid_nested_user_namespaces
        loop = asyncio.get_running_loop()
        try:  # (under runsc, namespaces made inside are gVisor's, not the host kernel's)
            if self.runtime != "runsc":
                await loop.run_in_executor(None, forbid_nested_user_namespaces, pid)
        except OSError as exc:
            raise transient("sandbox %s: %s" % (sandbox_id, exc)) from exc
        if spec.network:
            neighbours = await loop.run_in_executor(None, ray_node_addresses)
            rules = ruleset(spec.network_allow, neighbours,
                            serves=TCP_PORT if self.transport == "tcp" else None)
            try:
                await loop.run_in_executor(None, load_filter, sandbox_id,
                                           "/proc/%d/ns/net" % pid, rules)
            except SandboxLost as exc:
                raise transient(str(exc)) from exc

    def _create_call(self, config: dict):
        """The engine's create, with what the SDK does not pass: Podman's per-container
        user namespace."""
        from docker.models.containers import _create_container_args
        args = _create_container_args(dict(config, version=self.engine.api._version))
        if self.user_namespace == "auto" and self.facts.podman and self.runtime != "runsc":
            args["host_config"]["UsernsMode"] = "auto:size=%d" % IDS_PER_CONTAINER
        created = self.engine.api.create_container(**args)
        return self.engine.containers.get(created["Id"])

    async def _create_container(self, sandbox_id: str, config: dict):
        import docker.errors
        try:
            return await self._engine("create %s" % sandbox_id, self._create_call, config)
        except ProviderError as exc:
            cause = exc.__cause__
            if "enough available IDs" in str(cause):
                raise fatal("sandbox %s: %s" % (sandbox_id, NO_SUBIDS)) from cause
            if not (isinstance(cause, docker.errors.APIError) and cause.status_code == 409):
                raise
        # A container of that name exists: a create the engine finished after we gave up
        # on it. If it is this pool's sandbox of that id, replace it, so what runs is
        # exactly this spec with this token; anything else is not ours to remove.
        existing = await self._engine("inspect %s" % sandbox_id, self.engine.api.inspect_container,
                                      config["name"])
        theirs = (existing.get("Config") or {}).get("Labels") or {}
        if theirs.get(POOL_LABEL) != self.pool or theirs.get(SANDBOX_LABEL) != sandbox_id:
            raise fatal("sandbox %s: the container name %s is taken by a container that is not "
                        "this pool's" % (sandbox_id, config["name"]))
        await self._remove_container(sandbox_id)
        return await self._engine("create %s" % sandbox_id, self._create_call, config)

    def _info(self, sandbox_id, address, token, labels, created_at=None, details=None):
        return SandboxInfo(sandbox_id=sandbox_id, address=address, token=token,
                           node_id=self.node_id, labels=dict(labels),
                           created_at=created_at or time.time(), details=details or {})

    async def _wait_listening(self, sandbox_id: str, container, run_dir: Path,
                              token: str) -> str:
        """The daemon's address once it accepts connections. A unix socket appears
        under its final name only once it listens (the daemon renames it), so its
        path is the signal; a TCP port is tried until the daemon answers a hello.
        Every 0.25 s the container is asked whether it still runs, so a daemon that
        cannot start fails the create with its output instead of a timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        next_check = time.monotonic() + 0.25
        tcp = await self._published(sandbox_id, container) if self.transport == "tcp" else None
        pause = 0.005
        while time.monotonic() < deadline:
            if tcp is None:
                if (run_dir / "sock").exists():
                    return "unix:%s" % (run_dir / "sock")
            elif await self._answers(tcp, token):
                return tcp
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.25
                await self._engine("inspect %s" % sandbox_id, container.reload)
                state = container.attrs.get("State") or {}
                if container.status not in ("created", "running"):
                    logs = await self._engine("logs %s" % sandbox_id, container.logs, tail=20)
                    raise fatal("sandbox %s: its container %s (exit code %s%s) before the daemon "
                                "listened: %s" % (
                                    sandbox_id, container.status, state.get("ExitCode"),
                                    ", out of memory" if state.get("OOMKilled") else "",
                                    logs.decode(errors="replace").strip()[-2000:]))
            await asyncio.sleep(pause)
            if tcp is not None:
                pause = min(0.1, pause * 2)  # each try is a connection through the engine's proxy
        raise transient("sandbox %s: the daemon did not listen within %.0f s"
                        % (sandbox_id, self.ready_timeout_s))

    async def _published(self, sandbox_id: str, container) -> str:
        await self._engine("inspect %s" % sandbox_id, container.reload)
        ports = (container.attrs.get("NetworkSettings") or {}).get("Ports") or {}
        bound = ports.get("%d/tcp" % TCP_PORT) or []
        if not bound:
            raise fatal("sandbox %s: the engine published no port for the daemon" % sandbox_id)
        return "tcp:%s:%s" % (self.node_ip, bound[0]["HostPort"])

    @staticmethod
    async def _answers(address: str, token: str) -> bool:
        # the engine's proxy may accept before the daemon listens: only a hello counts
        from sandman_ray.client import AsyncDaemonClient
        try:
            client = await AsyncDaemonClient.connect(address, token, connect_timeout=1.0)
        except SandmanError:
            return False
        client.close()
        return True

    def _forget(self, sandbox_id: str) -> None:
        self.specs.pop(sandbox_id, None)
        self.infos.pop(sandbox_id, None)
        shutil.rmtree(self.state / sandbox_id, ignore_errors=True)

    async def _remove_container(self, sandbox_id: str) -> bool:
        """Remove the container and its anonymous volumes; False if there was none."""
        return await self._engine("remove %s" % sandbox_id, remove_container, self.engine,
                                  container_name(self.pool, sandbox_id))

    async def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox; a create of it still in flight is told to stop, and is
        waited for, so no container of it appears afterwards."""
        running = self.creating.running.get(sandbox_id)
        if running is not None:
            self.deleted.add(sandbox_id)
            await asyncio.gather(asyncio.shield(running), return_exceptions=True)
        if await self._remove_container(sandbox_id):
            self.stats["deletes"] += 1
        self._forget(sandbox_id)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        """A new container from the same image under the same name and id."""
        if sandbox_id not in self.specs:
            raise fatal("sandbox %s does not exist on node %s" % (sandbox_id, self.node_id))
        spec, labels = self.specs[sandbox_id]
        await self.delete(sandbox_id)
        return await self.create(sandbox_id, spec, labels)

    async def probe(self, sandbox_id: str) -> None:
        """Ping and ``exec true`` through the sandbox's address, from this node."""
        info = self.infos.get(sandbox_id)
        if info is None:
            raise transient("sandbox %s is not running on node %s" % (sandbox_id, self.node_id))
        await Provider.probe(self, info)

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """The engine's containers of this pool on this node whose labels include
        ``labels``, as the engine reports them. The token and spec are this agent's
        memory: a container it does not know gets no token (the pool then finds it
        does not answer, and deletes it)."""
        containers = await self._engine("list containers", list_containers, self.engine,
                                        self._mine(labels))
        infos = []
        for container in containers:
            own = container.get("Labels") or {}
            sandbox_id = own.get(SANDBOX_LABEL, "")
            known = self.infos.get(sandbox_id)
            running = container.get("State") == "running"
            details = {"container": container["Id"][:12], "status": container.get("State"),
                       "engine": self.base_url, "alive": running}
            if known is not None:
                details.update(spec=known.details["spec"], image=known.details["image"])
            infos.append(self._info(sandbox_id, known.address if known else "",
                                    known.token if known else "", own,
                                    created_at=known.created_at if known else None,
                                    details=details))
        return infos

    async def shutdown(self) -> int:
        """Remove every container of this pool on this node; returns how many. Creates
        still in flight stop at their next step and remove what they made."""
        self.closing = True
        await asyncio.gather(*[asyncio.shield(f) for f in self.creating.running.values()],
                             return_exceptions=True)
        infos = await self.list()
        await asyncio.gather(*(self.delete(info.sandbox_id) for info in infos))
        shutil.rmtree(self.state.parent, ignore_errors=True)
        return len(infos)


def _host_root_id(pid: int) -> Optional[int]:
    """The host uid that root inside process ``pid``'s user namespace is; None if gone."""
    try:
        with open("/proc/%d/uid_map" % pid) as fh:
            for line in fh:
                inside, outside, _ = line.split()
                if inside == "0":
                    return int(outside)
    except OSError:
        pass
    return None


def _write_token(path: Path, token: str) -> None:
    """The token where only the container's daemon reads it (0700 above), made afresh."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)


class DockerProvider(NodeAgentProvider):
    """Sandboxes as containers of the engine on each Ray node (Docker or Podman).

    base_url: the engine's API address on every node (default ``$DOCKER_HOST``, else
        ``unix:///var/run/docker.sock``); for Podman, the socket of
        ``podman system service``.
    transport: ``unix`` (the daemon's socket in a bind-mounted host directory; handles
        run on the sandbox's node) or ``tcp`` (published on the node's address, with
        the per-sandbox token; needs ``SandboxSpec(network=True)``).
    state_root: where each node keeps its sandboxes' socket directories.
    cache_root: where each node keeps the daemon bundle.
    ready_timeout_s: how long a new container's daemon may take to listen.
    max_engine_calls: most engine API calls in flight at once per node.
    user_namespace: ``auto`` (root inside is a range of host ids: Podman's
        ``--userns=auto``, Docker's ``userns-remap``) or ``host`` (root inside is host
        root: for trusted code only).
    runtime: the OCI runtime (``runsc`` for gVisor), else the engine's default.
    disk_quota: the engine's storage enforces ``storage_opt size`` (overlay on xfs with
        pquota, btrfs, zfs): each sandbox's disk is limited to ``SandboxSpec.disk``.
        Without it a container's disk is not limited.
    """

    supports_reset = True
    agent_kind = "docker-agent"

    def __init__(self, base_url: Optional[str] = None, transport: str = "unix",
                 state_root: str = DEFAULT_STATE_ROOT, cache_root: str = DEFAULT_CACHE_ROOT,
                 ready_timeout_s: float = 60.0, max_engine_calls: int = 16,
                 user_namespace: str = "auto", runtime: Optional[str] = None,
                 disk_quota: bool = False):
        super().__init__()
        if user_namespace not in ("auto", "host"):
            raise ValueError("DockerProvider.user_namespace must be 'auto' or 'host', got %r"
                             % (user_namespace,))
        if runtime is not None and (not isinstance(runtime, str) or
                                    not re.fullmatch(r"[A-Za-z0-9_.-]+", runtime)):
            raise ValueError("DockerProvider.runtime must be an OCI runtime's name such as "
                             "'runsc', got %r" % (runtime,))
        if transport not in ("unix", "tcp"):
            raise ValueError("DockerProvider.transport must be 'unix' or 'tcp', got %r"
                             % (transport,))
        if isinstance(max_engine_calls, bool) or not isinstance(max_engine_calls, int) \
                or max_engine_calls < 1:
            raise ValueError("DockerProvider.max_engine_calls must be a positive int, got %r"
                             % (max_engine_calls,))
        self.base_url = base_url or default_engine_url()
        self.transport, self.state_root, self.cache_root = transport, state_root, cache_root
        self.ready_timeout_s, self.max_engine_calls = ready_timeout_s, max_engine_calls
        self.user_namespace, self.runtime, self.disk_quota = user_namespace, runtime, disk_quota

    def agent_class(self):
        return DockerAgent

    def agent_args(self, node_id: str) -> tuple:
        return (self.pool, node_id, self.base_url, self.state_root, self.cache_root,
                self.ready_timeout_s, self.transport, self.max_engine_calls,
                self.user_namespace, self.runtime, self.disk_quota)
