"""Calls to a pool's actor while Ray may be restarting it: the one rule for every
caller (the public API's acquire and release, a handle host telling its pool,
``lookup.call_pool`` for forks, snapshots and pauses).

An attempt that finds the actor unavailable (Ray is restarting it) is made again after
a short wait, up to ATTEMPTS times or a deadline; one that finds the actor dead for
good (a cached handle of a pool since shut down and created anew, by another process
perhaps) is made once more of the actor that ``again`` finds under the pool's name,
if that is another one. Anything else is the call's own error.

A call is a plan: a generator that yields the ObjectRef of each attempt (and is sent
back ``(True, value)`` or ``(False, exception)``) or a float (seconds to wait before
the next), and returns the call's value. ``carried`` and ``carried_async`` drive one;
``asking`` makes one.
"""

import asyncio
import time
from typing import Any, Callable, Generator, Optional

import ray

ATTEMPTS = 20  # attempts of a call while Ray restarts the pool's actor (~15 s in all)

Plan = Generator[Any, Any, Any]


def restart_wait(attempt: int) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0 first), while Ray restarts
    the actor."""
    return float(min(0.05 * 2 ** attempt, 1.0))


def another(fresh, dead):
    """``fresh`` (the pool's actor looked up anew, once ``dead`` turned out dead) if it is
    another actor; None when it is the same one (the pool itself is gone)."""
    return None if fresh._actor_id == dead._actor_id else fresh


def asking(ask: Callable[[Any], Any], actor, again: Callable[[Any], Optional[Any]],
           deadline: Optional[float] = None) -> Plan:
    """The plan of one call: ``ask(actor)`` sends an attempt (its ObjectRef); ``again
    (dead)`` is the pool's actor looked up anew, or None when there is no other;
    ``deadline`` (time.monotonic()): no attempt after it for an unavailable actor."""
    attempt, looked_again = 0, False
    while True:
        ok, value = yield ask(actor)
        if ok:
            return value
        if isinstance(value, ray.exceptions.ActorUnavailableError):
            attempt += 1
            if attempt < ATTEMPTS and (deadline is None or time.monotonic() < deadline):
                yield restart_wait(attempt - 1)
                continue
        elif isinstance(value, ray.exceptions.RayActorError) and not looked_again:
            fresh = again(actor)
            if fresh is not None:
                actor, looked_again = fresh, True
                continue
        raise value


def carried(plan: Plan, timeout: Optional[Callable[[], float]] = None):
    """The value of ``plan``, each attempt waited for with ``ray.get`` (at most
    ``timeout()`` seconds, where given)."""
    step, done = next(plan), False
    while not done:
        if isinstance(step, float):
            time.sleep(step)
            outcome = None
        else:
            try:
                outcome = (True, ray.get(step, timeout=timeout() if timeout else None))
            except Exception as exc:  # noqa: BLE001 - the plan says what it means
                outcome = (False, exc)
        step, done = _sent(plan, outcome)
    return step


async def carried_async(plan: Plan, timeout: Optional[Callable[[], float]] = None):
    """``carried`` for asyncio code."""
    step, done = next(plan), False
    while not done:
        if isinstance(step, float):
            await asyncio.sleep(step)
            outcome = None
        else:
            try:
                outcome = (True, await (asyncio.wait_for(step, timeout()) if timeout
                                        else step))
            except Exception as exc:  # noqa: BLE001 - the plan says what it means
                outcome = (False, exc)
        step, done = _sent(plan, outcome)
    return step


def _sent(plan: Plan, outcome) -> tuple:
    """``(the plan's next step, False)``, or ``(its value, True)`` once it has one."""
    try:
        return plan.send(outcome), False
    except StopIteration as finished:
        return finished.value, True
