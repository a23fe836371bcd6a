"""Sandbox states in a pool and the only transitions allowed between them.

REQUESTED -> CREATING -> STARTING -> READY -> LEASED -> RELEASING
          -> (RESETTING -> READY | DELETING) -> GONE, and FAILED from any state.
"""

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from sandman_ray.spec import SandboxSpec


class State(enum.Enum):
    REQUESTED = "requested"    # wanted; waiting for a create token and a start slot
    CREATING = "creating"      # provider.create in flight
    STARTING = "starting"      # created; waiting for the daemon to answer ping + exec
    READY = "ready"            # answers; in the warm set, free to lease
    LEASED = "leased"          # held by one lease (a handle of one client)
    RELEASING = "releasing"    # the lease ended; reset or delete comes next
    RESETTING = "resetting"    # provider.reset in flight; READY again after
    DELETING = "deleting"      # provider.delete in flight
    GONE = "gone"              # deleted; the record is dropped
    FAILED = "failed"          # could not be made or kept; deleted next


_NEXT = {
    State.REQUESTED: {State.CREATING},
    State.CREATING: {State.STARTING, State.CREATING},
    State.STARTING: {State.READY, State.CREATING},  # CREATING: a retry of a failed start
    State.READY: {State.LEASED, State.DELETING, State.STARTING},
    State.LEASED: {State.RELEASING},
    State.RELEASING: {State.RESETTING, State.DELETING},
    State.RESETTING: {State.READY, State.STARTING},
    State.DELETING: {State.GONE},
    State.FAILED: {State.DELETING},
    State.GONE: set(),
}
# States in which a sandbox counts towards what the pool will soon have for its spec.
COMING = {State.REQUESTED, State.CREATING, State.STARTING, State.RESETTING}


class EndedLeases(collections.OrderedDict):
    """Why each recently ended lease ended (lease id -> reason), oldest first, at most
    ``kept`` of them: a host and a pool answer a late call on one with the reason."""

    def __init__(self, kept: int = 100000):
        super().__init__()
        self.kept = kept

    def note(self, lease_id: str, reason: str) -> None:
        self[lease_id] = reason
        while len(self) > self.kept:
            self.popitem(last=False)


@dataclass(frozen=True)
class Lease:
    """A sandbox lent to one client until released.

    lease_id: unique per lease (a sandbox leased twice gets two). sandbox_id, address,
    token, node_id: where its daemon is. pool: the pool that lent it.
    """

    lease_id: str
    sandbox_id: str
    address: str
    token: str
    node_id: Optional[str]
    pool: str


@dataclass
class Sandbox:
    """The pool's record of one sandbox."""

    sandbox_id: str
    spec: SandboxSpec
    state: State = State.REQUESTED
    since: float = field(default_factory=time.monotonic)
    info: object = None            # SandboxInfo once created
    lease: Optional[Lease] = None
    client: Optional[str] = None
    handle: Optional[str] = None   # the actor name of the handle holding the lease
    handle_seen: bool = False      # that actor has been seen alive (else: the grace runs)
    registered_at: float = 0.0     # when a handle registered the lease (monotonic)
    leased_at: float = 0.0
    last_used: float = 0.0
    attempts: int = 0

    def to(self, state: State) -> None:
        """Move to ``state``; anything but an allowed transition is a bug. (Why is the
        pool's event log's: ``PoolActor._to``.)"""
        if state is not State.FAILED and state not in _NEXT[self.state]:
            raise RuntimeError("sandbox %s: %s -> %s is not a transition"
                               % (self.sandbox_id, self.state.name, state.name))
        self.state, self.since = state, time.monotonic()


def counts(records: Dict[str, Sandbox]) -> Dict[str, int]:
    out = {s.value: 0 for s in State}
    for rec in records.values():
        out[rec.state.value] += 1
    return out
