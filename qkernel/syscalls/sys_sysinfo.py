"""sysinfo(2) from the container's cgroup: runtimes that size heaps from totalram see the
container's memory limit, not the host's. The figures come from the sandbox context's `sysinfo`,
which the runtime fills from the container's /proc view (qvisor/procview.py) — memory and swap as
its /proc/meminfo, uptime as its /proc/uptime, procs its threads, loads its /proc/loadavg's while
the view is served — so that free(1), which reads both, adds up. The rest comes from the real sysinfo."""
from __future__ import annotations

from typing import TYPE_CHECKING

from qkernel.request import Request, Return
from qlib import linux as L
from qlib.linux import Sysinfo

if TYPE_CHECKING:   # kernel.py imports the handler table, which imports this module
    from qkernel.kernel import SysinfoFigures


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


def sandbox_sysinfo(figures: SysinfoFigures | None) -> Sysinfo:
    """The host's sysinfo in bytes (mem_unit 1) with the container's `figures` over it."""
    info = _in_bytes(L.sysinfo())
    if figures is None:
        return info
    host = {"MemTotal": info.totalram // 1024, "SwapTotal": info.totalswap // 1024, "SwapFree": info.freeswap // 1024}
    return _set(info, figures(host))


def handle(req: Request) -> Return:
    req.write(req.args[0], bytes(sandbox_sysinfo(req.context.sysinfo)))
    return Return(0)
