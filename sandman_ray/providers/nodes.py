"""Providers that run sandboxes through one agent actor per Ray node.

The LocalProvider (bwrap) and the DockerProvider (a container engine on each node) both
start sandboxes whose daemon listens on a unix socket on that node, so both drive one
agent per pool and node: detached, named ``sandman:<kind>:<pool>:<node id>`` in the
``sandman`` namespace, ``num_cpus=0``, pinned to its node. This module is the pool-side
half they share (which node gets the next sandbox, where each one is, what to do when an
agent is gone) and the agent-side single-flight helper.
"""

import asyncio
import logging
import time
from typing import Awaitable, Callable, Dict, List, Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sandman_ray.errors import ProviderError
from sandman_ray.names import NAMESPACE, pool_task_name
from sandman_ray.providers.base import (
    POOL_LABEL, SANDBOX_LABEL, Provider, SandboxInfo, SnapshotInfo, bind_daemon, fatal,
    reachable, transient)
from sandman_ray.spec import SandboxSpec

logger = logging.getLogger(__name__)

NODES_TTL_S = 2.0


def agent_name(pool: str, node_id: str, kind: str = "agent") -> str:
    return "sandman:%s:%s:%s" % (kind, pool, node_id)


class SingleFlight:
    """At most one run of a coroutine per key at a time; callers that arrive while it
    runs await the same outcome (a create retried after a timeout, thirty creates that
    need the same image pulled)."""

    def __init__(self):
        self.running: Dict[object, asyncio.Future] = {}  # key -> the task running it

    async def run(self, key, start: Callable[[], Awaitable]):
        """The outcome of ``start()``, run as a task of its own: a caller that is
        cancelled stops waiting, and the run goes on for the others."""
        task = self.running.get(key)
        if task is None:
            task = asyncio.ensure_future(start())
            self.running[key] = task
            task.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(task)

    def _finished(self, key, task) -> None:
        if self.running.get(key) is task:
            del self.running[key]
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning when nobody waits


class _Creating:
    """A create in flight, as its deletes see it."""

    def __init__(self):
        self.calls = 0  # creates of this id in flight (a retry joins the first)
        self.deleted = False  # a delete came while it ran
        self.removed = False  # ... and the create removed what it made
        self.ended = asyncio.Event()


