"""The /proc view's files as text in, text out, with no I/O (tests/unit/test_procview.py): the
container's meminfo and swaps from the host's and its cgroup's memory figures, stat and cpuinfo for
the CPUs it is shown, cpu online, uptime, and the kernel's load-average arithmetic. What reads the
host and the cgroup, and serves the files, is qvisor/procview.py.
"""
from __future__ import annotations

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
