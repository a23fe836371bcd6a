"""The reconciler's world in fakes, for tests that drive its decisions directly and
fast: a clock the test moves, a cluster (which hosts and nodes are alive, the leases
they hold), a provider whose sandboxes are entries of a dict, and ``make`` that builds
a reconciler over them. The real ones are exercised by test_pool.py and the chaos
suite."""

import asyncio
import dataclasses

from sandman_ray.pool.reconciler import Reconciler
from sandman_ray.providers.base import SANDBOX_LABEL, Provider, SandboxInfo, SnapshotInfo
from sandman_ray.spec import PoolConfig, SandboxSpec

NODE, OTHER = "node-a", "node-b"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def time(self):
        return 1.7e9 + self.now

    async def sleep(self, seconds):
        self.now += seconds
        await asyncio.sleep(0)


class FakeCluster:
    def __init__(self):
        self.hosts, self.nodes = set(), {NODE, OTHER}
        self.told, self.offered = [], []
        self.held = {}  # host name -> the leases it holds
        self.answered = set()  # hosts that answered an offer, until asked

    async def live_hosts(self):
        return set(self.hosts)

    async def answered_hosts(self):
        answered, self.answered = self.answered, set()
        return answered

    async def alive_nodes(self):
        return set(self.nodes)

    async def held_leases(self, pool):
        return {lease.sandbox_id: (lease, host) for host, leases in self.held.items()
                if host in self.hosts for lease in leases if lease.pool == pool}

    def tell_host(self, host, lease_id, reason):
        self.told.append((host, lease_id, reason))

    def offer(self, host, lease):
        self.offered.append((host, lease.lease_id))


class NoMetrics:
    def due(self):
        return False

    def __getattr__(self, name):
        return lambda *args: None


class FakeProvider(Provider):
    """Sandboxes as entries of a dict, on NODE and OTHER: created where ``place`` said,
    else on ``default_node``; ``fail`` holds the errors the next creates raise."""

    supports_reset = True

    def __init__(self):
        self.sandboxes, self.fail, self.calls = {}, [], []
        self.default_node = NODE
        self.placed = {}
        self.resets = 0

    async def nodes(self):
        return [NODE, OTHER]

    def place(self, sandbox_id, node_id):
        self.placed[sandbox_id] = node_id

    def _info(self, sandbox_id, spec, labels, node):
        return SandboxInfo(sandbox_id, "unix:/run/%s/sock" % sandbox_id, "t-" + sandbox_id,
                           node, dict(labels, **{SANDBOX_LABEL: sandbox_id}), 1.0, spec)

    async def create(self, sandbox_id, spec, labels):
        self.calls.append(("create", sandbox_id))
        if self.fail:
            raise self.fail.pop(0)
        info = self._info(sandbox_id, spec, labels,
                          self.placed.pop(sandbox_id, self.default_node))
        self.sandboxes[sandbox_id] = info
        return info

    async def reset(self, sandbox_id):
        self.resets += 1  # started afresh: a new token
        info = dataclasses.replace(self.sandboxes[sandbox_id], token="t-%d" % self.resets)
        self.sandboxes[sandbox_id] = info
        return info

    async def delete(self, sandbox_id):
        self.calls.append(("delete", sandbox_id))
        self.sandboxes.pop(sandbox_id, None)

    async def list(self, labels=None):
        return [i for i in self.sandboxes.values()
                if all(i.labels.get(k) == v for k, v in (labels or {}).items())]

    async def snapshot(self, sandbox_id, name):
        self.calls.append(("snapshot", name))
        return SnapshotInfo(name, "snapshot:p/" + name, self.sandboxes[sandbox_id].spec.image,
                            0, source=sandbox_id)

    async def delete_snapshot(self, name):
        self.calls.append(("delete_snapshot", name))


SPEC = SandboxSpec(image="host")


def make(provider=None, **config):
    config.setdefault("default_pids", None)
    config.setdefault("default_memory", None)
    config.setdefault("default_disk", None)
    provider, clock, cluster = provider or FakeProvider(), FakeClock(), FakeCluster()
    pool = Reconciler("p", PoolConfig(provider=provider, **config), provider.bind("p"),
                      cluster, clock, NoMetrics())
    return pool, provider, clock, cluster


async def settle(pool, ticks=3):
    """Tick and let the side effects the tick started run, a few times over."""
    for _ in range(ticks):
        pool.tick()
        for _ in range(5):
            await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)
