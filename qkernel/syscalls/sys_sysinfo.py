"""sysinfo(2) from the container's cgroup: runtimes that size heaps from totalram see the
container's memory limit, not the host's. The figures are those of the container's /proc view
(qvisor/procview.py) — memory and swap as its /proc/meminfo, uptime as its /proc/uptime, procs its
threads, loads its /proc/loadavg's while the view is served — so that free(1), which reads both,
adds up. The rest (and loads without a view) comes from the real sysinfo."""
from __future__ import annotations

import ctypes

from qkernel.request import Request, Return
from qvisor import procview

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


def _in_bytes(info: Sysinfo) -> Sysinfo:
    unit = info.mem_unit or 1
    for field in ("totalram", "freeram", "sharedram", "bufferram", "totalswap", "freeswap",
                  "totalhigh", "freehigh"):
        setattr(info, field, getattr(info, field) * unit)
    info.mem_unit = 1
    return info


def _set(info: Sysinfo, figures: dict) -> Sysinfo:
    for name, value in figures.items():
        if name == "loads":
            for i, load in enumerate(value):
                info.loads[i] = load
        else:
            setattr(info, name, value)
    return info


def container_sysinfo(limit: int | None, usage: int) -> Sysinfo:
    """The host's sysinfo in bytes (mem_unit 1), with the memory of a cgroup known only by its
    limit and usage, as its /proc/meminfo would show it."""
    with open("/proc/meminfo") as f:
        kb = procview.memory(procview.parse_meminfo(f.read()), limit, usage, {})
    return _set(_in_bytes(host_sysinfo()), {"totalram": kb["MemTotal"] * 1024, "freeram": kb["MemFree"] * 1024,
                                            "sharedram": kb["Shmem"] * 1024, "bufferram": kb["Buffers"] * 1024})


def sandbox_sysinfo(cgroup: object, init_pid: int) -> Sysinfo:
    """The host's sysinfo in bytes (mem_unit 1) with the container's figures (procview.sysinfo)."""
    info = _in_bytes(host_sysinfo())
    if cgroup is None:
        return info
    host = {"MemTotal": info.totalram // 1024, "SwapTotal": info.totalswap // 1024, "SwapFree": info.freeswap // 1024}
    return _set(info, procview.sysinfo(cgroup, init_pid, host))


def handle(req: Request) -> Return:
    req.write(req.args[0], bytes(sandbox_sysinfo(req.context.cgroup, req.context.init_pid)))
    return Return(0)
