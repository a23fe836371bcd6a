"""LocalProvider: bubblewrap sandboxes on every node of a Ray cluster.

One ``NodeAgent`` actor per pool and node (detached, named
``sandman:agent:<pool>:<node id>`` in the ``sandman`` namespace, ``num_cpus=0``, pinned
to its node) starts and supervises that node's sandboxes (``providers/local/bwrap.py``).
Sandboxes die with their agent: when Ray stops on a node, nothing is left running, and
the next agent of that pool and node removes whatever state the last one left.
"""

import os
from pathlib import Path
from typing import Dict, Optional, Sequence, Union

from sandman_ray.images import check_image_root
from sandman_ray.providers.local.agent import NodeAgent, agent_groups
from sandman_ray.providers.local.host_tables import PoolNeeds
from sandman_ray.providers.nodes import NAMESPACE, NodeAgentProvider, agent_name
from sandman_ray.names import pool_task_name
from sandman_ray.spec import parse_bytes

__all__ = ["LocalProvider", "NodeAgent", "NAMESPACE", "agent_name", "leftovers"]

DEFAULT_STATE_ROOT = "/tmp/sandman-ray/state"
DEFAULT_CACHE_ROOT = "/tmp/sandman-ray/cache"
# Snapshots in memory by default (a tmpfs): a layer of a thousand small files is copied
# in ~45 ms there, and in 1.4 s on this machine's disk (~1 ms per file created)
DEFAULT_SNAPSHOT_ROOT = "/dev/shm/sandman-ray/snapshots"
# Where LocalProvider() finds its image_roots when it is not given them
IMAGE_ROOTS_ENV = "SANDMAN_IMAGE_ROOTS"


def leftovers(pool: str, state_root: str = DEFAULT_STATE_ROOT,
              snapshot_root: str = DEFAULT_SNAPSHOT_ROOT) -> Dict[str, list]:
    """What of ``pool``'s sandboxes is left on this host, found without asking any actor:
    live sandbox processes (bwrap, the daemon, commands; not the janitors, which exit
    on their own), found by command line and in the sandboxes' cgroups; sandbox state
    directories and the pool's snapshots; and cgroups. Empty lists once a pool is shut
    down."""
    from sandman_ray.providers.janitor import listed_pids, sandbox_groups, sandbox_processes
    pool_dir = Path(state_root) / pool
    processes = set(sandbox_processes(str(pool_dir) + "/",
                                      unless=b"sandman_ray.providers.janitor"))
    groups = agent_groups(pool)
    for group in groups:
        for leaf in sandbox_groups(group):
            processes.update(listed_pids(os.path.join(leaf, "cgroup.procs")))
    # state_root/pool/<node>/<agent incarnation>/<sandbox id>, and the pool's snapshots
    directories = [str(d) for d in pool_dir.glob("*/*/*") if d.is_dir()]
    directories += [str(d) for d in Path(snapshot_root).glob("*/%s/*" % pool)]  # per node
    return {"processes": sorted(processes), "directories": directories, "cgroups": groups}


