"""DockerAgent: the actor that creates, resets, pauses and deletes one pool's containers
on one node's engine, and keeps the pool's snapshots there (see
``providers/docker/provider.py`` for what each container and snapshot is)."""

import asyncio
import logging
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import ray

from sandman_ray.errors import NotSupported, ProviderError, SandmanError
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, SandboxInfo, SnapshotInfo, check_answers, fatal, transient)
from sandman_ray.providers.docker.engine import (
    EngineFacts, PullFailed, commit_changes, commit_container, container_name, engine_client,
    engine_error, is_snapshot_reference, list_containers, pull_error,
    remove_container, remove_containers, remove_snapshot_image, remove_snapshot_images,
    short_name, snapshot_base, snapshot_images, snapshot_info, snapshot_labels,
    snapshot_reference)
from sandman_ray.providers.docker.container import (
    AGENT_LABEL, NO_SUBIDS, NODE_LABEL, TCP_PORT, ContainerSpecs)
from sandman_ray.providers.nodes import SingleFlight
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

PULLS_AT_ONCE = 4               # image pulls in flight per node (each holds a thread)


# its calls (creates, resets, deletes by the thousand) are not recorded as Ray task
# events: see sandman_ray.host
@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)
class DockerAgent(ContainerSpecs):
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
        self.state = Path(state_root) / short_name(pool, node_id) / self.incarnation[:8]
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
        # image -> its config's Env, as the engine inspected it (launch_environment)
        self.image_envs: Dict[str, List[str]] = {}
        self.specs: Dict[str, tuple] = {}        # sandbox id -> (spec, labels), for reset
        self.infos: Dict[str, SandboxInfo] = {}  # sandbox id -> what its create returned
        self.holds: Dict[str, asyncio.Lock] = {}  # sandbox id -> one snapshot/pause at a time
        self.snapshotting: set = set()  # names of the snapshots being taken
        self.stats = {"pulls": 0, "creates": 0, "deletes": 0}
        self._remove_leftovers()
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state.parent, 0o700)
        self.bundle = ensure_bundle(Path(cache_root) / "bundle")
        self.janitor = self._start_janitor()

    # ---- lifecycle of the agent

    def __repr__(self) -> str:
        """What the Ray dashboard and Ray's messages call this actor."""
        return "DockerAgent(pool=%s, node=%s, engine=%s)" % (
            self.pool, (self.node_id or "?")[:12], self.base_url)

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
        if is_snapshot_reference(image):  # never pulled: it exists on one engine only
            raise fatal("image %r: no such snapshot on node %s's engine (deleted, or taken "
                        "on another node)" % (image, self.node_id))
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
        own_env, environ = self.launch_environment(spec, await self._image_env(image))
        config = self._container_config(sandbox_id, spec, image, labels, run_dir, own_env)
        self.specs[sandbox_id] = (spec, labels)
        try:
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            # the image's user, whoever it is (a range id under a user namespace), makes
            # the socket here and removes the token once read; 0700 above it
            os.chmod(run_dir, 0o777)
            _write_token(run_dir / "token", token.encode() + b"\n" + environ)
            container = await self._create_container(sandbox_id, config)
            created = time.monotonic()
            self._still_wanted(sandbox_id)
            started_wall = time.time()
            await self._engine("start %s" % sandbox_id, container.start)
            pid = await self._started_pid(sandbox_id, container)
            await self._seal(sandbox_id, pid, spec)
            address = await self._wait_listening(sandbox_id, container, run_dir, token)
            self._still_wanted(sandbox_id)
            info = self._info(
                sandbox_id, address, token, config["labels"], created_at=started_wall, spec=spec,
                details={
                    "container": container.id[:12], "engine": self.base_url, "image": image,
                    "runtime": self.runtime or self.facts.default_runtime,
                    "user_namespace": "gvisor" if self.runtime == "runsc" else self.user_namespace,
                    "host_root_id": _host_root_id(pid) if self.runtime != "runsc" else None,
                    "disk_limit": spec.disk if self.disk_quota else None})
            await check_answers(info)  # what READY means, from this node
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
        info.details["timings"] = {"image_s": pulled - started, "create_s": created - pulled,
                                   "start_ready_s": time.monotonic() - created}
        self.infos[sandbox_id] = info
        return info

    async def _started_pid(self, sandbox_id: str, container) -> int:
        """The host pid of the started container's first process (its daemon)."""
        await self._engine("inspect %s" % sandbox_id, container.reload)
        pid = (container.attrs.get("State") or {}).get("Pid") or 0
        if not pid:
            raise transient("sandbox %s: its container stopped as it started" % sandbox_id)
        return pid

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

    def _info(self, sandbox_id, address, token, labels, created_at=None, spec=None,
              alive=True, details=None):
        return SandboxInfo(sandbox_id=sandbox_id, address=address, token=token,
                           node_id=self.node_id, labels=dict(labels),
                           created_at=created_at or time.time(), spec=spec, alive=alive,
                           details=details or {})

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
        self.holds.pop(sandbox_id, None)
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
                       "engine": self.base_url}
            if known is not None:
                details.update(image=known.details["image"])
            infos.append(self._info(sandbox_id, known.address if known else "",
                                    known.token if known else "", own,
                                    created_at=known.created_at if known else None,
                                    spec=known.spec if known else None, alive=running,
                                    details=details))
        return infos

    # ---- snapshots and pauses
    def _hold(self, sandbox_id: str) -> asyncio.Lock:
        """One snapshot, pause or resume of a sandbox at a time: a resume in the middle
        of a snapshot would let the sandbox's processes run while its layer's files
        have their ids inside (``engine.commit_container``)."""
        return self.holds.setdefault(sandbox_id, asyncio.Lock())

    async def _inspect(self, sandbox_id: str, what: str) -> dict:
        """The engine's inspection of the sandbox's container, which must be up
        (running or paused)."""
        import docker.errors
        try:
            container = await self._engine(what, self.engine.api.inspect_container,
                                           container_name(self.pool, sandbox_id))
        except ProviderError as exc:
            if isinstance(exc.__cause__, docker.errors.NotFound):
                raise fatal("%s: no such sandbox in pool %s on node %s"
                            % (what, self.pool, self.node_id)) from None
            raise
        status = (container.get("State") or {}).get("Status")
        if status not in ("running", "paused"):
            raise fatal("%s: its container is %s" % (what, status))
        return container

    async def _image_env(self, image: str) -> List[str]:
        """The image's own environment (its config's Env), asked of the engine once per
        image this agent runs."""
        if image not in self.image_envs:
            found = await self._image(image, "inspect image %s" % image)
            if found is None:
                raise transient("image %s: gone from the engine as it was used" % image)
            self.image_envs[image] = list((found.get("Config") or {}).get("Env") or ())
        return self.image_envs[image]

    async def _image(self, reference: str, what: str) -> Optional[dict]:
        """The engine's inspection of an image; None if it has none of that name."""
        import docker.errors
        try:
            return await self._engine(what, self.engine.api.inspect_image, reference)
        except ProviderError as exc:
            if isinstance(exc.__cause__, docker.errors.ImageNotFound):
                return None
            raise

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        """Commit the sandbox's container to the image ``snapshot_reference(pool, name)``
        of this node's engine: its files (the writable layer over its image), not its
        processes or memory, nor the bind mounts (the daemon bundle, the socket
        directory), which are not part of any layer. The image starts like its base:
        the entrypoint, command, working directory and user are its base's again; the
        environment and labels the sandbox's container had stay (an engine cannot drop
        them), except that it no longer names a sandbox or an agent.

        The SnapshotInfo's base is the image below every snapshot layer (the one a
        snapshot's sandbox ran, for a snapshot of a sandbox started from a snapshot);
        size_bytes is the engine's size of the snapshot's image minus that base's, so
        it counts the layers of every snapshot in between. A name the pool has on this
        engine, or one being taken, is a fatal error; so is a snapshot under gVisor
        (NotSupported), whose files the engine's commit does not see."""
        reference = snapshot_reference(self.pool, name)  # fatal for a name that is no tag
        what = "snapshot sandbox %s as %r" % (sandbox_id, name)
        if self.runtime == "runsc":
            raise NotSupported(
                "%s: under gVisor (runtime='runsc') a sandbox's files live in gVisor's "
                "memory-backed overlay, which the engine's commit does not see; a snapshot "
                "needs runc" % what)
        if name in self.snapshotting or await self._image(reference, what) is not None:
            raise fatal("%s: pool %s has a snapshot of that name on node %s (image %s)"
                        % (what, self.pool, self.node_id, reference))
        self.snapshotting.add(name)
        try:
            async with self._hold(sandbox_id):
                container = await self._inspect(sandbox_id, what)
                ran = self._image_ran(sandbox_id, container)
                below = await self._image(ran, what)
                if below is None:
                    raise fatal("%s: the image it ran, %s, is gone from the engine"
                                % (what, ran))
                base, base_bytes = snapshot_base(ran, below)
                labels = snapshot_labels(self.pool, name, base, base_bytes, sandbox_id,
                                         time.time())
                changes = commit_changes(labels, (SANDBOX_LABEL, AGENT_LABEL), container,
                                         below)
                await self._engine(what, commit_container, self.engine, container, reference,
                                   changes)
            image = await self._image(reference, what)
        finally:
            self.snapshotting.discard(name)
        info = snapshot_info(image or {}, self.node_id)
        if info is None:
            raise fatal("%s: the engine does not show the committed image %s"
                        % (what, reference))
        self.present.add(reference)
        logger.info("docker agent %s: snapshot %s of sandbox %s: %s, %d bytes over %s",
                    self.node_id, name, sandbox_id, reference, info.size_bytes, base)
        return info

    def _image_ran(self, sandbox_id: str, container: dict) -> str:
        """The reference of the image the sandbox's container runs."""
        known = self.infos.get(sandbox_id)
        if known is not None and known.details.get("image"):
            return known.details["image"]
        return (container.get("Config") or {}).get("Image") or container["Image"]

    async def snapshots(self) -> List[SnapshotInfo]:
        """This pool's snapshots on this node's engine, found by their images' labels."""
        images = await self._engine("list the snapshots of pool %s" % self.pool,
                                    snapshot_images, self.engine, self.pool)
        infos = [snapshot_info(image, self.node_id) for image in images]
        return [info for info in infos if info is not None]

    async def delete_snapshot(self, name: str) -> None:
        """Remove the snapshot's image from this node's engine; one gone already is not
        an error. Containers still running from it: a fatal error naming them."""
        reference = snapshot_reference(self.pool, name)
        self.present.discard(reference)
        self.image_envs.pop(reference, None)
        await self._engine("delete snapshot %r of pool %s" % (name, self.pool),
                           remove_snapshot_image, self.engine, reference)

    async def pause(self, sandbox_id: str, reclaim: bool = False) -> None:
        """Freeze every process of the sandbox, its daemon too, keeping their memory
        (the engine's pause: the container's cgroup frozen). A paused sandbox stays
        paused. ``reclaim`` is refused: the engine's API has no word for it."""
        what = "pause sandbox %s" % sandbox_id
        if reclaim:
            raise NotSupported("%s with reclaim=True: the DockerProvider's engine cannot "
                               "push a container's memory out (the LocalProvider can)" % what)
        async with self._hold(sandbox_id):
            container = await self._inspect(sandbox_id, what)
            if not container["State"].get("Paused"):
                await self._engine(what, self.engine.api.pause, container["Id"])

    async def resume(self, sandbox_id: str) -> None:
        """Let a paused sandbox's processes run on from where they stopped. A running
        sandbox stays running."""
        what = "resume sandbox %s" % sandbox_id
        async with self._hold(sandbox_id):
            container = await self._inspect(sandbox_id, what)
            if container["State"].get("Paused"):
                await self._engine(what, self.engine.api.unpause, container["Id"])

    async def shutdown(self) -> int:
        """Remove every container of this pool on this node, then the pool's snapshots
        on this node's engine; returns how many containers. Creates still in flight
        stop at their next step and remove what they made."""
        self.closing = True
        await asyncio.gather(*[asyncio.shield(f) for f in self.creating.running.values()],
                             return_exceptions=True)
        infos = await self.list()
        await asyncio.gather(*(self.delete(info.sandbox_id) for info in infos))
        shutil.rmtree(self.state.parent, ignore_errors=True)
        removed = await self._engine("remove the snapshots of pool %s" % self.pool,
                                     remove_snapshot_images, self.engine, self.pool)
        self.present.clear()
        self.image_envs.clear()
        if removed:
            logger.info("docker agent %s: removed %d snapshots of pool %s", self.node_id,
                        removed, self.pool)
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


def _write_token(path: Path, data: bytes) -> None:
    """The token (and the sandbox's environment after it) where only the container's
    daemon reads it (0700 above), made afresh."""
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
