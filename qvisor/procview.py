"""What a container sees of its own resources: /proc/meminfo, cpuinfo, stat, uptime, loadavg, swaps
and /sys/devices/system/cpu/online made from its cgroup (LXCFS's view for runc; gVisor's Sentry
answers the same), so that a program reading sysinfo(2) and /proc sees one machine, the container.

The supervisor serves these files over FUSE (qvisor/fuse.py, `serve`) and the container's init
binds them over the real ones (qvisor/rootfs_procview.py, attach_procview). A file is made at every read
from offset 0, from the host's file of the same name and the cgroup's numbers at that moment, so a
`quark update` shows at the next read. sysinfo(2) (qkernel/syscalls/sys_sysinfo.py) answers from
the same functions (`sysinfo`).

The text in, text out builders (no I/O) are in qvisor/procview_text.py (tests/unit/test_procview.py),
re-exported here; `Source` reads the host's files (the supervisor's /proc is the host's) and the
cgroup; `View` is the served view.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from qlib import procfs
from qlib.errors import QuarkError
from qvisor.procview_text import (
    ANNOTATION,
    FIXED_1,
    FSHIFT,
    LOAD_FREQ,
    SI_LOAD_SHIFT,
    SOURCE,
    TARGETS,
    UNLIMITED,
    LoadAvg,
    calc_load,
    memory,
    parse_meminfo,
    render_cpu_online,
    render_cpuinfo,
    render_loadavg,
    render_meminfo,
    render_stat,
    render_swaps,
    render_uptime,
    stat_cpus,
    uptime,
    visible_cpus,
)

__all__ = ["ANNOTATION", "FIXED_1", "FSHIFT", "LOAD_FREQ", "SI_LOAD_SHIFT", "SOURCE", "TARGETS", "UNLIMITED",
           "LoadAvg", "Source", "View", "calc_load", "memory", "parse_meminfo", "render_cpu_online",
           "render_cpuinfo", "render_loadavg", "render_meminfo", "render_stat", "render_swaps", "render_uptime",
           "serve", "stat_cpus", "sysinfo", "uptime", "visible_cpus"]


# ---- reading the host and the cgroup ---------------------------------------------------------------

def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _ask(cgroup: Any, method: str, default: Any) -> Any:
    """A cgroup read, or `default` when it fails (the cgroup is being removed, its controller is
    not mounted) or the cgroup object lacks it (QKernel's harness fakes only the memory figures)."""
    fn = getattr(cgroup, method, None)
    if fn is None:
        return default
    try:
        return fn()
    except (OSError, ValueError, LookupError, QuarkError):
        return default


_start_ticks: dict[int, int] = {}   # init pid -> its start time, in clock ticks after boot


def _started(pid: int) -> int:
    if pid not in _start_ticks:
        ticks = procfs.start_time(pid)
        if ticks is None:
            return 0   # gone: count from boot
        _start_ticks[pid] = ticks
    return _start_ticks[pid]


class Source:
    """Makes the view's files from the host's files and `cgroup`, anew at every call. `init_pid`:
    the container's init, whose start is the container's boot; `start_ticks`, when known, its start
    time in clock ticks after boot."""

    def __init__(self, cgroup: Any, init_pid: int, start_ticks: int = 0) -> None:
        self.cgroup, self.init_pid = cgroup, init_pid
        if start_ticks:
            _start_ticks[init_pid] = start_ticks

    def memory(self, host_text: str | None = None, host: dict[str, int] | None = None) -> dict[str, int]:
        """The container's meminfo figures (kB), from the host's meminfo text, or from `host`
        (MemTotal, SwapTotal, SwapFree: all sysinfo(2) needs), or else the host's /proc/meminfo."""
        if host is None:
            host = parse_meminfo(host_text if host_text is not None else _read("/proc/meminfo"))
        c = self.cgroup
        # without swap on the host there is none to ask the cgroup about (0: none in use)
        swapped = host.get("SwapTotal", 0) > 0
        return memory(host, _ask(c, "memory_limit", None), _ask(c, "memory_usage", 0) or 0,
                      _ask(c, "memory_stat", {}), _ask(c, "swap_limit", None) if swapped else None,
                      _ask(c, "swap_usage", None) if swapped else 0)

    def cpus(self, host_stat: str | None = None) -> list[int]:
        online = stat_cpus(host_stat if host_stat is not None else _read("/proc/stat"))
        return visible_cpus(online, _ask(self.cgroup, "cpuset_cpus", None), _ask(self.cgroup, "cpu_quota", None))

    def uptime(self, idle: bool = True) -> tuple[float, float]:
        host = float(_read("/proc/uptime").split()[0])
        busy = _ask(self.cgroup, "cpu_usage_ns", None) if idle else None
        return uptime(host, _started(self.init_pid) / os.sysconf("SC_CLK_TCK"), len(self.cpus()) if idle else 0,
                      None if busy is None else busy / 1e9)

    def threads(self) -> list[int] | None:
        return _ask(self.cgroup, "threads", None)

    def tasks(self) -> tuple[int, int, int, int]:
        """(running, uninterruptible, threads, last pid) of the cgroup now; the last pid as the
        container numbers it (its newest task's innermost pid)."""
        tids = self.threads() or []
        running = blocked = 0
        for tid in tids:
            try:
                with open(f"/proc/{tid}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue   # exited meanwhile
            state = data[data.rindex(b")") + 2:data.rindex(b")") + 3]
            running += state == b"R"
            blocked += state == b"D"
        return running, blocked, len(tids), _inner_pid(max(tids)) if tids else 0

    # the files
    def meminfo(self) -> str:
        text = _read("/proc/meminfo")
        return render_meminfo(text, self.memory(text))

    def swaps(self) -> str:
        return render_swaps(_read("/proc/swaps"), self.memory())

    def cpuinfo(self) -> str:
        return render_cpuinfo(_read("/proc/cpuinfo"), self.cpus())

    def stat(self) -> str:
        text = _read("/proc/stat")
        return render_stat(text, self.cpus(text))

    def cpu_online(self) -> str:
        return render_cpu_online(len(self.cpus()))

    def uptime_text(self) -> str:
        return render_uptime(*self.uptime())

    def loadavg(self, avenrun: list[int]) -> str:
        running, _, total, last = self.tasks()
        # the reader sleeps in its FUSE request while we look; the kernel's own file counts the
        # reader as running, so there is always one
        return render_loadavg(avenrun, max(1, running), max(1, total), last)


def _inner_pid(tid: int) -> int:
    try:
        nspid = procfs.status(tid).get("NSpid", "")
    except OSError:
        return 0
    return int(nspid.split()[-1]) if nspid else 0


# ---- the served view -------------------------------------------------------------------------------

_views: list[View] = []   # the views this supervisor serves: one per container (a pod's supervisor serves several)


def _view_of(cgroup: Any) -> View | None:
    return next((v for v in _views if v.source.cgroup is cgroup), None)


class View:
    """The FUSE server for one sandbox on the supervisor's loop, and its load average's sampling
    (a timer that runs only while the view exists)."""

    def __init__(self, loop: Any, source: Source, dev: int) -> None:
        from qvisor import fuse
        self.loop, self.source, self.dev = loop, source, dev
        self.loads = LoadAvg()
        makers: dict[str, Callable[[], str]] = {
            "meminfo": source.meminfo, "cpuinfo": source.cpuinfo, "stat": source.stat,
            "uptime": source.uptime_text, "loadavg": lambda: source.loadavg(self.loads.avenrun),
            "swaps": source.swaps, "cpu_online": source.cpu_online}
        self.server = fuse.Server(dev, {name: (lambda f=f: f().encode()) for name, f in makers.items()})
        loop.add_reader(dev, self._readable)
        loop.call_later(LOAD_FREQ, self._sample)

    def _readable(self) -> None:
        if not self.server.on_readable():
            self.close()

    def _sample(self) -> None:
        if self.dev < 0:
            return
        try:
            running, blocked, _, _ = self.source.tasks()
            self.loads.sample(running + blocked)
        except OSError:
            pass
        self.loop.call_later(LOAD_FREQ, self._sample)

    def close(self) -> None:
        """The filesystem is gone from every mount (or was never attached): stop serving."""
        if self.dev >= 0:
            self.loop.remove_reader(self.dev)
            os.close(self.dev)
            self.dev = -1
        if self in _views:
            _views.remove(self)


def serve(loop: Any, cgroup: Any, init_pid: int, start_ticks: int = 0) -> int:
    """Start serving the sandbox's view on `loop` and return it as a detached mount (an fd the
    caller sends to the container's init, which attaches it, and then closes). Raises OSError
    where FUSE is not available (no /dev/fuse, no fuse filesystem, not permitted)."""
    from qvisor import fuse
    dev = fuse.open_device()
    try:
        mnt = fuse.mount_detached(dev, SOURCE)
    except BaseException:
        os.close(dev)
        raise
    adopt(loop, cgroup, init_pid, start_ticks, dev)
    return mnt


def adopt(loop: Any, cgroup: Any, init_pid: int, start_ticks: int, dev: int, server: dict | None = None) -> None:
    """Serve the view on `dev` (ours from now on) on `loop`: made here (serve), or by the process
    that created a pod's container and handed it to us (`server`: the connection's state there,
    from handed_over)."""
    old = _view_of(cgroup)
    if old is not None:
        old.close()
    view = View(loop, Source(cgroup, init_pid, start_ticks), dev)
    if server:
        for name, value in server.items():
            setattr(view.server, name, value)
    _views.append(view)


def handed_over(cgroup: Any) -> tuple[int, dict] | None:
    """The view served for `cgroup`'s container, to go to the supervisor that serves the container
    from now on: its FUSE connection (no longer watched here) and that connection's state."""
    view = _view_of(cgroup)
    if view is None or view.dev < 0:
        return None
    view.loop.remove_reader(view.dev)
    _views.remove(view)
    server = view.server
    return view.dev, {"minor": server.minor, "mtime": server.mtime, "open": server.open, "next_fh": server.next_fh}


def sysinfo(cgroup: Any, init_pid: int, host: dict[str, int] | None = None) -> dict[str, Any]:
    """sysinfo(2)'s figures for the container, from what its view shows: memory and swap as its
    /proc/meminfo (bytes), uptime as its /proc/uptime (rounded up, as the kernel does), procs its
    threads, and loads its /proc/loadavg's when the view is served (else the caller keeps the
    host's: no sampling runs without a view). `host`: the host's MemTotal, SwapTotal and SwapFree
    in kB when the caller has them (from the real sysinfo: the same page counts meminfo shows)."""
    view = _view_of(cgroup)
    source = view.source if view else Source(cgroup, init_pid)
    kb = source.memory(host=host)
    up, _ = source.uptime(idle=False)
    out: dict[str, Any] = {
        "totalram": kb.get("MemTotal", 0) * 1024, "freeram": kb.get("MemFree", 0) * 1024,
        "sharedram": kb.get("Shmem", 0) * 1024, "bufferram": kb.get("Buffers", 0) * 1024,
        "totalswap": kb.get("SwapTotal", 0) * 1024, "freeswap": kb.get("SwapFree", 0) * 1024,
        "uptime": int(up) + (up > int(up))}
    threads = source.threads()
    if threads:
        out["procs"] = min(len(threads), 0xFFFF)
    if view is not None:
        out["loads"] = [a << (SI_LOAD_SHIFT - FSHIFT) for a in view.loads.avenrun]
    return out
