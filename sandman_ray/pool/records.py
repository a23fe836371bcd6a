"""The pool's records of its sandboxes, indexed so that no question rescans them.

Every record sits in the index of its state (oldest first: the order in which the
records entered it); READY records are indexed by spec as well, and the counts the
reconciler asks for (what each spec has or will soon have, leases per client, records
per node) are kept as records move rather than recomputed. Records move only through
``Records``, which keeps all of that in step; a tick then costs what changed, not what
exists.
"""

import collections
from typing import Dict, Iterable, List, Optional

from sandman_ray.pool.states import SUPPLY, Lease, Sandbox, State
from sandman_ray.spec import SandboxSpec


class Records:
    def __init__(self):
        self.by_id: Dict[str, Sandbox] = {}
        self.in_state: Dict[State, Dict[str, Sandbox]] = {s: {} for s in State}
        self.ready: Dict[SandboxSpec, Dict[str, Sandbox]] = {}  # READY, per spec, oldest first
        self.supply: collections.Counter = collections.Counter()  # spec -> READY or coming
        # (spec, node) -> READY sandboxes there, oldest first; and READY or coming there
        self.ready_at: Dict[tuple, Dict[str, Sandbox]] = {}
        self.supply_at: collections.Counter = collections.Counter()
        self.leases: Dict[str, Sandbox] = {}  # lease id -> the LEASED record
        self.by_client: Dict[str, Dict[str, Sandbox]] = {}  # client -> its leased sandboxes
        self.client_weight: Dict[str, float] = {}  # client -> its weight (pool/shares.py)
        self.reweigh: set = set()  # clients whose sandboxes' CPU weights are due again
        self.per_holder: Dict[str, Dict[str, Sandbox]] = {}  # host name -> its leased records
        self.per_node: Dict[str, Dict[str, Sandbox]] = {}  # node id -> records placed there
        self.visited = 0  # records examined by questions that walk an index (tests count)

    # ---- questions
    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self.by_id

    def get(self, sandbox_id: str) -> Optional[Sandbox]:
        return self.by_id.get(sandbox_id)

    def values(self) -> Iterable[Sandbox]:
        return self.by_id.values()

    def count(self, state: State) -> int:
        return len(self.in_state[state])

    def counts(self) -> Dict[str, int]:
        return {s.value: len(recs) for s, recs in self.in_state.items()}

    def held(self) -> int:
        """Records that hold (or will hold) a sandbox: all but those already gone."""
        return len(self.by_id) - len(self.in_state[State.GONE])

    def walk(self, state: State) -> List[Sandbox]:
        """The records in ``state``, oldest first (a copy: the caller may move them)."""
        recs = list(self.in_state[state].values())
        self.visited += len(recs)
        return recs

    def leased(self, lease_id: str) -> Optional[Sandbox]:
        return self.leases.get(lease_id)

    def held_by(self, holder: str) -> List[Sandbox]:
        recs = list(self.per_holder.get(holder, {}).values())
        self.visited += len(recs)
        return recs

    def holders(self) -> set:
        """The names of the hosts that hold a lease."""
        return set(self.per_holder)

    def on_node(self, node_id: str) -> List[Sandbox]:
        recs = list(self.per_node.get(node_id, {}).values())
        self.visited += len(recs)
        return recs

    def nodes(self) -> List[str]:
        return list(self.per_node)

    # ---- changes
    def add(self, rec: Sandbox) -> None:
        """A new record, in the state it already has."""
        if rec.sandbox_id in self.by_id:
            raise RuntimeError("sandbox %s has a record already" % rec.sandbox_id)
        self.by_id[rec.sandbox_id] = rec
        self._enter(rec)
        self.place(rec, rec.info)

    def move(self, rec: Sandbox, state: State, now: float) -> None:
        if rec.sandbox_id not in self.by_id:
            raise RuntimeError("sandbox %s has no record (moved to %s)" % (rec.sandbox_id,
                                                                            state.name))
        self._leave(rec)
        try:
            rec.to(state, now)
        finally:
            self._enter(rec)

    def drop(self, rec: Sandbox) -> None:
        """Forget a record (gone)."""
        if self.by_id.pop(rec.sandbox_id, None) is None:
            return
        self._leave(rec)
        self.place(rec, None)

    def place(self, rec: Sandbox, info) -> None:
        """``rec``'s sandbox is now where ``info`` says (None: nowhere)."""
        old = getattr(rec.info, "node_id", None)
        if old is not None and old in self.per_node:
            self.per_node[old].pop(rec.sandbox_id, None)
            if not self.per_node[old]:
                del self.per_node[old]
        rec.info = info
        node = getattr(info, "node_id", None)
        if node is not None and rec.sandbox_id in self.by_id:
            self.per_node.setdefault(node, {})[rec.sandbox_id] = rec

    def leases_of(self, client: str) -> int:
        return len(self.by_client.get(client, ()))

    @property
    def per_client(self) -> Dict[str, int]:
        """client -> how many leases it holds."""
        return {client: len(recs) for client, recs in self.by_client.items()}

    def lend(self, rec: Sandbox, lease: Lease, client: str, holder: Optional[str],
             weight: float = 1.0) -> None:
        """The lease part of READY -> LEASED (the caller moves the state); ``weight``:
        the client's (pool/shares.py)."""
        rec.lease, rec.client, rec.holder = lease, client, holder
        self.leases[lease.lease_id] = rec
        self.by_client.setdefault(client, {})[rec.sandbox_id] = rec
        self.client_weight[client] = weight
        self.reweigh.add(client)
        if holder is not None:
            self.per_holder.setdefault(holder, {})[rec.sandbox_id] = rec

    def hold(self, rec: Sandbox, holder: str) -> None:
        """The host ``holder`` now holds ``rec``'s lease."""
        self._unhold(rec)
        rec.holder = holder
        self.per_holder.setdefault(holder, {})[rec.sandbox_id] = rec

    def end_lease(self, rec: Sandbox) -> None:
        if rec.lease is not None:
            self.leases.pop(rec.lease.lease_id, None)
            mine = self.by_client.get(rec.client, {})
            mine.pop(rec.sandbox_id, None)
            if not mine:
                self.by_client.pop(rec.client, None)
                self.client_weight.pop(rec.client, None)
            self.reweigh.add(rec.client)
            rec.cpu_weight = None  # its reset puts it back at 1 (Provider.weigh)
        self._unhold(rec)
        rec.lease, rec.client, rec.holder = None, None, None
        rec.task = rec.handing = None

    # ---- the indexes
    def _unhold(self, rec: Sandbox) -> None:
        held = self.per_holder.get(rec.holder)
        if held is not None:
            held.pop(rec.sandbox_id, None)
            if not held:
                del self.per_holder[rec.holder]

    def ready_on(self, spec: SandboxSpec, node: Optional[str]) -> Dict[str, Sandbox]:
        """READY sandboxes of ``spec`` on ``node``, oldest first."""
        return self.ready_at.get((spec, node), {})

    def supply_on(self, spec: SandboxSpec) -> collections.Counter:
        """Per node, the sandboxes of ``spec`` READY or coming there."""
        return collections.Counter({node: n for (s, node), n in self.supply_at.items()
                                    if s == spec})

    def _enter(self, rec: Sandbox) -> None:
        self.in_state[rec.state][rec.sandbox_id] = rec
        rec.indexed_node = rec.node  # where it is indexed, until it leaves this state
        if rec.state is State.READY:
            self.ready.setdefault(rec.spec, {})[rec.sandbox_id] = rec
            self.ready_at.setdefault((rec.spec, rec.indexed_node), {})[rec.sandbox_id] = rec
        if rec.state in SUPPLY:
            self.supply[rec.spec] += 1
            self.supply_at[(rec.spec, rec.indexed_node)] += 1

    def _leave(self, rec: Sandbox) -> None:
        self.in_state[rec.state].pop(rec.sandbox_id, None)
        if rec.state is State.READY:
            _pop(self.ready, rec.spec, rec.sandbox_id)
            _pop(self.ready_at, (rec.spec, rec.indexed_node), rec.sandbox_id)
        if rec.state in SUPPLY:
            _decrement(self.supply, rec.spec)
            _decrement(self.supply_at, (rec.spec, rec.indexed_node))


def _pop(index: dict, key, sandbox_id: str) -> None:
    entries = index.get(key)
    if entries is not None:
        entries.pop(sandbox_id, None)
        if not entries:
            del index[key]


def _decrement(counter: collections.Counter, key) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
