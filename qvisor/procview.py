"""What a container sees of its own resources: /proc/meminfo, cpuinfo, stat, uptime, loadavg, swaps
and /sys/devices/system/cpu/online made from its cgroup (LXCFS's view for runc; gVisor's Sentry
answers the same), so that a program reading sysinfo(2) and /proc sees one machine, the container.

The supervisor serves these files over FUSE (qvisor/fuse.py, `serve`) and the container's init
binds them over the real ones (qvisor/rootfs.py, attach_procview). A file is made at every read
from offset 0, from the host's file of the same name and the cgroup's numbers at that moment, so a
`quark update` shows at the next read. sysinfo(2) (qkernel/syscalls/sys_sysinfo.py) answers from
the same functions (`sysinfo`).

The first half is text in, text out, with no I/O (tests/unit/test_procview.py); `Source` reads the
host's files (the supervisor's /proc is the host's) and the cgroup; `View` is the served view.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from qlib import procfs
from qlib.errors import QuarkError

# fuse file name -> the path in the container it is bound over
TARGETS = {"meminfo": "/proc/meminfo", "cpuinfo": "/proc/cpuinfo", "stat": "/proc/stat", "uptime": "/proc/uptime",
           "loadavg": "/proc/loadavg", "swaps": "/proc/swaps", "cpu_online": "/sys/devices/system/cpu/online"}
ANNOTATION = "io.quark.procview"   # "false": no view for this container
SOURCE = "quark-procview"          # the filesystem's name in the container's mountinfo
UNLIMITED = 1 << 62                # as qvisor.cgroups: v1 reports "no limit" as a huge number

# memory.stat keys for a meminfo line: v1 hierarchical, v1 local, v2 (bytes); the first found wins
_STAT = {
    "Cached": ("total_cache", "cache", "file"), "Shmem": ("total_shmem", "shmem"),
    "Active(anon)": ("total_active_anon", "active_anon"), "Inactive(anon)": ("total_inactive_anon", "inactive_anon"),
    "Active(file)": ("total_active_file", "active_file"), "Inactive(file)": ("total_inactive_file", "inactive_file"),
    "Unevictable": ("total_unevictable", "unevictable"), "AnonPages": ("total_rss", "rss", "anon"),
    "Mapped": ("total_mapped_file", "mapped_file", "file_mapped"), "Dirty": ("total_dirty", "dirty", "file_dirty"),
    "Writeback": ("total_writeback", "writeback", "file_writeback"), "AnonHugePages": ("total_rss_huge", "anon_thp"),
    "SReclaimable": ("slab_reclaimable",), "SUnreclaim": ("slab_unreclaimable",),
    "KernelStack": ("kernel_stack",), "PageTables": ("pagetables",),
}
_NOT_CLAMPED = ("SwapTotal", "SwapFree", "Hugepagesize")   # not amounts of the container's RAM

# the kernel's load average (kernel/sched/loadavg.c): fixed point, sampled every 5 s
FSHIFT = 11
FIXED_1 = 1 << FSHIFT
_EXP = (1884, 2014, 2037)          # 1/exp(5s/1min), 1/exp(5s/5min), 1/exp(5s/15min) in fixed point
SI_LOAD_SHIFT = 16                 # sysinfo(2)'s loads
LOAD_FREQ = 5.0


# ---- memory --------------------------------------------------------------------------------------

def parse_meminfo(text: str) -> dict[str, int]:
    """The "kB" lines of a /proc/meminfo (HugePages_* are counts: left out)."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and rest.endswith(" kB"):
            kb[name] = int(rest[:-3])
    return kb


