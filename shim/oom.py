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


def watch(pid: int, on_oom: Callable[[], None], stop: threading.Event) -> None:
    """Call on_oom for each OOM kill in pid's memory cgroup, from a daemon thread, until stop."""
    found = memory_cgroup(pid)
    if found is None:
        log.debug("no memory cgroup for pid %d: OOM events off", pid)
        return
    path, v2 = found
    target = _watch_v2 if v2 else _watch_v1
    threading.Thread(target=target, args=(path, on_oom, stop), daemon=True, name="oom").start()


def _watch_v1(path: str, on_oom: Callable[[], None], stop: threading.Event) -> None:
    try:
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        ofd = os.open(os.path.join(path, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        with open(os.path.join(path, "cgroup.event_control"), "w", encoding="ascii") as f:
            f.write(f"{efd} {ofd}")
    except OSError as e:
        log.debug("cannot watch OOM in %s: %s", path, e)
        return
    try:
        while not stop.is_set():
            os.eventfd_read(efd)
            if stop.is_set() or not os.path.exists(os.path.join(path, "memory.oom_control")):
                return  # the cgroup was removed, which also signals the eventfd
            on_oom()
    finally:
        os.close(ofd)
        os.close(efd)


def _oom_kills_v2(path: str) -> int | None:
    try:
        with open(os.path.join(path, "memory.events"), encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except OSError:
        return None
    return 0


def _watch_v2(path: str, on_oom: Callable[[], None], stop: threading.Event) -> None:
    seen = _oom_kills_v2(path) or 0
    while not stop.wait(V2_POLL_S):
        now = _oom_kills_v2(path)
        if now is None:
            return
        if now > seen:
            seen = now
            on_oom()
