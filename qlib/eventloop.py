"""The single-threaded event loop of the supervisor (and of tests and tools that drive its parts).

The supervisor forks container processes at any time, so it stays single-threaded (a fork from a
threaded Python can inherit a held lock). Everything it waits on — the control socket, child exits,
seccomp listener fds, deferred syscall answers — is an fd registered here with a callback.
"""
from __future__ import annotations

import heapq
import itertools
import selectors
import time
from collections.abc import Callable

Callback = Callable[[], None]


class Loop:
    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._timers: list[tuple[float, int, Callback]] = []
        self._seq = itertools.count()
        self._stopped = False

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

    def stop(self) -> None:
        self._stopped = True

    def run(self) -> None:
        """Dispatch until stop() is called."""
        self._stopped = False
        while not self._stopped:
            self.run_once()

    def run_once(self, max_wait: float | None = None) -> None:
        timeout = max_wait
        if self._timers:
            due = max(0.0, self._timers[0][0] - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        events = self._sel.select(timeout) if self._sel.get_map() else (time.sleep(timeout or 0) or [])
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