def memory(host: dict[str, int], limit: int | None, usage: int, stat: dict[str, int],
           swap_limit: int | None = None, swap_usage: int | None = None) -> dict[str, int]:
    """The container's meminfo figures in kB, from the host's (parse_meminfo) and its cgroup's:
    MemTotal is the lower of the host's RAM and the limit, MemFree what the cgroup has not charged
    (page cache included, as the kernel's MemFree excludes it), Cached its page cache, and the
    rest from memory.stat, as LXCFS makes them. Every figure stays within MemTotal, and MemFree +
    Cached + SReclaimable never exceed it, so free(1)'s "used" is never negative. Swap: the
    cgroup's swap limit within the host's swap; the host's figures where swap is not accounted."""
    kb = dict(host)
    total = host.get("MemTotal", 0)
    for lim in (limit, stat.get("hierarchical_memory_limit")):
        if lim is not None and 0 <= lim < UNLIMITED:
            total = min(total, lim // 1024)
    used = min(usage // 1024, total)
    for line, keys in _STAT.items():
        kb[line] = next((stat[k] for k in keys if k in stat), 0) // 1024
    cached = min(kb["Cached"], used)
    reclaimable = min(kb["SReclaimable"], used - cached)
    free = total - used
    kb.update(MemTotal=total, MemFree=free, MemAvailable=min(total, free + cached + reclaimable), Buffers=0,
              Cached=cached, SwapCached=0, SReclaimable=reclaimable, Shmem=min(kb["Shmem"], cached))
    kb["Slab"] = reclaimable + kb["SUnreclaim"]
    if swap_usage is not None:
        swap = host.get("SwapTotal", 0)
        if swap_limit is not None:
            swap = min(swap, swap_limit // 1024)
        kb.update(SwapTotal=swap, SwapFree=max(0, swap - swap_usage // 1024))
    for name, value in kb.items():
        if name not in _NOT_CLAMPED:
            kb[name] = max(0, min(value, total))
    return kb


def render_meminfo(host_text: str, kb: dict[str, int]) -> str:
    """The host's /proc/meminfo with each kB figure replaced by the container's, in its layout."""
    out = []
    for line in host_text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and rest.endswith(" kB") and name in kb:
            out.append(f"{name}:{kb[name]:>{len(rest) - 3}} kB")
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def render_swaps(host_text: str, kb: dict[str, int]) -> str:
    """/proc/swaps agreeing with meminfo's SwapTotal/SwapFree: the header, and one line for the
    container's swap when it has any (LXCFS's "none virtual")."""
    header = host_text.splitlines()[0] if host_text else "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"
    total = kb.get("SwapTotal", 0)
    if not total:
        return header + "\n"
    used = total - kb.get("SwapFree", 0)
    def col(n: int) -> str:   # the kernel's rule: a number under 8 digits gets a second tab
        return f"{n}\t\t" if n < 10000000 else f"{n}\t"
    return f"{header}\nnone{' ' * 36}virtual\t{col(total)}{col(used)}0\n"


# ---- CPUs --------------------------------------------------------------------------------------

def stat_cpus(host_stat: str) -> list[int]:
    """The online CPUs: those with a line in /proc/stat."""
    return [int(line.split()[0][3:]) for line in host_stat.splitlines() if line.startswith("cpu") and line[3:4].isdigit()]


def visible_cpus(online: list[int], cpuset: list[int] | None, quota: tuple[int, int] | None) -> list[int]:
    """The CPUs the container is shown: its cpuset's online CPUs, and no more than its CPU quota
    rounds up to (quota 150000 per 100000: two), as LXCFS does. Never none."""
    present = set(online)
    cpus = [c for c in (online if cpuset is None else cpuset) if c in present] or list(online)
    if quota is not None and quota[0] > 0 and quota[1] > 0:
        cpus = cpus[:max(1, -(-quota[0] // quota[1]))]
    return cpus


def render_stat(host_text: str, cpus: list[int]) -> str:
    """/proc/stat with the per-CPU lines of `cpus` only, renumbered from 0, and the "cpu" line their
    sum; every other line is the host's."""
    per = {}
    for line in host_text.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *values = line.split()
            per[int(name[3:])] = values
    chosen = [per[c] for c in cpus if c in per]
    width = min((len(v) for v in chosen), default=0)
    total = [sum(int(v[i]) for v in chosen) for i in range(width)]
    out, listed = [], False
    for line in host_text.splitlines():
        if line.startswith("cpu "):
            out.append("cpu  " + " ".join(map(str, total)))
        elif line.startswith("cpu") and line[3:4].isdigit():
            if not listed:
                out += [f"cpu{i} " + " ".join(v) for i, v in enumerate(chosen)]
                listed = True
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _processor(block: str) -> int | None:
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "processor":
            try:
                return int(value)
            except ValueError:
                return None   # s390's "processor 0: version = ..." layout: not per-CPU blocks
    return None


def render_cpuinfo(host_text: str, cpus: list[int]) -> str:
    """/proc/cpuinfo with the blocks of `cpus` only, their "processor" renumbered from 0. A layout
    without per-CPU "processor" blocks is left as the host's."""
    wanted, out, n = set(cpus), [], 0
    for block in host_text.split("\n\n"):
        cpu = _processor(block)
        if cpu is None:
            out.append(block)
            continue
        if cpu not in wanted:
            continue
        lines = block.split("\n")
        for i, line in enumerate(lines):
            key, sep, _ = line.partition(":")
            if sep and key.strip() == "processor":
                lines[i] = f"{key}: {n}"
                break
        out.append("\n".join(lines))
        n += 1
    return "\n\n".join(out) if n else host_text


def render_cpu_online(n: int) -> str:
    """/sys/devices/system/cpu/online for n CPUs (glibc's get_nprocs reads it first)."""
    return "0\n" if n <= 1 else f"0-{n - 1}\n"


# ---- uptime and load -----------------------------------------------------------------------------

def uptime(host_uptime: float, started: float, ncpus: int, busy: float | None) -> tuple[float, float]:
    """(uptime, idle) in seconds since the container's init started (`started`, seconds after boot);
    idle is the time its CPUs spent not running the container (ncpus x uptime - CPU time used)."""
    up = max(0.0, host_uptime - started)
    return up, (0.0 if busy is None else max(0.0, up * ncpus - busy))


def _centis(seconds: float) -> str:
    c = int(seconds * 100)
    return f"{c // 100}.{c % 100:02d}"


def render_uptime(up: float, idle: float) -> str:
    return f"{_centis(up)} {_centis(idle)}\n"


def calc_load(load: int, exp: int, active: int) -> int:
    """One step of the kernel's exponentially-decaying average (fixed point, FSHIFT bits)."""
    new = load * exp + active * (FIXED_1 - exp)
    if active >= load:
        new += FIXED_1 - 1
    return new // FIXED_1


class LoadAvg:
    """The container's 1, 5 and 15 minute load averages, as the kernel keeps the host's: one sample
    of its runnable + uninterruptible tasks every LOAD_FREQ seconds."""

    def __init__(self) -> None:
        self.avenrun = [0, 0, 0]

    def sample(self, active: int) -> None:
        self.avenrun = [calc_load(load, exp, active * FIXED_1) for load, exp in zip(self.avenrun, _EXP)]


def render_loadavg(avenrun: list[int], running: int, total: int, last_pid: int) -> str:
    def fmt(x: int) -> str:
        x += FIXED_1 // 200   # the kernel rounds to the printed hundredth
        return f"{x >> FSHIFT}.{((x & (FIXED_1 - 1)) * 100) >> FSHIFT:02d}"
    return f"{' '.join(fmt(a) for a in avenrun)} {running}/{total} {last_pid}\n"


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
        from qvisor.linux import proc_start_time
        ticks = proc_start_time(pid)
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

_view: View | None = None   # the view this supervisor serves (a supervisor serves one sandbox)


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
        global _view
        if self.dev >= 0:
            self.loop.remove_reader(self.dev)
            os.close(self.dev)
            self.dev = -1
        if _view is self:
            _view = None


def serve(loop: Any, cgroup: Any, init_pid: int, start_ticks: int = 0) -> int:
    """Start serving the sandbox's view on `loop` and return it as a detached mount (an fd the
    caller sends to the container's init, which attaches it, and then closes). Raises OSError
    where FUSE is not available (no /dev/fuse, no fuse filesystem, not permitted)."""
    global _view
    from qvisor import fuse
    dev = fuse.open_device()
    try:
        mnt = fuse.mount_detached(dev, SOURCE)
    except BaseException:
        os.close(dev)
        raise
    if _view is not None:
        _view.close()
    _view = View(loop, Source(cgroup, init_pid, start_ticks), dev)
    return mnt


def sysinfo(cgroup: Any, init_pid: int, host: dict[str, int] | None = None) -> dict[str, Any]:
    """sysinfo(2)'s figures for the container, from what its view shows: memory and swap as its
    /proc/meminfo (bytes), uptime as its /proc/uptime (rounded up, as the kernel does), procs its
    threads, and loads its /proc/loadavg's when the view is served (else the caller keeps the
    host's: no sampling runs without a view). `host`: the host's MemTotal, SwapTotal and SwapFree
    in kB when the caller has them (from the real sysinfo: the same page counts meminfo shows)."""
    view = _view if _view is not None and _view.source.cgroup is cgroup else None
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