def unwrapped(exc: ProviderError) -> ProviderError:
    """The agent's ProviderError itself rather than Ray's wrapper around it (whose
    message carries the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, ProviderError) else exc


class NodeAgentProvider(Provider):
    """Spreads sandboxes over the alive Ray nodes and forwards each call to the agent of
    the sandbox's node. Subclasses say which actor class is the agent and what it is
    constructed with."""

    #: the middle of the agents' names (``sandman:<kind>:<pool>:<node>``)
    agent_kind = "agent"

    def __init__(self):
        self.pool = "default"
        self._agents: Dict[str, object] = {}
        self._where: Dict[str, str] = {}   # sandbox id -> node id
        self._next = 0
        self._nodes = None  # (when, alive node ids)
        self._closed = False  # shut down: no agent is started any more
        self._creating: Dict[str, _Creating] = {}  # sandbox id -> its create in flight
        self._snapshot_nodes: Dict[str, str] = {}  # a snapshot's image -> its node

    def agent_class(self):
        raise NotImplementedError

    def agent_args(self, node_id: str) -> tuple:
        """Constructor arguments of the agent on ``node_id``."""
        raise NotImplementedError

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_agents"], state["_where"], state["_nodes"] = {}, {}, None
        state["_creating"], state["_snapshot_nodes"] = {}, {}
        return state

    # ---- agents
    def _alive_nodes(self) -> List[str]:
        """Alive Ray nodes, asked of the GCS at most every NODES_TTL_S (a burst of
        creates would otherwise ask once per sandbox)."""
        now = time.monotonic()
        if self._nodes is None or now - self._nodes[0] > NODES_TTL_S:
            self._nodes = (now, sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive")))
        return self._nodes[1]

    async def alive_nodes(self) -> List[str]:
        return await asyncio.get_running_loop().run_in_executor(None, self._alive_nodes)

    def agent(self, node_id: str):
        """The agent of this pool on ``node_id``, started if needed."""
        agent = self._agents.get(node_id)
        if agent is None:
            if self._closed:
                raise fatal("pool %s is shut down" % self.pool)
            agent = self.agent_class().options(
                name=agent_name(self.pool, node_id, self.agent_kind), namespace=NAMESPACE,
                lifetime="detached", get_if_exists=True, max_concurrency=10000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(*self.agent_args(node_id))
            self._agents[node_id] = agent
        return agent

    def existing_agent(self, node_id: str):
        """The agent of this pool on ``node_id`` if one runs, else None: listing and
        deleting never start an agent (a node without one has none of our sandboxes)."""
        agent = self._agents.get(node_id)
        if agent is None:
            try:
                agent = ray.get_actor(agent_name(self.pool, node_id, self.agent_kind),
                                      namespace=NAMESPACE)
            except ValueError:
                return None
            self._agents[node_id] = agent
        return agent

    def _agent_gone(self, node_id: str, exc: Exception) -> ProviderError:
        self._agents.pop(node_id, None)
        self._nodes = None  # perhaps its node died: ask the GCS again before the next pick
        return transient("%s on %s is gone: %s" % (self.agent_kind, node_id, exc))

    async def _pick_node(self) -> str:
        nodes = await self.alive_nodes()
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
    async def nodes(self) -> List[str]:
        return await self.alive_nodes()

    def place(self, sandbox_id: str, node_id: str) -> None:
        self._where.setdefault(sandbox_id, node_id)

    async def warm_up(self) -> None:
        """An agent on every alive node, started now and awaited (the first create on
        a node would otherwise wait ~1 s for its actor process); a node that joins
        later gets its agent at its first create."""
        try:
            refs = [self.agent(node).__ray_ready__.remote()
                    for node in await self.alive_nodes()]
        except ProviderError:  # shut down meanwhile: nothing to start
            return
        for ref in refs:
            try:
                await ref
            except ray.exceptions.RayError as exc:  # its creates will say why
                logger.warning("pool %s: an agent did not start: %s", self.pool, exc)

    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels_given: Dict[str, str]) -> SandboxInfo:
        node = await self._node_for(sandbox_id, spec.image)
        self._where[sandbox_id] = node
        labels = dict(spec.labels)
        labels.update(labels_given)
        labels.update({POOL_LABEL: self.pool, SANDBOX_LABEL: sandbox_id})
        creating = self._creating.setdefault(sandbox_id, _Creating())  # a retry joins it
        creating.calls += 1
        try:
            try:
                info = await self.agent(node).create.options(
                    name=pool_task_name("create", self.pool)).remote(sandbox_id, spec, labels)
            except ray.exceptions.RayActorError as exc:
                self._where.pop(sandbox_id, None)
                raise self._agent_gone(node, exc) from exc
            except ProviderError as exc:
                self._where.pop(sandbox_id, None)
                raise unwrapped(exc) from None
            if creating.deleted:
                # An async actor may run the delete before the create it followed: the
                # delete wins either way, and nothing of the create is left.
                await self._delete(sandbox_id)
                creating.removed = True
                raise fatal("sandbox %s was deleted while it was being created" % sandbox_id)
            return info
        finally:
            creating.calls -= 1
            if not creating.calls:
                self._creating.pop(sandbox_id, None)
                creating.ended.set()

    async def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox; a create of it in flight is waited for first, so that
        nothing of it appears after this returns."""
        creating = self._creating.get(sandbox_id)
        if creating is not None:
            creating.deleted = True
            await creating.ended.wait()
            if creating.removed:
                return
        await self._delete(sandbox_id)

    async def _delete(self, sandbox_id: str) -> None:
        node = self._where.pop(sandbox_id, None)
        for node_id in [node] if node else await self.alive_nodes():
            agent = self.existing_agent(node_id)
            if agent is None:
                continue
            try:
                await agent.delete.options(
                    name=pool_task_name("delete", self.pool)).remote(sandbox_id)
            except ray.exceptions.RayActorError:
                self._agents.pop(node_id, None)  # its sandboxes went with it
            except ProviderError as exc:
                raise unwrapped(exc) from None

    async def list(self, labels: Optional[Dict[str, str]] = None) -> List[SandboxInfo]:
        """Every node's sandboxes; a node whose agent cannot answer (its engine is
        down) is left out with a warning rather than hiding all the others."""
        found: List[SandboxInfo] = []
        async for node_id, infos in self._from_each_agent("list", labels):
            for info in infos:
                self._where[info.sandbox_id] = node_id
            found.extend(infos)
        return found

    async def _from_each_agent(self, method: str, *args):
        """(node id, answer) of ``method`` from the agent of each alive node that has
        one; an agent that is gone is forgotten, one that cannot answer (its engine is
        down) is left out with a warning rather than hiding all the others."""
        for node_id in await self.alive_nodes():
            agent = self.existing_agent(node_id)
            if agent is None:
                continue
            try:
                answer = await getattr(agent, method).remote(*args)
            except ray.exceptions.RayActorError:
                self._agents.pop(node_id, None)
                continue
            except ProviderError as exc:
                logger.warning("pool %s: %s: node %s did not answer: %s", self.pool, method,
                               node_id, unwrapped(exc))
                continue
            yield node_id, answer

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await self._on_agent(await self._node_of(sandbox_id), "reset", sandbox_id,
                                    task=pool_task_name("reset", self.pool))

    async def bind_task(self, info: SandboxInfo, env: Dict[str, str], workdir: Optional[str],
                        labels: Dict[str, str]) -> None:
        """The daemon takes the settings from this process where it reaches it (the
        pool's node): its agent may be busy starting the sandboxes of a burst, and is
        told after, for its listing (a word that comes after the sandbox's next reset
        is not taken: the token it names is gone); elsewhere the agent binds them."""
        node = info.node_id or await self._node_of(info.sandbox_id)
        if not reachable(info, ray.get_runtime_context().get_node_id()):
            return await self._on_agent(node, "bind_task", info.sandbox_id, env, workdir,
                                        labels, task=pool_task_name("bind", self.pool))
        if env or workdir:
            await bind_daemon(info, env, workdir)
        try:
            self.agent(node).note_task.options(name=pool_task_name("bind", self.pool)).remote(
                info.sandbox_id, info.token, env, workdir, labels)
        except ray.exceptions.RayError as exc:  # its listing lacks them; its lease holds
            logger.warning("pool %s: agent of node %s not told of the lease's settings of %s: "
                           "%s", self.pool, node, info.sandbox_id, exc)

    # ---- snapshots and pauses: each on the agent of the sandbox's (or snapshot's) node
    async def _node_of(self, sandbox_id: str) -> str:
        node = self._where.get(sandbox_id)
        return node if node is not None else (await self.endpoint(sandbox_id)).node_id

    async def weigh(self, weights: Dict[str, tuple]) -> None:
        """Each node's share of ``weights`` to its agent (a sandbox whose node is not
        known here any more is gone, or soon)."""
        per_node: Dict[str, Dict[str, tuple]] = {}
        for sandbox_id, weight in weights.items():
            node = self._where.get(sandbox_id)
            if node is not None:
                per_node.setdefault(node, {})[sandbox_id] = weight
        await asyncio.gather(*(self._on_agent(node, "weigh", part)
                               for node, part in per_node.items()))

    async def _on_agent(self, node: str, method: str, *args, task: Optional[str] = None):
        """``method`` of the agent on ``node`` (started if needed; ``task``: the call's
        name on the Ray dashboard), its errors said as the provider's."""
        call = getattr(self.agent(node), method)
        try:
            return await (call.options(name=task) if task else call).remote(*args)
        except ray.exceptions.RayActorError as exc:
            raise self._agent_gone(node, exc) from exc
        except ProviderError as exc:
            raise unwrapped(exc) from None

    async def snapshot(self, sandbox_id: str, name: str) -> SnapshotInfo:
        node = await self._node_of(sandbox_id)
        info = await self._on_agent(node, "snapshot", sandbox_id, name)
        self._snapshot_nodes[info.image] = node
        return info

    async def snapshots(self) -> List[SnapshotInfo]:
        found: List[SnapshotInfo] = []
        async for node_id, infos in self._from_each_agent("snapshots"):
            for info in infos:
                self._snapshot_nodes[info.image] = node_id
            found.extend(infos)
        return found

    async def delete_snapshot(self, name: str) -> None:
        for info in await self.snapshots():
            if info.name == name:
                await self._on_agent(info.node_id, "delete_snapshot", name)
                self._snapshot_nodes.pop(info.image, None)

    async def _snapshot_node(self, image: str) -> Optional[str]:
        """A node holding the snapshot ``image`` (None: not a snapshot): the one it was
        taken on, or one it was brought to."""
        if not self.is_snapshot_image(image):
            return None
        node = self._snapshot_nodes.get(image)
        if node is None:
            await self.snapshots()
            node = self._snapshot_nodes.get(image)
        if node is None:
            raise fatal("image %r: pool %s has no such snapshot" % (image, self.pool))
        return node

    def is_snapshot_image(self, image: str) -> bool:
        """Whether ``image`` names a snapshot this kind of provider takes."""
        return False

    #: whether an agent brings a snapshot from another node's agent (``fetch_snapshot``)
    #: when a sandbox of it is placed there; else such sandboxes start on its node
    carries_snapshots = False

    async def _node_for(self, sandbox_id: str, image: str) -> str:
        """The node a create goes to: where the pool placed it, else the next in turn;
        for a snapshot's image, its node, or the placed node once the snapshot is
        brought there."""
        placed = self._where.get(sandbox_id)
        holder = await self._snapshot_node(image)
        if holder is None:
            return placed or await self._pick_node()
        if placed is None or placed == holder or not self.carries_snapshots:
            return holder
        await self._on_agent(placed, "fetch_snapshot", image, self.agent(holder))
        return placed

    async def pause(self, sandbox_id: str, reclaim: bool = False) -> None:
        await self._on_agent(await self._node_of(sandbox_id), "pause", sandbox_id, reclaim)

    async def resume(self, sandbox_id: str) -> None:
        await self._on_agent(await self._node_of(sandbox_id), "resume", sandbox_id)

    async def shutdown(self) -> int:
        """Delete every sandbox of this pool and stop its agents; no agent starts
        afterwards."""
        self._closed = True
        total, failed = 0, None
        for node_id in set(await self.alive_nodes()) | set(self._agents):
            agent = self._agents.get(node_id)  # this process started it (perhaps just now)
            if agent is None:
                try:
                    agent = ray.get_actor(agent_name(self.pool, node_id, self.agent_kind),
                                          namespace=NAMESPACE)
                except ValueError:
                    continue
            try:
                total += await agent.shutdown.remote()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
                pass  # gone, or pinned to a node that is gone: nothing of it is left
            except ProviderError as exc:  # stop the agent anyway; its janitor tries again
                failed = failed or unwrapped(exc)
            ray.kill(agent)
        self._agents.clear()
        self._where.clear()
        if failed is not None:
            raise failed
        return total
