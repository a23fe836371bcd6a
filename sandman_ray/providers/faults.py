"""A provider that wraps another and misbehaves on purpose: for the fault suite and for
trying a pool's pacing against an overloaded cluster without one."""

import asyncio
import random
from typing import Dict, Optional

from sandman_ray.providers.base import Provider, SandboxInfo, throttled, transient
from sandman_ray.spec import SandboxSpec


class FaultyProvider(Provider):
    """Delegates to ``inner``, after:

    throttle_first: refusing this many creates as ``throttled`` (an API server's 429);
    fail_rate: refusing this fraction of the other creates as ``transient``;
    create_delay_s: waiting this long before each create (a slow scheduler).
    ``injected`` counts what was done.
    """

    def __init__(self, inner: Provider, throttle_first: int = 0, fail_rate: float = 0.0,
                 create_delay_s: float = 0.0, seed: Optional[int] = None):
        self.inner = inner
        self.throttle_left = throttle_first
        self.fail_rate = fail_rate
        self.create_delay_s = create_delay_s
        self.random = random.Random(seed)
        self.injected: Dict[str, int] = {"throttled": 0, "transient": 0}
        self.supports_reset = inner.supports_reset

    def bind(self, pool: str, config=None) -> "FaultyProvider":
        super().bind(pool, config)
        self.inner.bind(pool, config)
        return self

    async def create(self, sandbox_id: str, spec: SandboxSpec,
                     labels: Dict[str, str]) -> SandboxInfo:
        if self.create_delay_s:
            await asyncio.sleep(self.create_delay_s)
        if self.throttle_left > 0:
            self.throttle_left -= 1
            self.injected["throttled"] += 1
            raise throttled("429 Too Many Requests (injected)")
        if self.fail_rate and self.random.random() < self.fail_rate:
            self.injected["transient"] += 1
            raise transient("503 Service Unavailable (injected)")
        return await self.inner.create(sandbox_id, spec, labels)

    async def warm_up(self) -> None:
        await self.inner.warm_up()

    async def nodes(self):
        return await self.inner.nodes()

    def place(self, sandbox_id: str, node_id: str) -> None:
        self.inner.place(sandbox_id, node_id)

    async def delete(self, sandbox_id: str) -> None:
        await self.inner.delete(sandbox_id)

    async def list(self, labels=None):
        return await self.inner.list(labels)

    async def reset(self, sandbox_id: str) -> SandboxInfo:
        return await self.inner.reset(sandbox_id)

    async def shutdown(self) -> int:
        return await self.inner.shutdown()

    async def close(self) -> None:
        await self.inner.close()
