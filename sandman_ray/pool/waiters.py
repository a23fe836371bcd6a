"""Waiters for sandboxes, served fairly across clients."""

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, List, Optional

from sandman_ray.spec import SandboxSpec


@dataclass
class Waiter:
    client: str
    spec: SandboxSpec
    future: object               # asyncio.Future of the Lease
    lease_id: str
    deadline: float
    enqueued: float = 0.0
    holder: Optional[str] = None  # the host actor's name that will hold the lease
    holder_node: Optional[str] = None  # the node that host runs on
    want: Optional[str] = None  # the node it prefers a sandbox on (the caller's)
    only: Optional[str] = None  # the node its sandbox must be on (asked for)
    keepalive_s: float = 0.0  # its lease lasts while kept alive (0: while held)
    weight: float = 1.0  # its client's share of the lending (a service tenant's weight)
    task: Optional[SandboxSpec] = None  # the spec asked, when ``spec`` leaves out what
    # is bound late (PoolConfig.slot), its settings given as it is lent
    lent: object = None  # the record lent to it while those are bound

    @property
    def node(self) -> Optional[str]:
        """The node a sandbox made for it should be created on, if any."""
        return self.only or self.want


@dataclass
class FairQueue:
    """FIFO per client; clients take turns, in proportion to their weights. A client's
    burst of 200 requests waits behind one request of every other client, not in front
    of them; a client of weight 3 is served three times for another's once (stride
    scheduling: each client has a pass, the waiting client of the lowest pass is served
    next and its pass grows by 1/weight; one that starts waiting starts at the lowest
    pass of those waiting, so no client banks turns while it waits for nothing). The
    number waiting per spec is kept, not counted."""

    queues: Dict[str, Deque[Waiter]] = field(default_factory=dict)
    turn: Deque[str] = field(default_factory=collections.deque)
    per_spec: collections.Counter = field(default_factory=collections.Counter)
    passes: Dict[str, float] = field(default_factory=dict)

    def push(self, waiter: Waiter) -> None:
        if waiter.client not in self.queues:
            self.queues[waiter.client] = collections.deque()
            self.turn.append(waiter.client)
            self.passes[waiter.client] = min(self.passes.values(), default=0.0)
        self.queues[waiter.client].append(waiter)
        self.per_spec[waiter.spec] += 1

    def remove(self, waiter: Waiter) -> None:
        queue = self.queues.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._removed(waiter)

    def _removed(self, waiter: Waiter) -> None:
        self.per_spec[waiter.spec] -= 1
        if self.per_spec[waiter.spec] <= 0:
            del self.per_spec[waiter.spec]
        if not self.queues[waiter.client]:
            del self.queues[waiter.client]
            self.turn.remove(waiter.client)
            self.passes.pop(waiter.client, None)

    def __len__(self) -> int:
        return sum(self.per_spec.values())

    def waiting(self) -> Iterator[Waiter]:
        for queue in self.queues.values():
            yield from queue

    def of(self, client: str) -> List[Waiter]:
        return list(self.queues.get(client, ()))

    def next_for(self, spec: SandboxSpec, allowed, servable=None) -> Optional[Waiter]:
        """Pop the first waiter for ``spec``, taking clients in turn; ``allowed(client)``
        says whether a client may get one more (its quota), ``servable(waiter)`` whether
        a sandbox is ready for it (one that takes only one node)."""
        if not self.per_spec.get(spec):
            return None
        best = None  # (pass, turn, waiter): the lowest pass, in turn order among equals
        for turn in range(len(self.turn)):
            client = self.turn[turn]
            if (best is not None and self.passes[client] >= best[0]) or not allowed(client):
                continue
            for waiter in self.queues[client]:
                if waiter.spec == spec and (servable is None or servable(waiter)):
                    best = (self.passes[client], turn, waiter)
                    break
        if best is None:
            return None
        _, turn, waiter = best
        self.passes[waiter.client] += 1.0 / waiter.weight
        self.turn.rotate(-turn - 1)  # among equal passes, the next turn is the next client's
        self.queues[waiter.client].remove(waiter)
        self._removed(waiter)
        return waiter
