"""Injectable clocks: integer microseconds so attribution sums exactly, and a fake one for tests."""

from __future__ import annotations

import os
import time
from typing import Protocol


class Clock(Protocol):
    """What the tracker reads time from: a wall clock to place attempts on one timeline, a monotonic one to measure."""

    def wall_us(self) -> int:
        """Microseconds since the Unix epoch (may jump; read once per attempt)."""
        ...

    def monotonic_us(self) -> int:
        """Microseconds from an arbitrary origin that never goes backwards."""
        ...

    def process_age_us(self) -> int:
        """How long this process has run, so `startup` can include interpreter boot and imports."""
        ...


class SystemClock:
    """The real clocks of this process."""

    def wall_us(self) -> int:
        """Microseconds since the epoch from time.time_ns."""
        return time.time_ns() // 1000

    def monotonic_us(self) -> int:
        """Microseconds from time.monotonic_ns."""
        return time.monotonic_ns() // 1000

    def process_age_us(self) -> int:
        """Age from /proc (Linux; clock-tick resolution, 10 ms); 0 where unavailable."""
        try:
            with open("/proc/self/stat") as f:
                start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime_s = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0
        return max(0, round((uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")) * 1e6))


class FakeClock:
    """A clock that moves only when told to, so tests can script timelines to the microsecond."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now_us = to_us(start)

    def wall_us(self) -> int:
        """The scripted time."""
        return self._now_us

    def monotonic_us(self) -> int:
        """The same scripted time (a fake clock never jumps)."""
        return self._now_us

    def process_age_us(self) -> int:
        """A scripted process starts when its tracker starts."""
        return 0

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds` (rounded to the microsecond)."""
        if seconds < 0:
            raise ValueError(f"FakeClock cannot go backwards (advance({seconds}))")
        self._now_us += to_us(seconds)

    def set(self, seconds: float) -> None:
        """Jump to an absolute wall time, e.g. the start of the next attempt after downtime."""
        us = to_us(seconds)
        if us < self._now_us:
            raise ValueError(f"FakeClock cannot go backwards (set({seconds}) < now)")
        self._now_us = us


def to_us(seconds: float) -> int:
    """Seconds to integer microseconds, rounded to nearest."""
    return round(seconds * 1_000_000)
