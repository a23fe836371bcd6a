"""NodeAgent: the actor that starts, resets and deletes one pool's sandboxes on one
node (bubblewrap, ``providers/local/bwrap.py``, or gVisor, ``providers/local/gvisor.py``),
and the cgroups of its incarnations."""

import asyncio
import dataclasses
import hmac
import logging
import os
import re
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import ray

from sandman_ray.errors import NotSupported, ProviderError, SandboxLost
from sandman_ray.providers.base import (
    SandboxInfo, bind_daemon, check_answers, fatal, transient)
from sandman_ray.providers.mounts import ensure_nosuid_nodev
from sandman_ray.providers.network import node_routes, ray_node_addresses
from sandman_ray.providers.local.agent_snapshots import AgentSnapshots
from sandman_ray.providers.local.cpu_shares import CpuShares
from sandman_ray.providers.nodes import SingleFlight
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

# Lock files of the uid ranges that sandboxes of this host hold (providers/userns.py):
# one place for every pool and state root, on a tmpfs that a reboot empties.
RANGE_LOCKS = "/run/sandman-ray/id-ranges"
# Threads that start (and stop) sandboxes side by side. Each sandbox's bwrap dies with
# the thread that started it (its parent-death signal), so they are threads that live
# as long as the agent: an executor's workers never exit before it shuts down, which an
# agent's never does.
LAUNCH_THREADS = 4


