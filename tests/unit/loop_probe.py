"""How long an event loop is held: a timer every 10 ms records the time between its firings."""
from __future__ import annotations

import time

from qlib.eventloop import Loop


def watch_loop(loop: Loop, every: float = 0.01) -> list[float]:
    """Start the timer on `loop`; the returned list fills with the gaps between firings, so its
    max() is the longest the loop was held (plus `every`)."""
    gaps: list[float] = []
    last = [time.monotonic()]

    def tick() -> None:
        now = time.monotonic()
        gaps.append(now - last[0])
        last[0] = now
        loop.call_later(every, tick)
    loop.call_later(every, tick)
    return gaps
