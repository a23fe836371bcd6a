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
  per-sandbox token is a file in that directory, never a label or an env var;
- labels carry the pool, the sandbox id, the node and the agent's incarnation, so the
  pool lists and reconciles by label, and whatever an agent leaves when it dies is
  removed by its janitor (``providers/janitor.py``);
- no network unless the spec asks (``network_mode=none``); cpu, memory and pids limits
  from the spec;
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
import logging
import os
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import ray

from sandman_ray.errors import ProviderError, SandmanError
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
API_VERSION = "1.41"            # Docker 20.10+ and Podman 4 speak it


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


def container_name(pool: str, sandbox_id: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", "sandman-%s-%s" % (pool, sandbox_id))


def engine_error(exc: BaseException, what: str) -> ProviderError:
    """``exc`` from the SDK as a ProviderError whose kind tells the pool how to pace."""
    import docker.errors
    import requests.exceptions
    if isinstance(exc, ProviderError):
        return exc
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


class PullFailed(Exception):
    """The engine's own account of a failed pull."""


_PULL_FAILURES = (
    (("manifest unknown", "name unknown", "not found", "no such image", "does not exist"),
     "image %s does not exist in its registry"),
    (("unauthorized", "authentication required", "denied", "forbidden", "401", "403"),
     "the registry refused to serve image %s (credentials?)"),
    (("connection refused", "no such host", "dial tcp", "i/o timeout", "tls:", "network is unreachable",
      "server gave http response", "lookup ", "timeout"),
     "the registry of image %s is unreachable"),
)


def pull_error(image: str, exc: BaseException) -> ProviderError:
    """A failed pull, saying which failure it was: unknown image, refused credentials or
    an unreachable registry are fatal (the engine already retried); an engine that
    is itself unreachable or busy is transient."""
    import requests.exceptions
    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return engine_error(exc, "pull %s" % image)
    text = str(getattr(exc, "explanation", None) or exc)
    lowered = text.lower()
    for needles, message in _PULL_FAILURES:
        if any(n in lowered for n in needles):
            return fatal("%s: %s" % (message % image, text))
    return engine_error(exc, "pull %s" % image)


@ray.remote(num_cpus=0, max_restarts=0)
class DockerAgent:
    """Creates, resets and deletes one pool's containers on one node's engine."""

    def __init__(self, pool: str, node_id: str, base_url: str, state_root: str,
                 cache_root: str, ready_timeout_s: float, transport: str,
                 max_engine_calls: int):
        from sandman_ray.bundle import ensure_bundle
        self.pool, self.node_id, self.base_url = pool, node_id, base_url
        self.ready_timeout_s, self.transport = ready_timeout_s, transport
        self.incarnation = secrets.token_hex(8)
        # a directory per incarnation: the janitor of a dead agent removes its own
        # directory and containers, never those of the agent that replaced it
        self.state = Path(state_root) / pool / node_id[:16] / self.incarnation
        self.engine = engine_client(base_url, pool_size=max_engine_calls + 2)
        self.executor = ThreadPoolExecutor(max_engine_calls, thread_name_prefix="engine")
        self.engine_slots = asyncio.Semaphore(max_engine_calls)
        self.node_ip = ray.util.get_node_ip_address()
        self.creating = SingleFlight()
        self.closing = False  # shutdown began: no new containers
        self.pulling = SingleFlight()
        self.present: set = set()      # images known to be on this engine
        self.specs: Dict[str, tuple] = {}   # sandbox id -> (spec, labels), for reset
        self.infos: Dict[str, SandboxInfo] = {}  # what create returned, for probes
        self.stats = {"pulls": 0, "creates": 0, "deletes": 0}
        self._remove_leftovers()
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state, 0o700)
        self.bundle = ensure_bundle(Path(cache_root) / "bundle")
        self.janitor = self._start_janitor()

    # ---- lifecycle of the agent
    def _mine(self, extra: Optional[Dict[str, str]] = None) -> List[str]:
        labels = {POOL_LABEL: self.pool, NODE_LABEL: self.node_id}
        labels.update(extra or {})
        return ["%s=%s" % kv for kv in sorted(labels.items())]

    def _remove_leftovers(self) -> None:
        """Containers and state an earlier agent of this pool and node left behind
        (its janitor normally removes them; this covers a janitor that died too)."""
        try:
            for container in list_containers(self.engine, self._mine()):
                if (container.get("Labels") or {}).get(AGENT_LABEL) != self.incarnation:
                    self.engine.api.remove_container(container["Id"], force=True, v=True)
        except Exception as exc:  # the engine may be down now; creates will say so
            logger.warning("docker agent %s: could not list leftovers: %s", self.node_id, exc)
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
        """``fn(*args, **kwargs)`` on the thread pool, errors classified."""
        loop = asyncio.get_running_loop()
        async with self.engine_slots:
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
        try:  # not under engine_slots: a long pull must not hold up deletes
            await loop.run_in_executor(self.executor, self._pull_blocking, repository,
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
            command=["--listen", listen, "--token-file", SOCKET_DIR + "/token"],
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
        else:
            config["network_mode"] = "none"
        if spec.cpu:
            config["nano_cpus"] = int(spec.cpu * 1e9)
        if spec.memory:
            config["mem_limit"] = config["memswap_limit"] = spec.memory
        if spec.pids:
            config["pids_limit"] = spec.pids
        return config

    async def _create(self, sandbox_id: str, spec: SandboxSpec,
                      labels: Dict[str, str]) -> SandboxInfo:
        import docker.errors
        if self.closing:
            raise fatal("sandbox %s: pool %s is shutting down" % (sandbox_id, self.pool))
        image = self._image_of(spec)
        started = time.monotonic()
        await self._ensure_image(image)
        pulled = time.monotonic()
        run_dir = self.state / sandbox_id
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        os.chmod(run_dir, 0o777)  # the image's user, whoever it is, makes the socket here
        token = secrets.token_hex(16)
        token_file = run_dir / "token"
        token_file.write_text(token)
        os.chmod(token_file, 0o644)
        config = self._container_config(sandbox_id, spec, image, labels, run_dir)
        self.specs[sandbox_id] = (spec, labels)
        try:
            container = await self._engine("create %s" % sandbox_id,
                                           self.engine.containers.create, **config)
        except ProviderError as exc:
            if not (isinstance(exc.__cause__, docker.errors.APIError)
                    and exc.__cause__.status_code == 409):
                self._forget(sandbox_id)
                raise
            # a container of that name exists: a create the engine finished after we gave
            # up on it. Replace it, so what runs is exactly this spec with this token.
            await self._remove_container(sandbox_id)
            container = await self._engine("create %s" % sandbox_id,
                                           self.engine.containers.create, **config)
        created = time.monotonic()
        try:
            if self.closing:
                raise fatal("sandbox %s: pool %s is shutting down" % (sandbox_id, self.pool))
            await self._engine("start %s" % sandbox_id, container.start)
            address = await self._wait_listening(sandbox_id, container, run_dir, token)
        except BaseException:
            await self._remove_container(sandbox_id)
            self._forget(sandbox_id)
            raise
        self.stats["creates"] += 1
        info = self.infos[sandbox_id] = self._info(
            sandbox_id, address, token, config["labels"], details={
                "container": container.id[:12], "engine": self.base_url, "image": image,
                "timings": {"image_s": pulled - started, "create_s": created - pulled,
                            "start_ready_s": time.monotonic() - created}})
        return info

    def _info(self, sandbox_id, address, token, labels, created_at=None, details=None):
        return SandboxInfo(sandbox_id=sandbox_id, address=address, token=token,
                           node_id=self.node_id, labels=dict(labels),
                           created_at=created_at or time.time(), details=details or {})

    async def _wait_listening(self, sandbox_id: str, container, run_dir: Path,
                              token: str) -> str:
        """The daemon's address once it accepts connections. A unix socket appears
        under its final name only once it listens (the daemon renames it), so its
        path is the signal; a TCP port is tried until it answers. Every 0.25 s the
        container is asked whether it still runs, so a daemon that cannot start fails
        the create with its output instead of a timeout."""
        deadline = time.monotonic() + self.ready_timeout_s
        next_check = time.monotonic() + 0.25
        while time.monotonic() < deadline:
            address = await self._listening(sandbox_id, container, run_dir, token)
            if address:
                return address
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.25
                await self._engine("inspect %s" % sandbox_id, container.reload)
                if container.status not in ("created", "running"):
                    logs = await self._engine("logs %s" % sandbox_id, container.logs, tail=20)
                    raise transient("sandbox %s: its container %s before the daemon listened: %s"
                                    % (sandbox_id, container.status,
                                       logs.decode(errors="replace").strip()[-2000:]))
            await asyncio.sleep(0.005)
        raise transient("sandbox %s: the daemon did not listen within %.0f s"
                        % (sandbox_id, self.ready_timeout_s))

    async def _listening(self, sandbox_id: str, container, run_dir: Path,
                         token: str) -> Optional[str]:
        if self.transport == "unix":
            sock = run_dir / "sock"
            return "unix:%s" % sock if sock.exists() else None
        await self._engine("inspect %s" % sandbox_id, container.reload)
        ports = (container.attrs.get("NetworkSettings") or {}).get("Ports") or {}
        bound = ports.get("%d/tcp" % TCP_PORT) or []
        if not bound:
            return None
        address = "tcp:%s:%s" % (self.node_ip, bound[0]["HostPort"])
        # the engine's proxy may accept before the daemon listens: only a hello counts
        from sandman_ray.client import AsyncDaemonClient
        try:
            client = await AsyncDaemonClient.connect(address, token, connect_timeout=1.0)
        except SandmanError:
            return None
        client.close()
        return address

    def _forget(self, sandbox_id: str) -> None:
        self.specs.pop(sandbox_id, None)
        self.infos.pop(sandbox_id, None)
        shutil.rmtree(self.state / sandbox_id, ignore_errors=True)

    async def _remove_container(self, sandbox_id: str) -> bool:
        """Remove the container and its anonymous volumes; False if there was none."""
        try:
            await self._engine("remove %s" % sandbox_id, self.engine.api.remove_container,
                               container_name(self.pool, sandbox_id), force=True, v=True)
        except ProviderError as exc:
            if _no_such_container(exc.__cause__):
                return False
            raise
        return True

    async def delete(self, sandbox_id: str) -> None:
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
            for info in await self.list({SANDBOX_LABEL: sandbox_id}):
                break
            else:
                raise transient("sandbox %s has no container" % sandbox_id)
        await Provider.probe(self, info)

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """The engine's containers of this pool on this node whose labels include
        ``labels``, as the engine reports them."""
        containers = await self._engine("list containers", list_containers, self.engine,
                                        self._mine(labels))
        infos = []
        for container in containers:
            own = container.get("Labels") or {}
            sandbox_id = own.get(SANDBOX_LABEL, "")
            run_dir = self.state / sandbox_id
            try:
                token = (run_dir / "token").read_text()
            except OSError:
                token = ""  # state gone: the pool finds it does not answer and deletes it
            if self.transport == "unix":
                address = "unix:%s" % (run_dir / "sock")
            else:
                ports = [p.get("PublicPort") for p in container.get("Ports") or []
                         if p.get("PrivatePort") == TCP_PORT]
                address = "tcp:%s:%s" % (self.node_ip, ports[0] if ports else 0)
            infos.append(self._info(sandbox_id, address, token, own, details={
                "container": container["Id"][:12], "status": container.get("State"),
                "engine": self.base_url}))
        return infos

    async def shutdown(self) -> int:
        """Remove every container of this pool on this node; returns how many. Creates
        in flight finish first (they remove what they made), so none lands after."""
        self.closing = True
        await asyncio.gather(*[asyncio.shield(f) for f in self.creating.running.values()],
                             return_exceptions=True)
        infos = await self.list()
        await asyncio.gather(*(self.delete(info.sandbox_id) for info in infos))
        shutil.rmtree(self.state.parent, ignore_errors=True)
        return len(infos)


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
    """

    supports_reset = True
    agent_kind = "docker-agent"

    def __init__(self, base_url: Optional[str] = None, transport: str = "unix",
                 state_root: str = DEFAULT_STATE_ROOT, cache_root: str = DEFAULT_CACHE_ROOT,
                 ready_timeout_s: float = 60.0, max_engine_calls: int = 16):
        super().__init__()
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

    def agent_class(self):
        return DockerAgent

    def agent_args(self, node_id: str) -> tuple:
        return (self.pool, node_id, self.base_url, self.state_root, self.cache_root,
                self.ready_timeout_s, self.transport, self.max_engine_calls)