# its calls (creates, resets, deletes by the thousand) are not recorded as Ray task
# events: see sandman_ray.host
@ray.remote(num_cpus=0, max_restarts=0, enable_task_events=False)
class NodeAgent(AgentSnapshots):
    """Starts, resets and deletes the sandboxes of one pool on one node."""

    def __init__(self, pool: str, node_id: str, state_root: str, cache_root: str,
                 prefer_tools: bool = True, ready_timeout_s: float = 30.0,
                 user_namespaces: bool = True, isolation: str = "namespaces",
                 snapshot_root: Optional[str] = None, snapshot_bytes: Optional[int] = None,
                 table_needs=None, image_roots: Tuple[str, ...] = (),
                 image_cache_bytes: Optional[int] = None):
        from sandman_ray.bundle import ensure_bundle
        from sandman_ray.images import ImageCache
        from sandman_ray.providers.local.bwrap import secure_root, view_root
        from sandman_ray.providers.userns import Ranges, supported
        self.pool, self.node_id, self.ready_timeout_s = pool, node_id, ready_timeout_s
        self.isolation = isolation
        # the node's pid, task and open-file tables hold the pool's worst case, or no agent
        from sandman_ray.providers.local.host_tables import PoolNeeds, hold
        hold(table_needs or PoolNeeds.of(None), pool)
        self.state_root = secure_root(Path(state_root))
        self.view_root = view_root(self.state_root)
        self.routes = node_routes()  # the node's gateways and on-link subnets
        cache = secure_root(Path(cache_root))
        # a directory per incarnation: the janitor of a dead agent of this pool and node
        # kills and removes what names its own directory, never the next agent's
        self.state = self.state_root / pool / node_id[:16] / secrets.token_hex(4)
        self.cgroup_parent = "sandman/" + agent_group(pool, node_id, self.state.name)
        self._remove_leftovers()
        self.state.mkdir(parents=True, exist_ok=True)
        self.janitor = self._start_janitor()
        self.bundle = ensure_bundle(cache / "bundle")
        from sandman_ray.providers.local.snapshots import SnapshotStore
        # this node's own store: nodes that share a machine share none; on a mount
        # that honours no setuid bit (a snapshot keeps its files' bits: setuid-root
        # copies of the tenant's, which only forks, nosuid too, should ever run)
        store_root = secure_root(Path(snapshot_root) if snapshot_root else
                                 self.state_root / ".snapshots")
        if os.geteuid() == 0:
            ensure_nosuid_nodev(store_root)
        snapshots = secure_root(store_root / node_id[:16])
        self.images = ImageCache(cache / "images", prefer_tools=prefer_tools,
                                 snapshots_root=snapshots, image_roots=image_roots,
                                 reserved=(self.state_root, cache, store_root),
                                 snapshot_store=SnapshotStore, budget_bytes=image_cache_bytes)
        self.snapshot_store = SnapshotStore(snapshots, pool)
        from sandman_ray.providers.local.cache_metrics import ImageCacheMetrics
        self.cache_metrics = ImageCacheMetrics(pool)
        if snapshot_bytes is None:
            fs = os.statvfs(snapshots)
            snapshot_bytes = fs.f_blocks * fs.f_frsize // 2
        # An agent that is not root runs each sandbox in a user namespace of its own uid
        # alone (bwrap.SandboxProcess, unprivileged): no ranges, no cgroups
        self.unprivileged = os.geteuid() != 0
        if self.unprivileged and isolation == "gvisor":
            raise ValueError("LocalProvider(isolation='gvisor') needs the node agent to run "
                             "as root (uid %d here)" % os.geteuid())
        # gVisor's own kernel stands between sandbox and host: no range is needed
        ranged = user_namespaces and isolation != "gvisor" and not self.unprivileged
        why_not = supported() if ranged else None
        self.ranges = Ranges(RANGE_LOCKS) if ranged and why_not is None else None
        if self.unprivileged:
            logger.warning("pool %s: the agent on node %s is not root: its sandboxes run in a "
                           "user namespace of uid %d alone, with limits by prlimit and "
                           "the writable layer's size, no cgroups", pool, node_id[:12],
                           os.geteuid())
        if why_not is not None:
            logger.warning("pool %s: sandboxes on node %s run without a user namespace "
                           "(root inside is host root with fewer capabilities): %s",
                           pool, node_id[:12], why_not)
        self.sandboxes: Dict[str, object] = {}   # sandbox id -> SandboxProcess
        self.labels: Dict[str, Dict[str, str]] = {}
        self.bound: Dict[str, SandboxSpec] = {}  # sandbox id -> its spec with its lease's
        self.creating = SingleFlight()  # a retried create joins the one in flight
        self.fetching = SingleFlight()  # snapshots being brought from another node
        self.locks: Dict[str, asyncio.Lock] = {}  # sandbox id -> its snapshot/pause lock
        self.resetting = set()  # sandboxes being reset: no holder's token is taken
        # sandbox id -> its reset in flight (a shutdown, and its delete, wait for it)
        self.resets: Dict[str, asyncio.Future] = {}
        self.cpu = CpuShares(self._cpu_weight, self._cpu_procs)  # leased sandboxes' weights
        # copies run on threads of their own: a slow one never holds up creates
        self.capturing = ThreadPoolExecutor(2, thread_name_prefix="sandman-snapshot")
        self.captures = set()  # copies in flight (a shutdown waits for them)
        # what the pool's snapshots may hold on this node (None: half the store's
        # filesystem; SnapshotStore.room also keeps a tenth of it free)
        self.snapshot_bytes = snapshot_bytes
        self.launchers = ThreadPoolExecutor(LAUNCH_THREADS, thread_name_prefix="sandman-launch")
        self.renewing = None  # a NamespaceThread, made on the first renew
        self.closed = False  # shut down: no sandbox may start or stay
        self.budget_watch = None  # budgets.watch, started with the first sandbox
        self.control = None  # the control socket's server (control_address starts it)
        self.control_lock = asyncio.Lock()

    def __repr__(self) -> str:
        """What the Ray dashboard and Ray's messages call this actor."""
        return "NodeAgent(pool=%s, node=%s, %d sandboxes%s)" % (
            self.pool, (self.node_id or "?")[:12], len(getattr(self, "sandboxes", ())),
            ", shut down" if getattr(self, "closed", False) else "")

    def _remove_leftovers(self) -> None:
        """What a dead agent of this pool and node left: its sandboxes died with it,
        their state directories and cgroups did not (nor, in their cgroups, a daemon
        that outlived its bwrap)."""
        from sandman_ray.providers.janitor import clean_cgroups
        shutil.rmtree(self.state.parent, ignore_errors=True)
        clean_cgroups(agent_groups(self.pool, self.node_id))

    def _start_janitor(self):
        """A process that cleans this agent's state once the agent is gone."""
        from sandman_ray.providers import janitor
        from sandman_ray.providers.local.cgroups import Cgroups
        self.cgroup_dirs = Cgroups.locations(self.cgroup_parent)
        return janitor.start([str(self.state)] + self.cgroup_dirs)

    def ready(self) -> str:
        return self.node_id

    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        if self.closed:
            raise fatal("the agent of pool %s on node %s is shut down" % (self.pool, self.node_id))
        if sandbox_id in self.sandboxes and sandbox_id not in self.creating.running:
            return self._info(sandbox_id)  # made, and answered (a retry after a timeout)
        return await self.creating.run(sandbox_id,
                                       lambda: self._create(sandbox_id, spec, labels))

    async def _create(self, sandbox_id, spec, labels) -> SandboxInfo:
        from sandman_ray.providers.local.bwrap import SandboxProcess
        from sandman_ray.providers.local.gvisor import GvisorProcess
        self._watch_budgets()
        loop = asyncio.get_running_loop()
        try:
            image = await loop.run_in_executor(None, self.images.prepare, spec.image)
            self.cache_metrics.refresh(self.images.budget.last())
        except ProviderError:
            raise
        except Exception as exc:  # a hostile image's parse, whatever breaks: refused
            raise fatal("image %r: %s" % (spec.image, exc)) from exc
        try:
            ids = (await loop.run_in_executor(None, self.ranges.take, sandbox_id)
                   if self.ranges is not None else None)
        except OSError as exc:
            raise transient("sandbox %s: no uid range: %s" % (sandbox_id, exc)) from exc
        kind = GvisorProcess if self.isolation == "gvisor" else SandboxProcess
        extra = {"unprivileged": True} if self.unprivileged else {
            "cgroup_group": "%s/%s" % (self.cgroup_parent, sandbox_id), "ids": ids}
        try:
            sandbox = kind(sandbox_id, image, self.bundle, self.state / sandbox_id, spec,
                           view_root=self.view_root, **extra)
        except BaseException:
            if ids is not None:
                self.ranges.give_back(sandbox_id, True)  # nothing of it ever ran
            raise
        try:
            if spec.network:  # no route to any node of the cluster, this one's or
                # another's, nor to this node's own neighbours (gateways, on-link subnets)
                sandbox.neighbours = await loop.run_in_executor(None, ray_node_addresses) + \
                    self.routes
            await self._launch(sandbox)
            await sandbox.wait_ready(self.ready_timeout_s)
        except BaseException as exc:  # whatever failed: its range, cgroups, state go
            await self._removed_after(sandbox, exc)
            if isinstance(exc, SandboxLost):
                raise transient(str(exc)) from exc
            if isinstance(exc, Exception) and not isinstance(exc, ProviderError):
                raise fatal("sandbox %s cannot start: %s: %s"
                            % (sandbox_id, type(exc).__name__, exc)) from exc
            raise
        if self.closed:  # shut down while it started: nothing of it may stay
            await self._remove(sandbox)
            raise fatal("the agent of pool %s on node %s was shut down during the create of %s"
                        % (self.pool, self.node_id, sandbox_id))
        self.sandboxes[sandbox_id] = sandbox
        self.labels[sandbox_id] = dict(labels)
        if sandbox.renewable:  # its next generation, made while it serves this one
            loop.run_in_executor(None, self._prepare, sandbox)
        try:
            await check_answers(self._info(sandbox_id))  # what READY means, on this node
        except BaseException:
            await self._delete(sandbox_id)
            raise
        return self._info(sandbox_id)

    def _watch_budgets(self) -> None:
        """Under cgroup v1, hold the sandboxes' socket buffers to their memory limits
        (budgets.py), from the first sandbox on."""
        from sandman_ray.providers.local import budgets
        if self.budget_watch is not None or self.unprivileged:
            return
        parent = budgets.v1_parent(self.cgroup_parent)
        if parent is not None:
            self.budget_watch = asyncio.ensure_future(
                budgets.watch(parent, lambda: self.sandboxes, lambda: self.closed))

    async def _launch(self, sandbox) -> None:
        """Start ``sandbox``'s chain on a launcher thread (which lives as long as this
        actor, as its bwrap must not outlive it)."""
        await asyncio.get_running_loop().run_in_executor(self.launchers, sandbox.launch)

    def _prepare(self, sandbox) -> None:
        try:
            sandbox.prepare_layer()
        except OSError as exc:  # its resets start it afresh
            logger.warning("pool %s: sandbox %s: no layer made ahead: %s", self.pool,
                           sandbox.sandbox_id, exc)

    def _info(self, sandbox_id: str) -> SandboxInfo:
        sandbox = self.sandboxes[sandbox_id]
        return SandboxInfo(
            sandbox_id=sandbox_id, address=sandbox.address, token=sandbox.token,
            node_id=self.node_id, labels=self._labels(sandbox_id), created_at=sandbox.started_at,
            spec=self.bound.get(sandbox_id, sandbox.spec), alive=sandbox.alive,
            details={"image": sandbox.image.image, "digest": sandbox.image.digest,
                     "unpacked_by": sandbox.image.unpacked_by, "limits": dict(sandbox.applied),
                     "pid": sandbox.proc.pid if sandbox.proc else None,
                     # root inside is this host uid and gid (None: host root)
                     "host_root_id": sandbox.ids.base if sandbox.ids else (
                         os.geteuid() if self.unprivileged else None),
                     "isolation": self.isolation})

    async def weigh(self, weights: Dict[str, tuple]) -> None:
        """Each leased sandbox's client and share of this node's CPU
        (``Provider.weigh``; providers/local/cpu_shares.py)."""
        for sandbox_id, (client, weight) in weights.items():
            if sandbox_id in self.sandboxes and sandbox_id not in self.resetting:
                self.cpu.set(sandbox_id, client, weight)

    def _cpu_weight(self, sandbox_id: str, weight: float) -> None:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None and sandbox.cgroups is not None:
            sandbox.cgroups.weigh(weight)

    def _cpu_procs(self, sandbox_id: str) -> Optional[str]:
        sandbox = self.sandboxes.get(sandbox_id)
        return sandbox.cgroups.cpu_procs() if sandbox and sandbox.cgroups else None

    async def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox and what it left, once its create or reset in flight (if
        any) has ended: removed under a reset, it would be started again on a range
        given back; under its create, it would appear after its delete."""
        running = [task for task in (self.creating.running.get(sandbox_id),
                                     self.resets.get(sandbox_id)) if task is not None]
        if running:
            await asyncio.wait(running)
        await self._delete(sandbox_id)

    async def _delete(self, sandbox_id: str) -> None:
        self.cpu.forget(sandbox_id)
        sandbox = self.sandboxes.pop(sandbox_id, None)
        self.labels.pop(sandbox_id, None)
        self.bound.pop(sandbox_id, None)
        self.locks.pop(sandbox_id, None)
        if sandbox is not None:
            await self._remove(sandbox)

    async def _removed_after(self, sandbox, failure: BaseException) -> None:
        """Remove ``sandbox`` after its start or reset failed with ``failure``, even
        when that was this call's cancellation (the removal then still runs to its
        end, shielded)."""
        removal = asyncio.ensure_future(self._remove(sandbox))
        try:
            await asyncio.shield(removal)
        except asyncio.CancelledError:
            await removal  # cancelled again while removing: finish it first
            raise
        logger.info("pool %s: sandbox %s removed after a failed start: %s: %s", self.pool,
                    sandbox.sandbox_id, type(failure).__name__, failure)

    async def _remove(self, sandbox) -> None:
        await asyncio.get_running_loop().run_in_executor(None, sandbox.remove)
        if not sandbox.emptied:
            logger.error("pool %s: sandbox %s: a process of it outlived every kill; its uid "
                         "range is not lent again", self.pool, sandbox.sandbox_id)
        if self.ranges is not None:
            self.ranges.give_back(sandbox.sandbox_id, sandbox.emptied)

    async def reset(self, sandbox_id: str, token: Optional[str] = None
                    ) -> Optional[SandboxInfo]:
        """The sandbox as new, with a new token: renewed in place where it can be
        (providers/local/renew.py: its processes killed, a fresh writable layer, the
        daemon's state cleared), else its processes killed (its writable layer goes
        with them) and started again on the same image; answer when it answers. With
        ``token`` (a holder's renew), only while the sandbox takes it, checked once every
        reset under way has ended: None when it does not (a reset by the pool that came
        first gave the sandbox a token the old holder never sees)."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            if token is not None:
                return None
            raise fatal("sandbox %s does not exist on node %s" % (sandbox_id, self.node_id))
        async with self._lock(sandbox_id):  # after a snapshot or pause under way
            while sandbox_id in self.resets:  # and after a reset under way: one at a time
                await asyncio.wait([self.resets[sandbox_id]])
            if token is not None and not self._takes(sandbox_id, token):
                return None
            if self.sandboxes.get(sandbox_id) is not sandbox:  # deleted meanwhile
                raise fatal("sandbox %s was deleted on node %s before its reset began"
                            % (sandbox_id, self.node_id))
            # the lease's token is refused from here on, before the new one exists: a
            # pause of the lease that ended must not freeze the next holder's sandbox
            self.resetting.add(sandbox_id)
            self.bound.pop(sandbox_id, None)  # the lease's labels (its daemon forgets the rest)
            if sandbox.cgroups is not None and sandbox.cgroups.frozen():
                sandbox.cgroups.thaw()  # a lease that ended paused: its daemon must answer
            # run to its end even if its caller gives up: a shutdown waits for it, and
            # no relaunch of it can start once the agent is closing
            task = asyncio.ensure_future(self._reset(sandbox))
            self.resets[sandbox_id] = task
            task.add_done_callback(lambda _: self._reset_ended(sandbox_id, task))
        info = await asyncio.shield(task)
        if token is None:  # the next holder's client weighs it anew (a holder's renew
            self.cpu.set(sandbox_id, None, 1.0)  # keeps its client's weight)
        return info

    async def bind_task(self, sandbox_id: str, env: Dict[str, str], workdir: Optional[str],
                        labels: Dict[str, str]) -> None:
        """A lease's own settings (Provider.bind_task), until the sandbox's next reset."""
        self._sandbox(sandbox_id, "bind")  # one of this node
        async with self._lock(sandbox_id):
            if env or workdir:
                await bind_daemon(self._info(sandbox_id), env, workdir)
            await self.note_task(sandbox_id, self.sandboxes[sandbox_id].token, env, workdir,
                                 labels)

    async def note_task(self, sandbox_id: str, token: str, env: Dict[str, str],
                        workdir: Optional[str], labels: Dict[str, str]) -> None:
        """The settings the daemon took for the lease of ``token``, for the sandbox's
        listing (its labels, and the spec a restarted pool finds), until its next
        reset; nothing once that token is gone (a word that came late)."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is not None and self._takes(sandbox_id, token):
            self.bound[sandbox_id] = dataclasses.replace(
                sandbox.spec, env=dict(env), workdir=workdir, labels=dict(labels))

    async def prefetch(self, image: str) -> Dict[str, object]:
        """``image`` unpacked in this node's cache for sandboxes to come (it may be
        evicted again before they come, once the cache passes its budget)."""
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(
                None, self.images.prepare, image)
        except ProviderError:
            raise
        except Exception as exc:  # a hostile image's parse, whatever breaks: refused
            raise fatal("image %r: %s" % (image, exc)) from exc
        prepared.release()
        self.cache_metrics.refresh(self.images.budget.last())
        return {"digest": prepared.digest, "unpacked_by": prepared.unpacked_by}

    async def image_cache(self) -> Dict[str, int]:
        """The node's image cache: its bytes, entries and budget, and this agent's
        hits, misses and evictions (image_budget.py)."""
        return await asyncio.get_running_loop().run_in_executor(
            None, self.images.budget.status)

    def _labels(self, sandbox_id: str) -> Dict[str, str]:
        """The sandbox's labels: its own over its lease's."""
        bound = self.bound.get(sandbox_id)
        return dict(bound.labels if bound else {}, **self.labels[sandbox_id])

    def _reset_ended(self, sandbox_id: str, task: asyncio.Future) -> None:
        if self.resets.get(sandbox_id) is task:  # (not a later reset's)
            del self.resets[sandbox_id]
            self.resetting.discard(sandbox_id)

    async def _reset(self, sandbox) -> SandboxInfo:
        sandbox_id = sandbox.sandbox_id
        if sandbox.renewable and sandbox.layer is not None:
            from sandman_ray.providers.local.renew import NamespaceThread
            self.renewing = self.renewing or NamespaceThread()
            try:
                await sandbox.renew(self.renewing, self.ready_timeout_s)
                return self._info(sandbox_id)
            except Exception as exc:  # noqa: BLE001 - any failure: started afresh below
                logger.warning("pool %s: sandbox %s could not be renewed (%s: %s): starting "
                               "it afresh", self.pool, sandbox_id, type(exc).__name__, exc)
        try:
            await asyncio.get_running_loop().run_in_executor(self.launchers, sandbox.kill)
            if self.closed:  # shut down meanwhile: no new chain may start
                raise SandboxLost("the agent of pool %s on node %s is shutting down"
                                  % (self.pool, self.node_id))
            await self._launch(sandbox)
            await sandbox.wait_ready(self.ready_timeout_s)
            await check_answers(self._info(sandbox_id))
        except Exception as exc:  # whatever failed: nothing of it may stay
            await self._delete(sandbox_id)
            raise transient("sandbox %s did not come back from reset: %s: %s"
                            % (sandbox_id, type(exc).__name__, exc)) from exc
        if self.closed:  # shut down while it started again: the shutdown's delete of it
            await self._delete(sandbox_id)  # may have run before it was back
            raise fatal("the agent of pool %s on node %s was shut down during the reset "
                        "of %s" % (self.pool, self.node_id, sandbox_id))
        if sandbox.renewable and sandbox.layer is None:
            asyncio.get_running_loop().run_in_executor(None, self._prepare, sandbox)
        return self._info(sandbox_id)

    # ---- pauses (snapshots: providers/local/agent_snapshots.py)
    def _sandbox(self, sandbox_id: str, op: str):
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise fatal("%s: sandbox %s does not exist on node %s"
                        % (op, sandbox_id, self.node_id))
        return sandbox

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        """The lock that keeps a sandbox's snapshot, pause, resume and reset apart."""
        return self.locks.setdefault(sandbox_id, asyncio.Lock())

    async def pause(self, sandbox_id: str, reclaim: bool = False,
                    token: Optional[str] = None) -> bool:
        """Freeze every process of the sandbox (the cgroup freezer): no CPU, memory kept;
        with ``reclaim``, then push its memory out (Cgroups.reclaim). With ``token``,
        only while the sandbox takes it (checked again under the sandbox's lock, so
        that a reset begun meanwhile wins): False when it does not."""
        sandbox = self._sandbox(sandbox_id, "pause")
        if sandbox.cgroups is None or not sandbox.cgroups.can_freeze:
            raise NotSupported("pause of sandbox %s needs a freezer cgroup, which this "
                               "agent has not (an agent that is not root, or a host "
                               "without the freezer)" % sandbox_id)
        async with self._lock(sandbox_id):
            if token is not None and not self._takes(sandbox_id, token):
                return False
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, sandbox.cgroups.freeze)
            except OSError as exc:
                sandbox.cgroups.thaw()
                raise transient("pause of sandbox %s: %s" % (sandbox_id, exc)) from exc
            if reclaim:
                try:
                    await loop.run_in_executor(None, sandbox.cgroups.reclaim)
                except OSError as exc:  # it stays paused, with its memory
                    logger.warning("pool %s: reclaim of paused sandbox %s: %s", self.pool,
                                   sandbox_id, exc)
        return True

    async def resume(self, sandbox_id: str, token: Optional[str] = None) -> bool:
        sandbox = self._sandbox(sandbox_id, "resume")
        async with self._lock(sandbox_id):
            if token is not None and not self._takes(sandbox_id, token):
                return False
            if sandbox.cgroups is not None:
                sandbox.cgroups.thaw()
        return True

    async def pause_held(self, sandbox_id: str, token: str, reclaim: bool = False) -> bool:
        """``pause`` for the holder of the sandbox's lease, who shows its token (a
        lease that ended has one the sandbox no longer takes): False for any other
        token, or a sandbox not here (LocalProvider.controller)."""
        if not self._takes(sandbox_id, token):
            return False
        return await self.pause(sandbox_id, reclaim, token)

    async def resume_held(self, sandbox_id: str, token: str) -> bool:
        if not self._takes(sandbox_id, token):
            return False
        return await self.resume(sandbox_id, token)

    async def renew_held(self, sandbox_id: str, token: str) -> Union[bool, Dict[str, str]]:
        """``reset`` for the holder of the sandbox's lease, who shows its token and keeps
        the lease: the sandbox's new token and address, or False for any other token."""
        info = await self.reset(sandbox_id, token)
        return False if info is None else {"token": info.token, "address": info.address}

    async def control_address(self) -> Optional[str]:
        """The unix socket where holders on this node pause, resume and renew their
        sandboxes (sandman_ray.control: ``pause_held``, ``resume_held`` and
        ``renew_held`` without a Ray call),
        served from the first ask on; None where its path would be too long."""
        from sandman_ray import control
        path = str(self.state / "control.sock")
        async with self.control_lock:
            if self.control is None and not self.closed:
                self.control = await control.serve(path, self._controlled) or False
        return path if self.control and not self.closed else None

    async def _controlled(self, op: str, sandbox_id: str, token: str, reclaim: bool):
        if op == "pause":
            return await self.pause_held(sandbox_id, token, reclaim)
        if op == "renew":
            return await self.renew_held(sandbox_id, token)
        return await self.resume_held(sandbox_id, token)

    def _takes(self, sandbox_id: str, token: str) -> bool:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or not isinstance(token, str) or sandbox_id in self.resetting:
            return False
        return hmac.compare_digest(sandbox.token.encode(),
                                   token.encode("utf-8", "surrogatepass"))

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        wanted = (labels or {}).items()
        return [self._info(sid) for sid in self.labels
                if all(self._labels(sid).get(k) == v for k, v in wanted)]

    async def shutdown(self) -> int:
        """Delete every sandbox of this agent, also those still being created (they
        are removed as they finish); returns how many there were. No create starts
        afterwards."""
        self.closed = True
        if self.control:
            self.control.close()
        await asyncio.gather(*self.creating.running.values(), *self.captures,
                             *self.resets.values(), return_exceptions=True)
        ids = list(self.sandboxes)
        await asyncio.gather(*(self.delete(sid) for sid in ids))
        from sandman_ray.providers.janitor import clean
        await asyncio.get_running_loop().run_in_executor(
            None, clean, str(self.state), self.cgroup_dirs, 0.0)
        # the pool's snapshots on this node go with it
        await asyncio.get_running_loop().run_in_executor(None, self.snapshot_store.delete_all)
        if self.ranges is not None:
            # the ranges' locks go with this agent: no process of theirs may outlive it
            left = await asyncio.get_running_loop().run_in_executor(
                None, self.ranges.kill_leftovers)
            if left:
                logger.error("pool %s: processes %s of this agent's uid ranges outlived "
                             "every kill", self.pool, left)
            self.ranges.close(emptied=not left)
        return len(ids)


def agent_group(pool: str, node_id: str, incarnation: str) -> str:
    """The cgroup (under ``sandman/``) of one agent incarnation's sandboxes: a janitor
    cleans its own incarnation's, never those of the agent that replaced it."""
    return "%s-%s-%s" % (pool, node_id[:16], incarnation)


def agent_groups(pool: str, node_id: Optional[str] = None) -> List[str]:
    """The agents' cgroups of ``pool`` on this host (of one node's agents when given),
    in every hierarchy."""
    from sandman_ray.providers.local.cgroups import Cgroups
    node = re.escape(node_id[:16]) if node_id else r"[0-9a-f]{16}"
    name = re.compile(re.escape(pool) + "-" + node + r"-[0-9a-f]{8}$")
    found = []
    for base in Cgroups.locations("sandman"):
        try:
            found += [e.path for e in os.scandir(base) if e.is_dir() and name.match(e.name)]
        except OSError:
            continue
    return found
