"""Sandbox states in a pool and the only transitions allowed between them.

REQUESTED -> CREATING -> READY -> LEASED -> RELEASING -> (RESETTING -> READY | DELETING)
-> GONE, and FAILED from any state. A provider's create and reset return a sandbox whose
daemon answers, so READY follows CREATING and RESETTING directly.
"""

import collections
import enum
import time
from dataclasses import dataclass
from typing import Dict, Optional

from sandman_ray.spec import SandboxSpec


class State(enum.Enum):
    REQUESTED = "requested"    # wanted; waiting for a create token and a start slot
    CREATING = "creating"      # provider.create in flight (until the daemon answers)
    READY = "ready"            # answers; in the warm set, free to lease
    LEASED = "leased"          # held by one lease (a handle of one client)
    RELEASING = "releasing"    # the lease ended; reset or delete comes next
    RESETTING = "resetting"    # provider.reset in flight; READY again after
    DELETING = "deleting"      # provider.delete in flight
    GONE = "gone"              # deleted; the record is dropped
    FAILED = "failed"          # could not be made or kept; deleted next


_NEXT = {
    State.REQUESTED: {State.CREATING},
    State.CREATING: {State.READY},
    State.READY: {State.LEASED, State.DELETING},
    State.LEASED: {State.RELEASING},
    State.RELEASING: {State.RESETTING, State.DELETING},
    State.RESETTING: {State.READY},
    State.DELETING: {State.GONE},
    State.FAILED: {State.DELETING},
    State.GONE: set(),
}
# States in which a sandbox counts towards what the pool will soon have for its spec.
COMING = frozenset({State.REQUESTED, State.CREATING, State.RESETTING})
# ... and with READY, what it has or will soon have.
SUPPLY = COMING | {State.READY}


class EndedLeases(collections.OrderedDict):
    """Why each recently ended lease ended (lease id -> reason), oldest first: those
    that ended within the last ``keep_s`` seconds, at most ``kept`` of them. A host and
    a pool answer a late call on one with the reason, and refuse an offer or a retried
    acquire of one (both come within seconds); a call on a lease that ended longer ago
    is told it is not held. (Kept by count alone, a pool that lends 20 leases a second
    grew by ~2.5 MB every 10,000 until it held 100,000.)"""

    def __init__(self, kept: int = 100000, keep_s: float = 600.0, clock=time.monotonic):
        super().__init__()
        self.kept, self.keep_s, self.clock = kept, keep_s, clock
        self.noted: Dict[str, float] = {}  # lease id -> when it was noted

    def note(self, lease_id: str, reason: str) -> None:
        now = self.clock()
        self[lease_id] = reason
        self.move_to_end(lease_id)
        self.noted[lease_id] = now
        while self and (len(self) > self.kept or
                        self.noted[next(iter(self))] < now - self.keep_s):
            oldest, _ = self.popitem(last=False)
            self.noted.pop(oldest, None)


@dataclass(frozen=True)
class Lease:
    """A sandbox lent to one client until released.

    lease_id: unique per lease (a sandbox leased twice gets two). sandbox_id, address,
    token, node_id: where its daemon is. pool: the pool that lent it; client: to whom;
    leased_wall: when (wall clock); pause_between_steps: the pool's word to the
    integrations (PoolConfig); controller: the actor on the sandbox's node that pauses
    and resumes it for a caller showing the token (``Provider.controller``; None:
    pauses go through the pool); keepalive_s: for a lease held for a caller outside Ray
    (a client of the service), how long it lasts without a call or a keepalive (0: it
    lasts while its host lives). The hosts that hold leases are the pool's record of
    them: a restarted pool asks them.
    """

    lease_id: str
    sandbox_id: str
    address: str
    token: str
    node_id: Optional[str]
    pool: str
    client: str = ""
    leased_wall: float = 0.0
    pause_between_steps: bool = False
    controller: Optional[str] = None
    keepalive_s: float = 0.0


def pack_lease_request(spec, client: str, timeout_s: float, holder: str, holder_node: str,
                       lease_id: str, node: Optional[str] = None,
                       keepalive_s: Optional[float] = None,
                       weight: Optional[float] = None) -> bytes:
    """An acquire's request to the pool as one bytes argument (``PoolActor.lease``)."""
    from sandman_ray.daemon.sandmand.wire import pack
    return pack([spec if isinstance(spec, str) else spec.to_dict(), client, timeout_s,
                 holder, holder_node, lease_id, node, keepalive_s, weight])


def unpack_lease_request(data: bytes) -> list:
    from sandman_ray.daemon.sandmand.wire import unpack
    spec, *rest = unpack(data)
    return [spec if isinstance(spec, str) else SandboxSpec.from_dict(spec)] + rest


def pack_lease(lease: Lease) -> bytes:
    from sandman_ray.daemon.sandmand.wire import pack
    return pack([lease.lease_id, lease.sandbox_id, lease.address, lease.token,
                 lease.node_id, lease.pool, lease.client, lease.leased_wall,
                 lease.pause_between_steps, lease.controller, lease.keepalive_s])


def unpack_lease(data: bytes) -> Lease:
    from sandman_ray.daemon.sandmand.wire import unpack
    return Lease(*unpack(data))


@dataclass
class Sandbox:
    """The pool's record of one sandbox."""

    sandbox_id: str
    spec: SandboxSpec
    state: State = State.REQUESTED
    since: float = 0.0             # when it entered its state (the pool's clock)
    info: object = None            # SandboxInfo once created
    lease: Optional[Lease] = None
    client: Optional[str] = None
    holder: Optional[str] = None   # the actor name of the handle host holding the lease
    holder_seen: bool = False      # that host has been seen alive (else: the grace runs)
    registered_at: float = 0.0     # when a host registered the lease (the pool's clock)
    leased_at: float = 0.0
    last_used: float = 0.0
    attempts: int = 0
    node_hint: Optional[str] = None  # the node it is created on for a waiter, if any
    indexed_node: Optional[str] = None  # the node Records indexes it under (its state's)
    paused: bool = False           # its holder paused it (pool/snapshots.py)
    keepalive_s: float = 0.0       # a lease that lasts while kept alive (0: while held)
    kept_at: float = 0.0           # its last call or keepalive (the pool's clock)
    cpu_weight: Optional[float] = None  # its share of its node's CPU, as last set
    task: Optional[SandboxSpec] = None  # what its lease asked, when bound late (lending.py)
    handing: object = None  # while that is bound: the future its lease is handed out by

    @property
    def node(self) -> Optional[str]:
        """The Ray node it runs on, or is being created on when a waiter asked."""
        node = getattr(self.info, "node_id", None)
        return node if node is not None else self.node_hint

    def to(self, state: State, now: float) -> None:
        """Move to ``state``; anything but an allowed transition is a bug. (Why is the
        pool's event log's: ``PoolState.to``.)"""
        if state is not State.FAILED and state not in _NEXT[self.state]:
            raise RuntimeError("sandbox %s: %s -> %s is not a transition"
                               % (self.sandbox_id, self.state.name, state.name))
        self.state, self.since = state, now
