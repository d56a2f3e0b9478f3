"""The supervisor's event loop with QKernel's notification receiver beside it (qlib/eventloop.py)."""
from __future__ import annotations

import os
import threading
import time

from qlib.eventloop import Loop


def test_a_timer_added_from_another_thread_wakes_the_sleeping_loop():
    """The receiver thread defers answers and schedules their polls with call_later while the loop
    sleeps in select() with a long timeout: the loop must wake up for the new, earlier timer."""
    loop = Loop()
    r, w = os.pipe()   # the supervisor always waits on fds (control socket, pidfds, ...)
    loop.add_reader(r, lambda: None)
    loop.run_once(max_wait=0)   # the loop now knows its own thread
    ran = threading.Event()
    t = threading.Thread(target=lambda: (time.sleep(0.2), loop.call_later(0, ran.set)))
    t.start()
    start = time.monotonic()
    while not ran.is_set() and time.monotonic() - start < 10:
        loop.run_once(max_wait=5)
    t.join()
    assert ran.is_set() and time.monotonic() - start < 2
    for fd in (r, w):
        os.close(fd)


def test_loop_work_and_another_threads_work_never_overlap():
    """Callbacks run holding Loop.lock; the receiver holds it while it runs a handler."""
    loop = Loop()
    inside = []
    overlaps = []

    def work(who: str) -> None:
        inside.append(who)
        if len(inside) > 1:
            overlaps.append(tuple(inside))
        time.sleep(0.001)
        inside.remove(who)

    done = []

    def other() -> None:
        for _ in range(200):
            with loop.lock:
                work("receiver")
        done.append(True)

    def tick() -> None:
        work("loop")
        loop.call_later(0, tick)

    loop.call_later(0, tick)
    t = threading.Thread(target=other)
    t.start()
    while t.is_alive():
        loop.run_once(max_wait=0.01)
    assert done and not overlaps
