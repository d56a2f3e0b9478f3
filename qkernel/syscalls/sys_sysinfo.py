"""sysinfo(2) from the container's cgroup: runtimes that size heaps from totalram see the
container's memory limit, not the host's. Everything else comes from the real sysinfo."""
from __future__ import annotations

import ctypes

from qkernel.request import Request, Return

_libc = ctypes.CDLL(None, use_errno=True)


class Sysinfo(ctypes.Structure):
    _fields_ = [("uptime", ctypes.c_long), ("loads", ctypes.c_ulong * 3),
                ("totalram", ctypes.c_ulong), ("freeram", ctypes.c_ulong),
                ("sharedram", ctypes.c_ulong), ("bufferram", ctypes.c_ulong),
                ("totalswap", ctypes.c_ulong), ("freeswap", ctypes.c_ulong),
                ("procs", ctypes.c_ushort), ("pad", ctypes.c_ushort),
                ("totalhigh", ctypes.c_ulong), ("freehigh", ctypes.c_ulong),
                ("mem_unit", ctypes.c_uint)]


def host_sysinfo() -> Sysinfo:
    info = Sysinfo()
    if _libc.sysinfo(ctypes.byref(info)) != 0:
        raise OSError(ctypes.get_errno(), "sysinfo")
    return info


def container_sysinfo(limit: int | None, usage: int) -> Sysinfo:
    """The host's sysinfo in bytes (mem_unit 1), with RAM bounded by the cgroup's limit."""
    info = host_sysinfo()
    unit = info.mem_unit or 1
    for field in ("totalram", "freeram", "sharedram", "bufferram", "totalswap", "freeswap",
                  "totalhigh", "freehigh"):
        setattr(info, field, getattr(info, field) * unit)
    info.mem_unit = 1
    if limit is not None and limit < info.totalram:
        info.totalram = limit
        info.freeram = max(0, min(info.freeram, limit - usage))
        info.sharedram = min(info.sharedram, limit)
        info.bufferram = min(info.bufferram, limit)
    return info


def handle(req: Request) -> Return:
    cgroup = req.context.cgroup
    limit, usage = (cgroup.memory_limit(), cgroup.memory_usage()) if cgroup else (None, 0)
    req.write(req.args[0], bytes(container_sysinfo(limit, usage)))
    return Return(0)

