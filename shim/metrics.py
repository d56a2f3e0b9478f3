"""Turning `quark events --stats` data (runc's stats JSON) into the cgroup Metrics containerd decodes.

`ctr task metrics` and the CRI's stats read io.containerd.cgroups.v1.Metrics on a cgroup v1 host
and io.containerd.cgroups.v2.Metrics on a unified one.
"""
from __future__ import annotations

from google.protobuf import any_pb2

from qlib import cgroupfs
from shim.pb import cgroups_v1_pb2 as v1
from shim.pb import cgroups_v2_pb2 as v2

# runc's memory "raw" keys -> v1 MemoryStat fields, where the names differ
_V1_RAW_RENAMES = {"pgpgin": "pg_pg_in", "pgpgout": "pg_pg_out", "pgfault": "pg_fault",
                   "pgmajfault": "pg_maj_fault", "total_pgpgin": "total_pg_pg_in",
                   "total_pgpgout": "total_pg_pg_out", "total_pgfault": "total_pg_fault",
                   "total_pgmajfault": "total_pg_maj_fault"}


def unified_host() -> bool:
    return cgroupfs.unified()


def to_any(data: dict, unified: bool | None = None) -> any_pb2.Any:
    msg = to_v2(data) if (unified_host() if unified is None else unified) else to_v1(data)
    return any_pb2.Any(type_url=msg.DESCRIPTOR.full_name, value=msg.SerializeToString())


def _entry(cls, d: dict | None):
    d = d or {}
    return cls(limit=_u64(d.get("limit")), usage=_u64(d.get("usage")), max=_u64(d.get("max")),
               failcnt=_u64(d.get("failcnt")))


def _u64(v) -> int:
    """runc reports an unlimited value as max uint64 or omits it; protobuf wants 0..2**64-1."""
    try:
        return min(max(int(v or 0), 0), 2**64 - 1)
    except (TypeError, ValueError):
        return 0


def to_v1(data: dict) -> v1.Metrics:
    m = v1.Metrics()
    pids = data.get("pids") or {}
    m.pids.current = _u64(pids.get("current"))
    m.pids.limit = _u64(pids.get("limit"))
    cpu = data.get("cpu") or {}
    usage = cpu.get("usage") or {}
    m.cpu.usage.total = _u64(usage.get("total"))
    m.cpu.usage.kernel = _u64(usage.get("kernel"))
    m.cpu.usage.user = _u64(usage.get("user"))
    m.cpu.usage.per_cpu.extend(_u64(x) for x in usage.get("percpu") or [])
    thr = cpu.get("throttling") or {}
    m.cpu.throttling.periods = _u64(thr.get("periods"))
    m.cpu.throttling.throttled_periods = _u64(thr.get("throttledPeriods"))
    m.cpu.throttling.throttled_time = _u64(thr.get("throttledTime"))
    mem = data.get("memory") or {}
    m.memory.cache = _u64(mem.get("cache"))
    m.memory.usage.CopyFrom(_entry(v1.MemoryEntry, mem.get("usage")))
    m.memory.swap.CopyFrom(_entry(v1.MemoryEntry, mem.get("swap")))
    m.memory.kernel.CopyFrom(_entry(v1.MemoryEntry, mem.get("kernel")))
    m.memory.kernel_tcp.CopyFrom(_entry(v1.MemoryEntry, mem.get("kernelTCP")))
    fields = v1.MemoryStat.DESCRIPTOR.fields_by_name
    for key, value in (mem.get("raw") or {}).items():
        name = _V1_RAW_RENAMES.get(key, key)
        if name in fields and fields[name].type == fields[name].TYPE_UINT64:
            setattr(m.memory, name, _u64(value))
    return m


def to_v2(data: dict) -> v2.Metrics:
    m = v2.Metrics()
    pids = data.get("pids") or {}
    m.pids.current = _u64(pids.get("current"))
    m.pids.limit = _u64(pids.get("limit"))
    usage = (data.get("cpu") or {}).get("usage") or {}
    m.cpu.usage_usec = _u64(usage.get("total")) // 1000
    m.cpu.user_usec = _u64(usage.get("user")) // 1000
    m.cpu.system_usec = _u64(usage.get("kernel")) // 1000
    thr = (data.get("cpu") or {}).get("throttling") or {}
    m.cpu.nr_periods = _u64(thr.get("periods"))
    m.cpu.nr_throttled = _u64(thr.get("throttledPeriods"))
    m.cpu.throttled_usec = _u64(thr.get("throttledTime")) // 1000
    mem = data.get("memory") or {}
    m.memory.usage = _u64((mem.get("usage") or {}).get("usage"))
    m.memory.usage_limit = _u64((mem.get("usage") or {}).get("limit"))
    m.memory.swap_usage = _u64((mem.get("swap") or {}).get("usage"))
    m.memory.swap_limit = _u64((mem.get("swap") or {}).get("limit"))
    fields = v2.MemoryStat.DESCRIPTOR.fields_by_name
    for key, value in (mem.get("raw") or {}).items():
        if key in fields and key not in ("usage", "usage_limit", "swap_usage", "swap_limit"):
            setattr(m.memory, key, _u64(value))
    return m
