"""Waiters for sandboxes, served fairly across clients."""

import collections
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterator, Optional

from sandman_ray.spec import SandboxSpec


@dataclass
class Waiter:
    client: str
    spec: SandboxSpec
    future: object               # asyncio.Future of the Lease
    lease_id: str
    deadline: float
    enqueued: float = 0.0
    handle: Optional[str] = None  # the actor name that will hold the lease


@dataclass
class FairQueue:
    """FIFO per client; clients take turns. A client's burst of 200 requests waits
    behind one request of every other client, not in front of them."""

    queues: Dict[str, Deque[Waiter]] = field(default_factory=dict)
    turn: Deque[str] = field(default_factory=collections.deque)

    def push(self, waiter: Waiter) -> None:
        if waiter.client not in self.queues:
            self.queues[waiter.client] = collections.deque()
            self.turn.append(waiter.client)
        self.queues[waiter.client].append(waiter)

    def remove(self, waiter: Waiter) -> None:
        queue = self.queues.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self._drop_if_empty(waiter.client)

    def _drop_if_empty(self, client: str) -> None:
        if not self.queues[client]:
            del self.queues[client]
            self.turn.remove(client)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def waiting(self) -> Iterator[Waiter]:
        for queue in self.queues.values():
            yield from queue

    def next_for(self, spec: SandboxSpec, allowed) -> Optional[Waiter]:
        """Pop the first waiter for ``spec``, taking clients in turn; ``allowed(client)``
        says whether a client may get one more (its quota)."""
        for _ in range(len(self.turn)):
            client = self.turn[0]
            self.turn.rotate(-1)
            if not allowed(client):
                continue
            queue = self.queues[client]
            for waiter in queue:
                if waiter.spec == spec and not waiter.future.done():
                    queue.remove(waiter)
                    self._drop_if_empty(client)
                    return waiter
        return None
