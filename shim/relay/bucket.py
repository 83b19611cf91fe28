"""A token bucket: how often the relay does something for a client before it says no."""

from __future__ import annotations

from collections.abc import Callable


class TokenBucket:
    """``burst`` at once, then ``rate`` a second."""

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.burst, self.rate, self.clock = float(burst), rate, clock
        self.tokens = self.burst
        self.time = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.time) * self.rate)
        self.time = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
