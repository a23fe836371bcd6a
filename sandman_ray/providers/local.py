"""LocalProvider: bubblewrap sandboxes on every node of a Ray cluster.

One ``NodeAgent`` actor per pool and node (detached, named
``sandman:agent:<pool>:<node id>`` in the ``sandman`` namespace, ``num_cpus=0``, pinned
to its node) starts and supervises that node's sandboxes (``providers/bwrap.py``).
Sandboxes die with their agent: when Ray stops on a node, nothing is left running, and
the next agent of that pool and node removes whatever state the last one left.
"""

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sandman_ray.errors import ProviderError, SandboxLost, SandmanError
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, Provider, SandboxInfo, fatal, transient)
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

NAMESPACE = "sandman"
DEFAULT_STATE_ROOT = "/tmp/sandman-ray/state"
DEFAULT_CACHE_ROOT = "/tmp/sandman-ray/cache"
NODES_TTL_S = 2.0


def agent_name(pool: str, node_id: str) -> str:
    return "sandman:agent:%s:%s" % (pool, node_id)


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    """Starts, resets and deletes the sandboxes of one pool on one node."""

    def __init__(self, pool: str, node_id: str, state_root: str, cache_root: str,
                 prefer_tools: bool = True):
        from sandman_ray.bundle import ensure_bundle
        from sandman_ray.images import ImageCache
        self.pool, self.node_id = pool, node_id
        self.state = Path(state_root) / pool / node_id[:16]
        self.trash = self.state.parent / (self.state.name + ".trash")
        self.cgroup_parent = "sandman/%s-%s" % (pool, node_id[:16])
        self._remove_leftovers()
        self.state.mkdir(parents=True, exist_ok=True)
        self.janitor = self._start_janitor()
        self.bundle = ensure_bundle(Path(cache_root) / "bundle")
        self.images = ImageCache(Path(cache_root) / "images", prefer_tools=prefer_tools)
        self.sandboxes: Dict[str, object] = {}   # sandbox id -> SandboxProcess
        self.labels: Dict[str, Dict[str, str]] = {}
        self.pending: Dict[str, asyncio.Future] = {}  # creates in flight (idempotence)

    def _remove_leftovers(self) -> None:
        """What a dead agent of this pool and node left: its sandboxes died with it,
        their state directories and cgroups did not."""
        from sandman_ray.providers.bwrap import Cgroups
        for path in (self.state, self.trash):
            shutil.rmtree(path, ignore_errors=True)
        for base in (Cgroups.V1 / c / self.cgroup_parent for c in ("memory", "pids", "cpu")):
            if base.is_dir():
                for leaf in base.iterdir():
                    if leaf.is_dir():
                        try:
                            leaf.rmdir()
                        except OSError:
                            pass

    def _start_janitor(self):
        """A process that cleans this agent's state once the agent is gone."""
        import subprocess
        import sys
        from sandman_ray.providers.bwrap import Cgroups
        self.cgroup_dirs = [str(Cgroups.V1 / c / self.cgroup_parent)
                            for c in ("memory", "pids", "cpu")]
        return subprocess.Popen(
            [sys.executable, "-m", "sandman_ray.providers.janitor", str(self.state)]
            + self.cgroup_dirs,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            close_fds=True)

    def ready(self) -> str:
        return self.node_id

    async def create(self, sandbox_id: str, spec: SandboxSpec, labels: Dict[str, str],
                     ready_timeout_s: float = 30.0) -> SandboxInfo:
        if sandbox_id in self.sandboxes:
            return self._info(sandbox_id)
        if sandbox_id in self.pending:  # a retry while the first create runs
            return await asyncio.shield(self.pending[sandbox_id])
        fut = asyncio.get_running_loop().create_future()
        self.pending[sandbox_id] = fut
        try:
            info = await self._create(sandbox_id, spec, labels, ready_timeout_s)
        except BaseException as exc:
            fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            self.pending.pop(sandbox_id, None)
        fut.set_result(info)
        return info

    async def _create(self, sandbox_id, spec, labels, ready_timeout_s) -> SandboxInfo:
        from sandman_ray.providers.bwrap import SandboxProcess
        loop = asyncio.get_running_loop()
        try:
            image = await loop.run_in_executor(None, self.images.prepare, spec.image)
        except ProviderError:
            raise
        except (OSError, ValueError) as exc:
            raise fatal("image %r: %s" % (spec.image, exc)) from exc
        sandbox = SandboxProcess(sandbox_id, image, self.bundle, self.state / sandbox_id, spec,
                                 cgroup_group="%s/%s" % (self.cgroup_parent, sandbox_id))
        try:
            sandbox.launch()  # on the loop's thread, which lives as long as this actor
            await sandbox.wait_ready(ready_timeout_s)
        except SandboxLost as exc:
            await loop.run_in_executor(None, sandbox.remove, self.trash)
            raise transient(str(exc)) from exc
        except OSError as exc:
            await loop.run_in_executor(None, sandbox.remove, self.trash)
            raise fatal("sandbox %s cannot start: %s" % (sandbox_id, exc)) from exc
        except ProviderError:
            await loop.run_in_executor(None, sandbox.remove, self.trash)
            raise
        self.sandboxes[sandbox_id] = sandbox
        self.labels[sandbox_id] = dict(labels)
        return self._info(sandbox_id)

    def _info(self, sandbox_id: str) -> SandboxInfo:
        sandbox = self.sandboxes[sandbox_id]
        return SandboxInfo(
            sandbox_id=sandbox_id, address=sandbox.address, token=sandbox.token,
            node_id=self.node_id, labels=self.labels[sandbox_id], created_at=sandbox.started_at,
            details={"image": sandbox.image.image, "spec": sandbox.spec,
                     "digest": sandbox.image.digest,
                     "unpacked_by": sandbox.image.unpacked_by, "limits": dict(sandbox.applied),
                     "alive": sandbox.alive, "pid": sandbox.proc.pid if sandbox.proc else None})

    async def delete(self, sandbox_id: str) -> None:
        sandbox = self.sandboxes.pop(sandbox_id, None)
        self.labels.pop(sandbox_id, None)
        if sandbox is not None:
            await asyncio.get_running_loop().run_in_executor(None, sandbox.remove, self.trash)
            self._empty_trash()

    async def reset(self, sandbox_id: str, ready_timeout_s: float = 30.0) -> SandboxInfo:
        """Kill the sandbox's processes, drop its writable layer, start its daemon again
        on the same image; answer when the daemon listens."""
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise fatal("sandbox %s does not exist on node %s" % (sandbox_id, self.node_id))
        sandbox.kill()
        sandbox.discard_layer(self.trash)
        try:
            sandbox.launch()
            await sandbox.wait_ready(ready_timeout_s)
        except (SandboxLost, OSError) as exc:
            await self.delete(sandbox_id)
            raise transient("sandbox %s did not come back from reset: %s" % (sandbox_id, exc))
        self._empty_trash()
        return self._info(sandbox_id)

    def _empty_trash(self) -> None:
        from sandman_ray.providers.bwrap import empty_trash
        if self.trash.exists() and any(self.trash.iterdir()):
            empty_trash(self.trash)

    async def probe(self, sandbox_id: str) -> None:
        """Ping and ``exec true`` through the sandbox's socket, from this node."""
        from sandman_ray.providers.base import Provider
        await Provider.probe(self, self._info(sandbox_id))

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        wanted = (labels or {}).items()
        return [self._info(sid) for sid, own in self.labels.items()
                if all(own.get(k) == v for k, v in wanted)]

    async def shutdown(self) -> int:
        """Delete every sandbox of this agent; returns how many there were."""
        ids = list(self.sandboxes)
        await asyncio.gather(*(self.delete(sid) for sid in ids))
        from sandman_ray.providers.janitor import clean
        await asyncio.get_running_loop().run_in_executor(
            None, clean, str(self.state), self.cgroup_dirs, 0.0)
        return len(ids)


