"""A cgroup's statistics in runc's `events --stats` layout (runc's types.Stats), from v1 or v2 files.

containerd's shim (shim/metrics.py) and `quark events` read this one layout, so both cgroup versions
give the same keys: cpu usage and throttling in nanoseconds, memory usage/swap with limit, max and
failcnt, memory.stat as "raw", pids, block I/O per device and operation, hugetlb per page size.
As runc does, a limit of "max" is reported as the largest u64, and v2's swap is reported as
memory+swap (v1's meaning), so a consumer sees the same numbers on either version.
"""
from __future__ import annotations

import os

from .base import read, read_int, read_kv

MAX_U64 = (1 << 64) - 1
_USER_HZ_NS = 10_000_000  # cpuacct.stat counts USER_HZ (100 Hz) ticks
_V1_BLKIO = {"ioServiceBytesRecursive": "io_service_bytes_recursive",
             "ioServicedRecursive": "io_serviced_recursive"}
_V2_IO = {"ioServiceBytesRecursive": (("rbytes", "Read"), ("wbytes", "Write")),
          "ioServicedRecursive": (("rios", "Read"), ("wios", "Write"))}


def _text(d: str, name: str) -> str:
    try:
        return read(d, name)
    except (FileNotFoundError, NotADirectoryError):
        return ""


def _limit(d: str, name: str) -> int:
    """A v2 limit file: "max" (or a missing file) is no limit, the largest u64 as runc reports it."""
    value = _text(d, name)
    return int(value) if value.isdigit() else MAX_U64


def _hugetlb_sizes(d: str) -> list[str]:
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted({n.split(".")[1] for n in names if n.startswith("hugetlb.") and n.count(".") >= 2})


def v2_stats(d: str) -> dict:
    """Statistics of the v2 cgroup directory `d`."""
    cpu = read_kv(d, "cpu.stat")
    mem_events = read_kv(d, "memory.events")
    usage = read_int(d, "memory.current") or 0
    limit = _limit(d, "memory.max")
    swap = {"usage": usage + (read_int(d, "memory.swap.current") or 0), "limit": _limit(d, "memory.swap.max"),
            "failcnt": read_kv(d, "memory.swap.events").get("max", 0)}
    if swap["limit"] != MAX_U64 and limit != MAX_U64:
        swap["limit"] += limit  # memory+swap, v1's meaning, as runc reports it
    raw = read_kv(d, "memory.stat")
    io: dict[str, list[dict]] = {key: [] for key in _V2_IO}
    for line in _text(d, "io.stat").splitlines():
        dev, *pairs = line.split()
        major, minor = map(int, dev.split(":"))
        values = dict(p.split("=", 1) for p in pairs)
        for key, ops in _V2_IO.items():
            io[key] += [{"major": major, "minor": minor, "op": op, "value": int(values.get(name, 0))}
                        for name, op in ops]
    return {
        "cpu": {"usage": {"total": cpu.get("usage_usec", 0) * 1000, "user": cpu.get("user_usec", 0) * 1000,
                          "kernel": cpu.get("system_usec", 0) * 1000},
                "throttling": {"periods": cpu.get("nr_periods", 0), "throttledPeriods": cpu.get("nr_throttled", 0),
                               "throttledTime": cpu.get("throttled_usec", 0) * 1000}},
        "memory": {"cache": raw.get("file", 0), "raw": raw, "swap": swap,
                   "usage": {"usage": usage, "limit": limit, "max": read_int(d, "memory.peak") or 0,  # 5.19+
                             "failcnt": mem_events.get("max", 0)}},
        "pids": {"current": read_int(d, "pids.current") or 0, "limit": read_int(d, "pids.max") or 0},
        "blkio": io,
        "hugetlb": {size: {"usage": read_int(d, f"hugetlb.{size}.current") or 0,
                           "failcnt": read_kv(d, f"hugetlb.{size}.events").get("max", 0)}
                    for size in _hugetlb_sizes(d)},
    }


def v2_oom_kills(d: str) -> int:
    return read_kv(d, "memory.events").get("oom_kill", 0)


def _v1_entry(d: str, prefix: str) -> dict:
    return {"usage": read_int(d, prefix + "usage_in_bytes") or 0, "max": read_int(d, prefix + "max_usage_in_bytes") or 0,
            "failcnt": read_int(d, prefix + "failcnt") or 0, "limit": read_int(d, prefix + "limit_in_bytes") or 0}


def v1_stats(dirs: dict[str, str]) -> dict:
    """Statistics of a v1 cgroup, `dirs` mapping each mounted controller to its directory."""
    cpuacct, memory = dirs.get("cpuacct", ""), dirs.get("memory", "")
    ticks = read_kv(cpuacct, "cpuacct.stat") if cpuacct else {}
    cpu = read_kv(dirs["cpu"], "cpu.stat") if "cpu" in dirs else {}
    raw = read_kv(memory, "memory.stat") if memory else {}
    blkio: dict[str, list[dict]] = {key: [] for key in _V1_BLKIO}
    for key, name in _V1_BLKIO.items():
        for line in _text(dirs.get("blkio", ""), f"blkio.throttle.{name}").splitlines():
            parts = line.split()
            if len(parts) == 3:  # the last line is "Total N"
                major, minor = map(int, parts[0].split(":"))
                blkio[key].append({"major": major, "minor": minor, "op": parts[1], "value": int(parts[2])})
    hugetlb = dirs.get("hugetlb", "")
    return {
        "cpu": {"usage": {"total": read_int(cpuacct, "cpuacct.usage") or 0 if cpuacct else 0,
                          "percpu": [int(n) for n in _text(cpuacct, "cpuacct.usage_percpu").split()] if cpuacct else [],
                          "user": ticks.get("user", 0) * _USER_HZ_NS, "kernel": ticks.get("system", 0) * _USER_HZ_NS},
                "throttling": {"periods": cpu.get("nr_periods", 0), "throttledPeriods": cpu.get("nr_throttled", 0),
                               "throttledTime": cpu.get("throttled_time", 0)}},
        "memory": {"cache": raw.get("cache", 0), "raw": raw,
                   "usage": _v1_entry(memory, "memory.") if memory else {},
                   "swap": _v1_entry(memory, "memory.memsw.") if memory else {},
                   "kernel": _v1_entry(memory, "memory.kmem.") if memory else {},
                   "kernelTCP": _v1_entry(memory, "memory.kmem.tcp.") if memory else {}},
        "pids": {"current": read_int(dirs["pids"], "pids.current") or 0 if "pids" in dirs else 0,
                 "limit": read_int(dirs["pids"], "pids.max") or 0 if "pids" in dirs else 0},
        "blkio": blkio,
        "hugetlb": {size: _v1_entry(hugetlb, f"hugetlb.{size}.") for size in _hugetlb_sizes(hugetlb)},
    }


def v1_oom_kills(memory_dir: str) -> int:
    return read_kv(memory_dir, "memory.oom_control").get("oom_kill", 0)  # kernel 4.13+