class LocalProvider(NodeAgentProvider):
    """Sandboxes on the Ray nodes of this cluster, through one NodeAgent per node.

    state_root: where sandboxes keep their sockets and writable layers on each node.
    cache_root: where each node keeps its daemon bundle and unpacked images.
    prefer_tools: unpack with umoci/skopeo when installed (else the built-in applier).
    ready_timeout_s: how long a new sandbox's daemon may take to listen.
    user_namespaces: give each sandbox its own user namespace, root inside mapped to an
        unprivileged range of host ids (the default; needs the agent to run as root).
        False, or an agent that cannot, runs sandboxes as host root with a reduced
        capability set.
    isolation: ``namespaces`` (bubblewrap, the default) or ``gvisor``: the same daemon
        under gVisor's user-space kernel (``runsc``; providers/local/gvisor.py), a stronger
        wall at a higher cost per system call.
    snapshot_root: where each node keeps the pools' snapshots (providers/local/
        snapshots.py): by default a tmpfs (memory, as the sandboxes' own writable
        layers are); a directory on disk keeps large ones out of memory, at the disk's
        speed of creating files.
    snapshot_bytes: the most a pool's snapshots may hold on a node (None: half the
        snapshot root's filesystem); a snapshot past it, or past a tenth of that
        filesystem left free, is refused.
    image_roots: the directories whose subdirectories may be ``dir:`` images (None:
        those the ``SANDMAN_IMAGE_ROOTS`` environment variable of the process that
        makes the provider names, colon-separated; none if it is unset). A ``dir:``
        image elsewhere is refused at create; the host's root, its system
        directories and the state, cache and snapshot roots are refused as roots
        (images.check_image_root).
    image_cache_bytes: the most the unpacked images of each node's cache may hold
        (None: half of the cache's filesystem); past it, the least recently used
        image that no sandbox, snapshot or build of that node uses is evicted
        (sandman_ray/image_budget.py). Images of ``builtin:`` are never evicted.
    """

    supports_reset = True
    weighs = True  # each sandbox a cpu group of its own (cgroups.py)
    binds_late = True  # its daemon's bind, its agent's labels
    supports_snapshots = True
    carries_snapshots = True
    agent_kind = "agent"
    # No shared control plane: each create goes to the agent on a node of this cluster,
    # and what bounds it is that node's CPU (the bucket still backs off when creates
    # time out). Holding a cold burst back costs it here: 200 at once were ready in
    # 5.7 s, at 50/s with 64 at a time in 7.6 s (make bench, 2 cores).
    pacing = {"create_rate_per_s": 1000.0, "create_burst": 256, "max_starting": 256}

    def __init__(self, state_root: str = DEFAULT_STATE_ROOT,
                 cache_root: str = DEFAULT_CACHE_ROOT, prefer_tools: bool = True,
                 ready_timeout_s: float = 30.0, user_namespaces: bool = True,
                 isolation: str = "namespaces", snapshot_root: str = DEFAULT_SNAPSHOT_ROOT,
                 snapshot_bytes: Optional[int] = None,
                 image_roots: Optional[Sequence[str]] = None,
                 image_cache_bytes: Optional[Union[int, str]] = None):
        super().__init__()
        self.image_cache_bytes = parse_bytes(image_cache_bytes,
                                             "LocalProvider.image_cache_bytes")
        if isolation not in ("namespaces", "gvisor"):
            raise ValueError("LocalProvider.isolation must be 'namespaces' or 'gvisor', got %r"
                             % (isolation,))
        self.isolation = isolation
        self.state_root, self.cache_root = state_root, cache_root
        self.prefer_tools, self.ready_timeout_s = prefer_tools, ready_timeout_s
        self.user_namespaces = user_namespaces
        self.snapshot_root, self.snapshot_bytes = snapshot_root, snapshot_bytes
        if image_roots is None:
            image_roots = [r for r in os.environ.get(IMAGE_ROOTS_ENV, "").split(":") if r]
        reserved = (state_root, cache_root, snapshot_root)
        for root in image_roots:
            check_image_root(root, reserved)  # ValueError now, not at the first create
        self.image_roots = tuple(image_roots)

    def agent_class(self):
        return NodeAgent

    def controller(self, node_id: Optional[str]) -> Optional[str]:
        """The node's agent pauses and resumes for a holder that shows the token."""
        return agent_name(self.pool, node_id, self.agent_kind) if node_id else None

    def is_snapshot_image(self, image: str) -> bool:
        return image.startswith("snapshot:")

    async def prefetch(self, image: str, node_id: str) -> Dict[str, object]:
        return await self._on_agent(node_id, "prefetch", image,
                                    task=pool_task_name("prefetch", self.pool))

    async def image_cache(self) -> Dict[str, Dict[str, int]]:
        return {node: stats async for node, stats in self._from_each_agent("image_cache")}

    def agent_args(self, node_id: str) -> tuple:
        return (self.pool, node_id, self.state_root, self.cache_root, self.prefer_tools,
                self.ready_timeout_s, self.user_namespaces, self.isolation,
                self.snapshot_root, self.snapshot_bytes, PoolNeeds.of(self.pool_config),
                self.image_roots, self.image_cache_bytes)
