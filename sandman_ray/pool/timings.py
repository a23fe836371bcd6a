"""What the pool's loop spends on each of its steps, for ``status`` (plain code, no
Ray: the reconciler keeps it)."""

import collections
import contextlib
import time
from typing import Dict


class LoopTimes:
    """How long the pool's loop spends in each of its steps (a tick, a sweep): the last
    ``keep`` durations of each, for ``status``."""

    def __init__(self, keep: int = 1000):
        self.keep = keep
        self.times: Dict[str, collections.deque] = {}

    @contextlib.contextmanager
    def timed(self, step: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            times = self.times.get(step)
            if times is None:
                times = self.times[step] = collections.deque(maxlen=self.keep)
            times.append(time.perf_counter() - start)

    def summary(self) -> Dict[str, dict]:
        """Per step: how many were kept, and their p50, p99 and max in ms."""
        out = {}
        for step, times in self.times.items():
            ordered = sorted(times)
            at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
            out[step] = {"n": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99),
                         "max_ms": ordered[-1] * 1e3}
        return out
