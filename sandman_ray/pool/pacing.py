"""Pacing of creates: a token bucket whose rate adapts to how the provider copes."""

import time
from typing import Callable


class AdaptiveTokenBucket:
    """At most ``burst`` creates at once, refilled at ``rate`` per second. A throttled
    or transient provider error halves the rate (down to ``min_rate``); each success
    grows it back by 10 %, never above ``max_rate``: a cluster that pushes back is
    asked less, a healthy one is asked at the configured rate."""

    def __init__(self, rate: float, burst: int, min_rate: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.max_rate = self.rate = float(rate)
        self.min_rate = min(min_rate, self.max_rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self) -> bool:
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def wait_s(self) -> float:
        """Seconds until the next token."""
        self._refill()
        return max(0.0, (1.0 - self.tokens) / self.rate)

    def back_off(self) -> None:
        self.rate = max(self.min_rate, self.rate / 2)
        self.tokens = min(self.tokens, 0.0)

    def succeeded(self) -> None:
        self.rate = min(self.max_rate, self.rate * 1.1)
