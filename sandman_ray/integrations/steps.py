"""The turn boundary, for every integration: a trajectory's sandbox is paused once a
step is answered, while the model thinks, when its pool says so
(``PoolConfig.pause_between_steps``), and runs again at the next call (the leases of
the integrations resume on a call: ``acquire(..., auto_resume=True)``). An asyncio
integration, whose calls on one sandbox may overlap, wraps each in ``stepping``: the
sandbox is resumed before the call, without blocking the loop, and paused once no
call of it is in flight."""

import asyncio
import contextlib


def step_done(sandbox) -> None:
    """A step's answer is in: pause ``sandbox`` where its pool says so (for an
    integration whose steps on one sandbox follow each other)."""
    if sandbox is not None and sandbox.pause_between_steps and not sandbox.paused:
        sandbox.pause()


class _InFlight:
    """A sandbox's calls in flight through ``stepping``, and the lock its pauses and
    resumes take turns under."""

    def __init__(self):
        self.calls, self.lock = 0, asyncio.Lock()


def _in_flight(sandbox) -> _InFlight:
    state = getattr(sandbox, "_steps_in_flight", None)
    if state is None:
        state = sandbox._steps_in_flight = _InFlight()
    return state


@contextlib.asynccontextmanager
async def stepping(sandbox):
    """One call of a step on ``sandbox``: running for it, and paused after the last
    call in flight where the pool says so."""
    state = _in_flight(sandbox)
    async with state.lock:
        state.calls += 1
        if sandbox.paused:
            await sandbox.resume_async()
    try:
        yield sandbox
    finally:
        async with state.lock:
            state.calls -= 1
            if state.calls == 0:
                await step_done_async(sandbox)


async def step_done_async(sandbox) -> None:
    """``step_done`` for asyncio code (under ``stepping``'s lock, or before any call)."""
    if sandbox.pause_between_steps and not sandbox.paused:
        await sandbox.pause_async()