class LocalProvider(Provider):
    """Sandboxes on the Ray nodes of this cluster, through one NodeAgent per node.

    state_root: where sandboxes keep their sockets and writable layers on each node.
    cache_root: where each node keeps its daemon bundle and unpacked images.
    prefer_tools: unpack with umoci/skopeo when installed (else the built-in applier).
    ready_timeout_s: how long a new sandbox's daemon may take to listen.
    """

    supports_reset = True

    def __init__(self, state_root: str = DEFAULT_STATE_ROOT,
                 cache_root: str = DEFAULT_CACHE_ROOT, prefer_tools: bool = True,
                 ready_timeout_s: float = 30.0):
        self.state_root, self.cache_root = state_root, cache_root
        self.prefer_tools, self.ready_timeout_s = prefer_tools, ready_timeout_s
        self.pool = "default"
        self._agents: Dict[str, object] = {}
        self._where: Dict[str, str] = {}   # sandbox id -> node id
        self._next = 0
        self._nodes = None  # (when, alive node ids)

    def bind(self, pool: str) -> "LocalProvider":
        """Name the pool whose agents this provider drives."""
        self.pool = pool
        return self

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_agents"], state["_where"], state["_nodes"] = {}, {}, None
        return state

    # ---- agents
    def _alive_nodes(self) -> List[str]:
        """Alive Ray nodes, asked of the GCS at most every NODES_TTL_S (a burst of
        creates would otherwise ask once per sandbox)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes[0] > NODES_TTL_S:
            self._nodes = (now, sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive")))
        return self._nodes[1]

    def agent(self, node_id: str):
        """The agent of this pool on ``node_id``, started if needed."""
        agent = self._agents.get(node_id)
        if agent is None:
            agent = NodeAgent.options(
                name=agent_name(self.pool, node_id), namespace=NAMESPACE, lifetime="detached",
                get_if_exists=True, max_concurrency=10000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.pool, node_id, self.state_root, self.cache_root, self.prefer_tools)
            self._agents[node_id] = agent
        return agent

    async def _pick_node(self) -> str:
        nodes = await asyncio.get_running_loop().run_in_executor(None, self._alive_nodes)
        if not nodes:
            raise transient("no alive Ray node")
        counts = {n: 0 for n in nodes}
        for node in self._where.values():
            if node in counts:
                counts[node] += 1
        self._next += 1
        # fewest sandboxes first; ties broken in turn so a burst spreads evenly
        return min(nodes, key=lambda n: (counts[n], (nodes.index(n) - self._next) % len(nodes)))

    # ---- the Provider interface
    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels_given: Dict[str, str]) -> SandboxInfo:
        node = self._where.get(sandbox_id) or await self._pick_node()
        self._where[sandbox_id] = node
        labels = dict(spec.labels)
        labels.update(labels_given)
        labels.update({POOL_LABEL: self.pool, SANDBOX_LABEL: sandbox_id})
        try:
            return await self.agent(node).create.remote(sandbox_id, spec, labels,
                                                        self.ready_timeout_s)
        except ray.exceptions.RayActorError as exc:
            self._agents.pop(node, None)
            self._where.pop(sandbox_id, None)
            raise transient("node agent on %s is gone: %s" % (node, exc)) from exc
        except ProviderError:
            self._where.pop(sandbox_id, None)
            raise

    async def delete(self, sandbox_id: str) -> None:
        node = self._where.pop(sandbox_id, None)
        nodes = [node] if node else await asyncio.get_running_loop().run_in_executor(
            None, self._alive_nodes)
        for node_id in nodes:
            try:
                await self.agent(node_id).delete.remote(sandbox_id)
            except ray.exceptions.RayActorError:
                self._agents.pop(node_id, None)  # its sandboxes died with it

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        nodes = await asyncio.get_running_loop().run_in_executor(None, self._alive_nodes)
        found: List[SandboxInfo] = []
        for node_id in nodes:
            try:
                infos = await self.agent(node_id).list.remote(labels)
            except ray.exceptions.RayActorError:
                self._agents.pop(node_id, None)
                continue
            for info in infos:
                self._where[info.sandbox_id] = node_id
            found.extend(infos)
        return found

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        node = self._where.get(sandbox_id)
        if node is None:
            node = (await self.endpoint(sandbox_id)).node_id
        try:
            return await self.agent(node).reset.remote(sandbox_id, self.ready_timeout_s)
        except ray.exceptions.RayActorError as exc:
            self._agents.pop(node, None)
            raise transient("node agent on %s is gone: %s" % (node, exc)) from exc

    async def probe(self, info: SandboxInfo) -> None:
        """On the sandbox's node: its unix socket is not reachable from elsewhere."""
        try:
            await self.agent(info.node_id).probe.remote(info.sandbox_id)
        except ray.exceptions.RayActorError as exc:
            self._agents.pop(info.node_id, None)
            raise transient("node agent on %s is gone: %s" % (info.node_id, exc)) from exc
        except (ConnectionError, OSError, SandmanError) as exc:
            raise transient("sandbox %s does not answer: %s" % (info.sandbox_id, exc)) from exc

    async def shutdown(self) -> int:
        """Delete every sandbox of this pool and stop its agents."""
        nodes = await asyncio.get_running_loop().run_in_executor(None, self._alive_nodes)
        total = 0
        for node_id in nodes:
            try:
                agent = ray.get_actor(agent_name(self.pool, node_id), namespace=NAMESPACE)
            except ValueError:
                continue
            try:
                total += await agent.shutdown.remote()
            except ray.exceptions.RayActorError:
                pass
            ray.kill(agent)
        self._agents.clear()
        self._where.clear()
        return total
