"""Hibernation: freeze the container, page its memory out, and wake
it again — on request (`quark snapshot create/restore`), on the first connection to any of its
listening sockets, and, with the idle annotation, by itself when it has been idle that long.

Wake-on-connect needs no help from the container: a frozen process's listening sockets still
complete TCP handshakes in the kernel, so a new connection waits in the accept queue. The
supervisor holds a duplicate of each listening socket (pidfd_getfd) and wakes the container when
one becomes readable; the container then accepts as if nothing happened. TSoR connections arrive
the same way (their doorbell is a real connection to the listener), so one mechanism serves plain
peers and TSoR's local and tcp paths.

The working set: from the second hibernation on, the pages each process holds in memory just
before it is paged out are those it touched since the last wake; the next wake asks the kernel to
read them back from swap in one batch (MADV_WILLNEED) before thawing.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass

from qlib import linux as L
from qlib import procfs
from qlib.errors import InvalidState, QuarkError
from qvisor import hibernate, pods
from qvisor.state import HIBERNATION_RECORD, RUNNING, now_rfc3339
from qvisor.supervisor.context import Container
from qvisor.supervisor.control import fail, reply

log = logging.getLogger("quark.supervisor")

IDLE_ANNOTATION = "io.quark.hibernate.idle-after"
IDLE_CPU_NS = 1_000_000   # less CPU than this (all the container's processes) in a check period is idle


@dataclass
class Record:
    since: str              # RFC 3339
    since_epoch: float
    warm_bytes: int         # the cgroup's memory just before
    held_bytes: int         # ... just after paging out
    swap: bool              # False: frozen only (no swap on the host)
    swap_full: bool         # the swap filled up while paging out: part of the memory stayed
    reason: str             # request | idle | ready (run --snapshot-when)
    prefetch_pages: int     # working-set pages the next wake reads back (0 before the second hibernation)
    hibernations: int       # so far, this one included
    wakes: int              # so far
    took_ms: float


def parse_duration(text: str, field: str = f"annotations.{IDLE_ANNOTATION}") -> float:
    """'30s', '500ms', '2m', '1h' or plain seconds -> seconds (> 0)."""
    t = text.strip().lower()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if t.endswith(suffix):
            t, mult = t[: -len(suffix)], scale
            break
    else:
        mult = 1.0
    try:
        value = float(t) * mult
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise QuarkError(f"{field}: {text!r} is not a duration (e.g. 30s, 500ms, 2m)")
    return value


class Hibernation:
    """Hibernate and wake the container: on request, on a connection, when idle."""

    def __init__(self, c: Container) -> None:
        self.c = c
        self.hibernation: Record | None = None
        self.hibernations = 0
        self.wakes = 0
        self.working_set: dict[int, hibernate.Ranges] = {}
        self.wake_watch: list[int] = []     # our duplicates of the container's listening sockets
        idle = c.spec.annotations.get(IDLE_ANNOTATION)   # checked by validate at create: it parses
        self.idle_after = parse_duration(idle) if idle else 0.0
        # idle is the pod's: a container of a pod waits until every container of it is quiet (the
        # pod's cgroup counts them all), so a pod hibernates as one, not a sidecar while its app works
        in_pod = any(c.spec.annotations.get(a) for a in pods.SANDBOX_ID)
        self.idle_cgroup = (c.cgroup.parent() if in_pod else None) or c.cgroup
        self._idle_gen = 0                 # bumped to cancel the pending idle check

    # ---- requests ------------------------------------------------------------------------------
    def op_hibernate(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        if self.hibernation is not None:
            return reply(conn, self._snapshot_info())   # hibernating twice: nothing more to do
        if self.c.state.status != RUNNING:
            return fail(conn, InvalidState(f"cannot hibernate a container in the {self.c.state.status} state"))
        if self.c.cgroup.frozen():
            return fail(conn, InvalidState("the container is paused: resume it, then hibernate it"))
        try:
            self._hibernate_now(str(msg.get("reason") or "request"))
        except (OSError, QuarkError) as e:
            return fail(conn, e if isinstance(e, QuarkError) else QuarkError(f"hibernate: {e.strerror or e}"))
        reply(conn, self._snapshot_info())

    def op_wake(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        if self.hibernation is None:
            return fail(conn, InvalidState(f"container {self.c.state.id!r} is not hibernated"))
        took = self._wake_now("request", prefetch=msg.get("prefetch", True))
        reply(conn, {"ok": True, "took_ms": took, "wakes": self.wakes})

    def op_info(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        reply(conn, self._snapshot_info())

    def _snapshot_info(self) -> dict:
        info: dict = {"hibernated": self.hibernation is not None, "hibernations": self.hibernations,
                      "wakes": self.wakes, "idle_after_s": self.idle_after or None}
        if self.hibernation is not None:
            info |= asdict(self.hibernation) | {"held_now_bytes": self.c.cgroup.memory_usage()}
        return info

    # ---- hibernate and wake --------------------------------------------------------------------
    def _hibernate_now(self, reason: str) -> None:
        t0 = time.monotonic()
        self._idle_gen += 1
        warm = self.c.cgroup.memory_usage()
        pids = self.c.cgroup.pids()
        # what it touched since the last wake (the first time: nothing to go by; its start-up's
        # pages are not what serving a request needs)
        self.working_set = hibernate.working_set(pids) if self.wakes else {}
        self.c.cgroup.freeze()
        swap_total, _ = hibernate.swap_bytes()
        try:
            if swap_total:
                # (when the swap fills up, what was written last stays in memory as swap cache:
                # the kernel reclaims anonymous memory only while swap has room)
                hibernate.page_out(pids)
        except BaseException:
            self.c.cgroup.thaw()   # a failed hibernation leaves the container running
            raise
        try:
            self.c.cgroup.reclaim()   # the page cache no process maps (and, with swap, anything left)
        except (OSError, QuarkError) as e:
            log.info("cgroup reclaim after page-out: %s", e)
        self.hibernations += 1
        _, swap_free = hibernate.swap_bytes()
        self.hibernation = Record(
            since=now_rfc3339(), since_epoch=time.time(), warm_bytes=warm, held_bytes=self.c.cgroup.memory_usage(),
            swap=bool(swap_total), swap_full=bool(swap_total) and swap_free <= swap_total // 20, reason=reason,
            prefetch_pages=hibernate.pages(self.working_set),
            hibernations=self.hibernations, wakes=self.wakes, took_ms=round((time.monotonic() - t0) * 1000, 2))
        self._save_record()
        self._watch_listeners()
        log.info("hibernated (%s): %d -> %d bytes in %.1f ms%s", reason, warm, self.hibernation.held_bytes,
                 self.hibernation.took_ms, "" if swap_total else " (no swap: frozen only)")

    def _wake_now(self, reason: str, prefetch: bool = True) -> float:
        t0 = time.monotonic()
        self._unwatch_listeners()
        if prefetch and self.working_set:
            hibernate.prefetch(self.working_set)
        self.c.cgroup.thaw()
        self.hibernation = None
        self.wakes += 1
        try:
            os.unlink(self.c.store.path(self.c.state.id, HIBERNATION_RECORD))
        except FileNotFoundError:
            pass
        took = round((time.monotonic() - t0) * 1000, 2)
        log.info("woke (%s) in %.1f ms", reason, took)
        self.schedule_idle_check()
        return took

    def over(self) -> None:
        """The container stopped: no wake will come."""
        self._idle_gen += 1
        self._unwatch_listeners()
        self.hibernation = None
        try:
            os.unlink(self.c.store.path(self.c.state.id, HIBERNATION_RECORD))
        except FileNotFoundError:
            pass

    def _save_record(self) -> None:
        path = self.c.store.path(self.c.state.id, HIBERNATION_RECORD)
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self.hibernation), f)
        os.rename(path + ".tmp", path)

    # ---- wake on connect -----------------------------------------------------------------------
    def _watch_listeners(self) -> None:
        inodes = {ino for _, ino in procfs.tcp_listeners(self.c.state.pid)}
        if not inodes:
            return
        seen: set[int] = set()
        for pid in self.c.cgroup.pids():
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                pidfd = L.pidfd_open(pid)
            except OSError:
                continue
            try:
                for name in fds:
                    try:
                        link = os.readlink(f"/proc/{pid}/fd/{name}")
                    except OSError:
                        continue
                    if not link.startswith("socket:["):
                        continue
                    ino = int(link[8:-1])
                    if ino in inodes and ino not in seen:
                        try:
                            dup = L.pidfd_getfd(pidfd, int(name))
                        except OSError:
                            continue
                        seen.add(ino)
                        self.wake_watch.append(dup)
                        self.c.loop.add_reader(dup, self._on_listener_readable)
            finally:
                os.close(pidfd)

    def _on_listener_readable(self) -> None:
        if self.hibernation is not None:
            self._wake_now("connection")

    def _unwatch_listeners(self) -> None:
        for fd in self.wake_watch:
            self.c.loop.remove_reader(fd)
            os.close(fd)
        self.wake_watch.clear()

    # ---- idle hibernation ----------------------------------------------------------------------
    def schedule_idle_check(self) -> None:
        if not self.idle_after or self.c.state.status != RUNNING:
            return
        self._idle_gen += 1
        gen = self._idle_gen
        period = min(max(self.idle_after / 5, 0.05), 5.0)
        state = {"cpu": self.idle_cgroup.cpu_usage_ns() or 0, "quiet_since": time.monotonic()}

        def check() -> None:
            if gen != self._idle_gen or self.hibernation is not None or self.c.state.status != RUNNING:
                return
            cpu = self.idle_cgroup.cpu_usage_ns() or 0
            now = time.monotonic()
            if cpu - state["cpu"] >= IDLE_CPU_NS:
                state["quiet_since"] = now
            state["cpu"] = cpu
            if now - state["quiet_since"] >= self.idle_after:
                if self.c.cgroup.frozen():   # paused by `quark pause`: not ours to hibernate
                    state["quiet_since"] = now
                else:
                    try:
                        return self._hibernate_now("idle")
                    except (OSError, QuarkError) as e:
                        log.warning("idle hibernation failed: %s", e)
                        state["quiet_since"] = now
            self.c.loop.call_later(period, check)
        self.c.loop.call_later(period, check)
