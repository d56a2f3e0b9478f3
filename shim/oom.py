"""Noticing that the kernel's OOM killer struck inside a container's memory cgroup.

cgroup v1: an eventfd registered through cgroup.event_control on memory.oom_control (the kernel
signals it on OOM and when the cgroup goes away). cgroup v2: memory.events' oom_kill counter,
polled. The cgroup is read from /proc/PID/cgroup of the container's init, so the shim follows
whatever layout quark chose.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from qlib import cgroupfs

log = logging.getLogger("quark.shim.oom")

CGROUP_ROOT = cgroupfs.CGROUP_ROOT
V2_POLL_S = 0.5


def memory_cgroup(pid: int) -> tuple[str, bool] | None:
    """(directory of pid's memory cgroup, is v2) or None when it cannot be told."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = cgroupfs.unified()
    for line in lines:
        _hid, controllers, path = line.split(":", 2)
        if v2 and controllers == "":
            # the v2 line; on a hybrid host it names the tree under unified/, which has no memory
            d = os.path.join(CGROUP_ROOT, path.lstrip("/"))
            return (d, True) if os.path.exists(os.path.join(d, "memory.events")) else None
        if not v2 and "memory" in controllers.split(","):
            return os.path.join(CGROUP_ROOT, "memory", path.lstrip("/")), False
    return None


class OomWatch:
    """The OOM kills of one container's memory cgroup, published one TaskOOM per kill, in order
    with the container's exit: the exit path flushes before it publishes TaskExit (a watcher thread
    woken late, on a busy host, published its OOM after the exit, even after the delete), and
    nothing is published once the container is deleted (close)."""

    def __init__(self, path: str, v2: bool, on_oom: Callable[[], None]) -> None:
        self.path, self.v2, self.on_oom = path, v2, on_oom
        self._lock = threading.Lock()
        self._closed = False
        self.seen = self.kills() or 0   # (a cgroup made for this container: none yet)

    def kills(self) -> int | None:
        """The cgroup's OOM kill counter (v2 memory.events, v1 memory.oom_control), None if gone."""
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name), encoding="ascii") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            return None
        return 0

    def flush(self) -> bool:
        """Publish the kills not published yet; False once the cgroup is gone."""
        with self._lock:
            if self._closed:
                return True
            now = self.kills()
            while now is not None and self.seen < now:
                self.seen += 1
                self.on_oom()
            return now is not None

    def close(self) -> None:
        with self._lock:
            self._closed = True


def watch(pid: int, on_oom: Callable[[], None], stop: threading.Event) -> OomWatch | None:
    """Call on_oom for each OOM kill in pid's memory cgroup, from a daemon thread, until stop;
    the OomWatch, whose flush() the exit path calls, or None when there is no memory cgroup."""
    found = memory_cgroup(pid)
    if found is None:
        log.debug("no memory cgroup for pid %d: OOM events off", pid)
        return None
    w = OomWatch(*found, on_oom)
    target = _watch_v2 if w.v2 else _watch_v1
    threading.Thread(target=target, args=(w, stop), daemon=True, name="oom").start()
    return w


def _watch_v1(w: OomWatch, stop: threading.Event) -> None:
    try:
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        ofd = os.open(os.path.join(w.path, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        with open(os.path.join(w.path, "cgroup.event_control"), "w", encoding="ascii") as f:
            f.write(f"{efd} {ofd}")
    except OSError as e:
        log.debug("cannot watch OOM in %s: %s", w.path, e)
        return
    try:
        while not stop.is_set():
            os.eventfd_read(efd)
            if stop.is_set() or not os.path.exists(os.path.join(w.path, "memory.oom_control")):
                return  # the cgroup was removed, which also signals the eventfd
            w.flush()
    finally:
        os.close(ofd)
        os.close(efd)


def _watch_v2(w: OomWatch, stop: threading.Event) -> None:
    while not stop.wait(V2_POLL_S) and w.flush():
        pass
