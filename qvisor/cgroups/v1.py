"""cgroup v1: the container has one directory per mounted hierarchy.

Hierarchies come from /proc/self/mountinfo (never from assumed paths): each `cgroup`
mount with its controllers (comounts such as cpu,cpuacct map both names to one mount)
plus named hierarchies such as name=systemd, which only track processes.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from qlib import procfs
from qlib.errors import SetupError, Unsupported

if TYPE_CHECKING:   # the spec model is imported where resources are applied, not by every verb
    from ..spec import BlockIO, CpuResources, MemoryResources, NetworkResources, Resources
from . import stats
from .base import (
    KERNEL_MEMORY,
    RESOURCES,
    UNLIMITED,
    Cgroup,
    cpu_list,
    device_rule,
    hugetlb_writes,
    poll,
    rdma_line,
    read,
    read_int,
    read_kv,
    warn_ignored,
    write,
)

MEMSW = "memory.memsw.limit_in_bytes"
KMEM_TCP = "memory.kmem.tcp.limit_in_bytes"
Write = tuple[str, str, object, str]  # (controller, file, value, the linux.resources field it sets)


def hierarchies() -> dict[str, str]:
    """Map each mounted v1 controller (and "name=..." hierarchy) to its mount point."""
    with open("/proc/cgroups") as f:
        known = {line.split()[0] for line in f if not line.startswith("#")}
    found: dict[str, str] = {}
    for mnt in procfs.mountinfo():
        if mnt.fstype != "cgroup":
            continue
        for opt in mnt.super_options.split(","):
            if opt in known or opt.startswith("name="):
                found.setdefault(opt, mnt.mount_point)  # first mount wins over bind mounts
    return found


def _plan_cpu(cpu: CpuResources) -> list[Write]:
    # Period before quota (and before runtime): the kernel checks each against the current
    # period. 0 means unset, as in runc; cpu.idle's 0 is a value.
    plan: list[Write] = [("cpu", name, value, field) for name, value, field in (
        ("cpu.shares", cpu.shares, "cpu.shares"), ("cpu.cfs_period_us", cpu.period, "cpu.period"),
        ("cpu.cfs_quota_us", cpu.quota, "cpu.quota"),
        ("cpu.rt_period_us", cpu.realtime_period, "cpu.realtimePeriod"),
        ("cpu.rt_runtime_us", cpu.realtime_runtime, "cpu.realtimeRuntime")) if value]
    if cpu.burst is not None:   # after the quota it may not exceed (0 is a value)
        plan.append(("cpu", "cpu.cfs_burst_us", cpu.burst, "cpu.burst"))
    if cpu.idle is not None:
        plan.append(("cpu", "cpu.idle", cpu.idle, "cpu.idle"))
    plan += [("cpuset", name, value, field) for name, value, field in (
        ("cpuset.cpus", cpu.cpus, "cpu.cpus"), ("cpuset.mems", cpu.mems, "cpu.mems")) if value]
    return plan


def _plan_network(net: NetworkResources) -> list[Write]:
    plan: list[Write] = []
    if net.class_id is not None:
        plan.append(("net_cls", "net_cls.classid", net.class_id, "network.classID"))
    plan += [("net_prio", "net_prio.ifpriomap", f"{p.name} {p.priority}", f"network.priorities[{i}]")
             for i, p in enumerate(net.priorities)]
    return plan


class V1Cgroup(Cgroup):
    version = "v1"

    def __init__(self, path: str, mounts: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self.mounts = hierarchies() if mounts is None else mounts

    def dirs(self) -> list[str]:
        return [mp + self.path for mp in dict.fromkeys(self.mounts.values())]

    def _dir(self, controller: str, field: str = "") -> str:
        """The directory in `controller`'s hierarchy; a refusal naming `field` if none is mounted."""
        if controller not in self.mounts:
            where = f"{RESOURCES}.{field}: " if field else ""
            raise Unsupported(f"{where}the {controller} cgroup controller is not available on this host "
                              "(no cgroup v1 hierarchy has it mounted)")
        return self.mounts[controller] + self.path

    def _int(self, controller: str, name: str) -> int | None:
        return read_int(self._dir(controller), name) if controller in self.mounts else None

    def create(self) -> None:
        for d in self.dirs():
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise SetupError(f"cgroup: creating {d}: {e.strerror}") from e
        if "cpuset" in self.mounts:
            self._init_cpuset()

    def _init_cpuset(self) -> None:
        # A new cpuset cgroup starts with no cpus and mems, and nothing can join it until
        # they are set; copy each level's from its parent, top-down.
        d = self.mounts["cpuset"]
        for part in self.path.strip("/").split("/"):
            parent, d = d, os.path.join(d, part)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not read(d, name):
                    write(d, name, read(parent, name))

    def apply(self, r: Resources) -> None:
        """Write `r` into the cgroup. Every controller it needs is checked before the first
        write, so a refusal (a controller this host lacks, a v2-only field) changes nothing."""
        if r.unified:
            raise Unsupported(f"{RESOURCES}.unified: cannot use unified on cgroup v1")  # as runc
        plan = self._plan(r)
        for controller, _, _, field in plan:
            self._dir(controller, field)
        for controller, name, value, field in plan:
            write(self._dir(controller), name, value, field)

    def _plan(self, r: Resources) -> list[Write]:
        """(controller, file, value, linux.resources field) for each write, in runc's order."""
        plan = self._plan_memory(r.memory) if r.memory else []
        plan += _plan_cpu(r.cpu) if r.cpu else []
        if r.pids_limit:  # 0 means unset in OCI, negative means unlimited
            plan.append(("pids", "pids.max", "max" if r.pids_limit < 0 else r.pids_limit, "pids.limit"))
        plan += [("devices", "devices.allow" if rule.allow else "devices.deny", device_rule(rule), f"devices[{i}]")
                 for i, rule in enumerate(r.devices)]
        plan += self._plan_blkio(r.block_io) if r.block_io else []
        if r.hugepage_limits:
            d = self._dir("hugetlb", "hugepageLimits")
            plan += [("hugetlb", *w) for w in hugetlb_writes(d, r.hugepage_limits, ".limit_in_bytes")]
        plan += _plan_network(r.network) if r.network else []
        plan += [("rdma", "rdma.max", rdma_line(dev, lim), f"rdma.{dev}") for dev, lim in r.rdma.items()]
        return plan

    def _plan_memory(self, mem: MemoryResources) -> list[Write]:
        plan: list[Write] = []
        if mem.use_hierarchy is not None:  # first: it cannot change once the cgroup has children
            plan.append(("memory", "memory.use_hierarchy", int(mem.use_hierarchy), "memory.useHierarchy"))
        if mem.limit is not None:
            plan.append(("memory", "memory.limit_in_bytes", mem.limit, "memory.limit"))
        if mem.swap is not None:
            plan = self._plan_swap(mem, plan)
        if mem.reservation is not None:
            plan.append(("memory", "memory.soft_limit_in_bytes", mem.reservation, "memory.reservation"))
        if mem.kernel is not None:
            warn_ignored("memory.kernel", KERNEL_MEMORY)
        if mem.kernel_tcp is not None:
            if os.path.exists(os.path.join(self._dir("memory", "memory.kernelTCP"), KMEM_TCP)):
                plan.append(("memory", KMEM_TCP, mem.kernel_tcp, "memory.kernelTCP"))
            else:
                warn_ignored("memory.kernelTCP", f"this kernel has no {KMEM_TCP}")
        if mem.disable_oom_killer:
            plan.append(("memory", "memory.oom_control", 1, "memory.disableOOMKiller"))
        if mem.swappiness is not None:
            plan.append(("memory", "memory.swappiness", mem.swappiness, "memory.swappiness"))
        # checkBeforeUpdate asks for what v1 does anyway: the kernel refuses a limit below the usage.
        return plan

    def _plan_swap(self, mem: MemoryResources, plan: list[Write]) -> list[Write]:
        """`plan` with the memory+swap limit added, before or after the memory limit."""
        d = self._dir("memory", "memory.swap")
        if not os.path.exists(os.path.join(d, MEMSW)):
            if mem.swap == -1:  # no swap accounting: swap is unlimited already
                return plan
            raise Unsupported(f"{RESOURCES}.memory.swap: this host does not account swap "
                              f"(the kernel has no {MEMSW})")
        # memory+swap must never drop below the memory limit: when the new limit exceeds the
        # current memsw limit, raise memsw first.
        current = read_int(d, MEMSW) or 0
        first = mem.swap == -1 or (mem.limit is not None and (mem.limit == -1 or mem.limit > current))
        swap: Write = ("memory", MEMSW, mem.swap, "memory.swap")
        return [swap] + plan if first else plan + [swap]

    def _plan_blkio(self, b: BlockIO) -> list[Write]:
        # CFQ's weight files, or BFQ's where CFQ is gone (Linux 5.0+), as runc picks them
        d = self._dir("blkio", "blockIO")
        weight = "blkio.weight" if os.path.exists(os.path.join(d, "blkio.weight")) else "blkio.bfq.weight"
        plan: list[Write] = []
        if b.weight is not None:
            plan.append(("blkio", weight, b.weight, "blockIO.weight"))
        if b.leaf_weight is not None:
            plan.append(("blkio", "blkio.leaf_weight", b.leaf_weight, "blockIO.leafWeight"))
        for i, wd in enumerate(b.weight_device):
            where, dev = f"blockIO.weightDevice[{i}]", f"{wd.major}:{wd.minor}"
            if wd.weight is not None:
                plan.append(("blkio", weight + "_device", f"{dev} {wd.weight}", where + ".weight"))
            if wd.leaf_weight is not None:
                plan.append(("blkio", "blkio.leaf_weight_device", f"{dev} {wd.leaf_weight}", where + ".leafWeight"))
        from ..spec import THROTTLES
        for key, attr in THROTTLES.items():
            name = f"blkio.{attr.replace('throttle_', 'throttle.')}_device"  # blkio.throttle.read_bps_device
            plan += [("blkio", name, f"{t.major}:{t.minor} {t.rate}", f"blockIO.{key}[{i}]")
                     for i, t in enumerate(getattr(b, attr))]
        return plan

    def _freezer_state(self) -> str:
        return read(self._dir("freezer"), "freezer.state")

    def try_freeze(self) -> bool:
        # FREEZING can stall on a task mid-syscall; asking again retries the freeze.
        write(self._dir("freezer"), "freezer.state", "FROZEN")
        return self._freezer_state() == "FROZEN"

    def try_thaw(self) -> bool:
        write(self._dir("freezer"), "freezer.state", "THAWED")
        return self._freezer_state() == "THAWED"

    def frozen(self) -> bool:
        if "freezer" not in self.mounts or not os.path.isdir(self._dir("freezer")):
            return False   # no freezer, or the cgroup is already gone (delete --force)
        poll(lambda: self._freezer_state() != "FREEZING", "waiting for FREEZING to settle")
        return self._freezer_state() == "FROZEN"

    def memory_limit(self) -> int | None:
        limit = self._int("memory", "memory.limit_in_bytes")
        return None if limit is None or limit >= UNLIMITED else limit

    def memory_usage(self) -> int:
        return self._int("memory", "memory.usage_in_bytes") or 0

    def reclaim(self) -> None:
        # v1's only whole-cgroup reclaim: with tasks inside it reclaims what it can (page cache;
        # anonymous pages too where there is swap) and leaves the rest
        if "memory" in self.mounts:
            write(self._dir("memory"), "memory.force_empty", 0)

    def stats(self) -> dict:
        return stats.v1_stats({c: self._dir(c) for c in self.mounts})

    def oom_kills(self) -> int:
        return stats.v1_oom_kills(self._dir("memory")) if "memory" in self.mounts else 0

    def swap_limit(self) -> int | None:
        memsw = self._int("memory", MEMSW)   # memory+swap; absent without swap accounting
        if memsw is None or memsw >= UNLIMITED:
            return None
        memory = self.memory_limit()
        return memsw if memory is None else max(0, memsw - memory)

    def swap_usage(self) -> int | None:
        memsw = self._int("memory", "memory.memsw.usage_in_bytes")
        return None if memsw is None else max(0, memsw - self.memory_usage())

    def memory_stat(self) -> dict[str, int]:
        return read_kv(self._dir("memory"), "memory.stat") if "memory" in self.mounts else {}

    def cpuset_cpus(self) -> list[int] | None:
        if "cpuset" not in self.mounts:
            return None
        d = self._dir("cpuset")
        for name in ("cpuset.effective_cpus", "cpuset.cpus"):
            try:
                return cpu_list(read(d, name))
            except FileNotFoundError:
                continue
        return None

    def cpu_quota(self) -> tuple[int, int] | None:
        quota, period = self._int("cpu", "cpu.cfs_quota_us"), self._int("cpu", "cpu.cfs_period_us")
        return (quota, period) if quota is not None and quota > 0 and period else None

    def cpu_usage_ns(self) -> int | None:
        return self._int("cpuacct", "cpuacct.usage")

    def parent(self) -> V1Cgroup | None:
        up = os.path.dirname(self.path)
        return V1Cgroup(up, self.mounts) if up not in ("", "/") else None

    def threads(self) -> list[int]:
        # every hierarchy holds the same tasks (add_pid writes them all): one is enough
        top = next((self._dir(c) for c in ("pids", "cpu", "memory") if c in self.mounts), None) or \
            next(iter(self.dirs()), None)
        return self._threads_in(top, "tasks") if top else []
