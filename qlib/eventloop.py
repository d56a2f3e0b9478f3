"""The event loop of the supervisor (and of tests and tools that drive its parts).

Everything the supervisor waits on — the control socket, child exits, deferred syscall answers — is
an fd registered here with a callback. One other thread may do loop work: QKernel's seccomp
notification receiver (qkernel/seccomp_platform.py) blocks in the listener's RECV ioctl, because
only a direct waiter gets the kernel's same-CPU hand-off (an epoll waiter is woken across CPUs,
which made a trap several times slower: bench/README.md, "Syscall interception"). Both run their
work holding `Loop.lock`, so callbacks and trapped-syscall handlers never run at the same time and
the code they share stays single-threaded in effect. The supervisor forks while holding the lock
(in a callback), when the other thread holds nothing but is blocked in the kernel or waits for the
lock, so a child never inherits a lock held mid-update.
"""
from __future__ import annotations

import heapq
import itertools
import os
import selectors
import threading
import time
from collections.abc import Callable

Callback = Callable[[], None]


class Loop:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callback]] = []
        self._seq = itertools.count()
        self._stopped = False
        self.lock = threading.RLock()
        self._owner: int | None = None     # the thread that runs the loop
        self._wake_fd: int | None = None   # an eventfd: another thread added a timer

    def add_reader(self, fd: int, callback: Callback) -> None:
        """Call `callback()` whenever fd is readable (level-triggered)."""
        self._modify(fd, selectors.EVENT_READ, callback, 0)

    def add_writer(self, fd: int, callback: Callback) -> None:
        self._modify(fd, selectors.EVENT_WRITE, callback, 1)

    def has_reader(self, fd: int) -> bool:
        try:
            return self._sel.get_key(fd).data[0] is not None
        except KeyError:
            return False

    def remove_reader(self, fd: int) -> None:
        self._drop(fd, selectors.EVENT_READ, 0)

    def remove_writer(self, fd: int) -> None:
        self._drop(fd, selectors.EVENT_WRITE, 1)

    def call_later(self, delay: float, callback: Callback) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), callback))
        if self._owner is not None and threading.get_ident() != self._owner:
            self._wake()   # the loop may be asleep with a longer timeout

    def _wake(self) -> None:
        if self._wake_fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.add_reader(fd, lambda: os.eventfd_read(fd))
            self._wake_fd = fd
        os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        self._stopped = True

    def run(self) -> None:
        """Dispatch until stop() is called."""
        self._stopped = False
        while not self._stopped:
            self.run_once()

    def run_once(self, max_wait: float | None = None) -> None:
        self._owner = threading.get_ident()
        timeout = max_wait
        if self._timers:
            due = max(0.0, self._timers[0][0] - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        events = self._sel.select(timeout) if self._sel.get_map() else (time.sleep(timeout or 0) or [])
        with self.lock:
            self._dispatch(events)

    def _dispatch(self, events: list) -> None:
        for key, mask in events:
            read_cb, write_cb = key.data
            if mask & selectors.EVENT_READ and read_cb is not None:
                read_cb()
            if mask & selectors.EVENT_WRITE and write_cb is not None and key.fd in self._sel.get_map():
                cur = self._sel.get_key(key.fd).data[1]
                if cur is not None:
                    cur()
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, cb = heapq.heappop(self._timers)
            cb()

    def _modify(self, fd: int, event: int, callback: Callback, slot: int) -> None:
        try:
            key = self._sel.get_key(fd)
        except KeyError:
            data = [None, None]
            data[slot] = callback
            self._sel.register(fd, event, tuple(data))
            return
        data = list(key.data)
        data[slot] = callback
        self._sel.modify(fd, key.events | event, tuple(data))

    def _drop(self, fd: int, event: int, slot: int) -> None:
        try:
            key = self._sel.get_key(fd)
        except KeyError:
            return
        data = list(key.data)
        data[slot] = None
        events = key.events & ~event
        if events:
            self._sel.modify(fd, events, tuple(data))
        else:
            self._sel.unregister(fd)
