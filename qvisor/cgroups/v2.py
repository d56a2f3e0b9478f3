"""cgroup v2: the container has one directory in the unified hierarchy.

Controllers must be enabled in every ancestor's cgroup.subtree_control before their files
appear in the container's cgroup, and the OCI v1-style values are converted the way runc
converts them (shares to weight, quota/period to cpu.max, memory+swap to swap alone).
"""
from __future__ import annotations

import errno
import os
import signal
from typing import TYPE_CHECKING, Iterator

from qlib.errors import SetupError, Unsupported

if TYPE_CHECKING:   # the spec model is imported where resources are applied, not by every verb
    from ..spec import BlockIO, CpuResources, MemoryResources, Resources
from . import bpf, devicefilter, stats
from .base import (
    CGROUP_ROOT,
    KERNEL_MEMORY,
    RESOURCES,
    Cgroup,
    cpu_list,
    hugetlb_writes,
    rdma_line,
    read,
    read_int,
    read_kv,
    warn_ignored,
    write,
)

# enabled in every ancestor, so that their files appear in the container's cgroup
CONTROLLERS = ("cpu", "cpuset", "memory", "pids", "io", "hugetlb", "rdma", "misc")
Write = tuple[str, object, str]  # (file, value, the linux.resources field it sets)


def shares_to_weight(shares: int) -> int:
    """cpu.shares [2, 262144] to cpu.weight [1, 10000], as runc does; 0 means unset."""
    if not shares:
        return 0
    shares = min(max(shares, 2), 262144)
    return 1 + ((shares - 2) * 9999) // 262142


def cpu_max(quota: int | None, period: int | None) -> str | None:
    """The cpu.max line "quota period" ("max" when quota is unset or negative)."""
    if not quota and not period:
        return None
    return f"{quota if quota and quota > 0 else 'max'} {period or 100000}"


def swap_max(swap: int | None, limit: int | None) -> str | None:
    """OCI swap is memory+swap; v2's memory.swap.max counts swap alone."""
    if not swap:
        return None
    if swap == -1:
        return "max"
    if limit is None or limit <= 0:
        raise SetupError(f"{RESOURCES}.memory.swap: a swap limit needs a memory limit")
    if swap < limit:
        raise SetupError(f"{RESOURCES}.memory.swap: memory+swap {swap} is below memory {limit}")
    return str(swap - limit)


def blkio_to_io_weight(weight: int) -> int:
    """blkio weight [10, 1000] to io.weight [1, 10000], as runc converts it."""
    return 1 + (weight - 10) * 9999 // 990


def _per_device_weights(d: str) -> bool:
    # A kernel whose io.bfq.weight takes "MAJ:MIN WEIGHT" shows "default N" lines; an older
    # one shows a single number (runc's bfqDeviceWeightSupported).
    return not read(d, "io.bfq.weight").isdigit()


def _plan_cpu(cpu: CpuResources) -> list[Write]:
    if cpu.realtime_runtime or cpu.realtime_period:
        field = "realtimeRuntime" if cpu.realtime_runtime else "realtimePeriod"
        raise Unsupported(f"{RESOURCES}.cpu.{field}: cgroup v2 has no real-time group scheduling")
    writes: list[Write] = []
    if cpu.idle is not None:
        writes.append(("cpu.idle", cpu.idle, "cpu.idle"))
    writes += [(name, value, field) for name, value, field in (
        ("cpu.weight", shares_to_weight(cpu.shares or 0), "cpu.shares"),
        ("cpu.max", cpu_max(cpu.quota, cpu.period), "cpu.quota" if cpu.quota else "cpu.period"),
        ("cpuset.cpus", cpu.cpus, "cpu.cpus"), ("cpuset.mems", cpu.mems, "cpu.mems")) if value]
    if cpu.burst is not None:   # after cpu.max, whose quota it may not exceed (0 is a value)
        writes.append(("cpu.max.burst", cpu.burst, "cpu.burst"))
    return writes


class V2Cgroup(Cgroup):
    """A v2 cgroup. Device rules become a BPF_CGROUP_DEVICE program (devicefilter.py) that
    replaces the cgroup's earlier one; an empty rule list leaves it as it is. `root` is
    where the unified hierarchy is mounted."""

    version = "v2"

    def __init__(self, path: str, root: str = CGROUP_ROOT) -> None:
        super().__init__(path)
        self.root = root
        self.dir = root + path

    def dirs(self) -> list[str]:
        return [self.dir]

    def create(self) -> None:
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            raise SetupError(f"cgroup: creating {self.dir}: {e.strerror}") from e
        # Enable controllers top-down in every ancestor (not the leaf: it holds processes).
        d = self.root
        for part in self.path.strip("/").split("/"):
            enabled = read(d, "cgroup.subtree_control").split()
            for c in read(d, "cgroup.controllers").split():
                if c in CONTROLLERS and c not in enabled:
                    try:
                        write(d, "cgroup.subtree_control", "+" + c)
                    except SetupError:
                        # E.g. an ancestor with processes of its own (no-internal-processes
                        # rule); apply() then names the file that is missing.
                        pass
            d = os.path.join(d, part)

    def apply(self, r: Resources) -> None:
        """Write `r` into the cgroup. Every refusal (a v1-only field, a controller this cgroup
        lacks) comes before the first write, so it changes nothing."""
        writes = self._plan(r)
        program = devicefilter.program(r.devices) if r.devices else None  # refuses what v1 would not honour
        available = set(read(self.dir, "cgroup.controllers").split()) if writes else set()
        for name, _, field in writes:
            controller = name.split(".")[0]
            if controller != "cgroup" and controller not in available:
                raise Unsupported(f"{RESOURCES}.{field}: the {controller} cgroup controller is not "
                                  "available on this host")
        if program is not None:  # first: loading it is the last refusal (the verifier, privilege)
            try:
                bpf.replace_device_program(self.dir, program)
            except OSError as e:
                raise SetupError(f"{RESOURCES}.devices: {e.strerror}") from e
        for name, value, field in writes:
            write(self.dir, name, value, field)

    def _plan(self, r: Resources) -> list[Write]:
        """(file, value, linux.resources field) for each write, in runc's order."""
        from ..spec import NetworkResources
        if r.network is not None and r.network != NetworkResources():
            raise Unsupported(f"{RESOURCES}.network: cgroup v2 has no net_cls or net_prio controller "
                              "(match the cgroup path in eBPF or iptables instead)")
        writes: list[Write] = []
        if r.pids_limit:
            writes.append(("pids.max", "max" if r.pids_limit < 0 else r.pids_limit, "pids.limit"))
        writes += self._plan_memory(r.memory) if r.memory else []
        writes += self._plan_io(r.block_io) if r.block_io else []
        writes += _plan_cpu(r.cpu) if r.cpu else []
        writes += hugetlb_writes(self.dir, r.hugepage_limits, ".max")
        writes += [("rdma.max", rdma_line(dev, lim), f"rdma.{dev}") for dev, lim in r.rdma.items()]
        writes += [(name, value, f"unified.{name}") for name, value in r.unified.items()]
        return writes

    def _plan_memory(self, mem: MemoryResources) -> list[Write]:
        # v1-only settings are refused, where runc's fs2 ignores them; a default value sets nothing
        for field, refused, why in (
                ("swappiness", mem.swappiness is not None, "cgroup v2 has no per-cgroup swappiness"),
                ("disableOOMKiller", mem.disable_oom_killer, "cgroup v2 cannot disable the OOM killer"),
                ("useHierarchy", mem.use_hierarchy is False, "cgroup v2 memory accounting is always hierarchical")):
            if refused:
                raise Unsupported(f"{RESOURCES}.memory.{field}: {why}")
        if mem.kernel is not None:
            warn_ignored("memory.kernel", KERNEL_MEMORY)
        if mem.kernel_tcp is not None:
            warn_ignored("memory.kernelTCP", "cgroup v2 has no separate limit for TCP buffers")
        if mem.check_before_update:
            self._check_usage(mem)
        writes: list[Write] = []
        swap = swap_max(mem.swap, mem.limit)
        accounted = os.path.exists(os.path.join(self.dir, "memory.swap.max"))
        if swap is not None and (accounted or swap != "max"):  # unaccounted swap is unlimited already
            writes.append(("memory.swap.max", swap, "memory.swap"))
        if mem.limit is not None:
            writes.append(("memory.max", "max" if mem.limit < 0 else mem.limit, "memory.limit"))
        if mem.reservation is not None:
            writes.append(("memory.low", mem.reservation, "memory.reservation"))
        return writes

    def _check_usage(self, mem: MemoryResources) -> None:
        """checkBeforeUpdate: refuse a limit at or below the current usage, which v2 would meet
        with the OOM killer (v1's kernel refuses it itself)."""
        usage = read_int(self.dir, "memory.current")
        for field, limit in (("swap", mem.swap), ("limit", mem.limit)):
            if usage is not None and limit is not None and 0 < limit <= usage:
                raise SetupError(f"{RESOURCES}.memory.{field}: rejecting limit {limit}: it is not above "
                                 f"the current usage {usage} (checkBeforeUpdate)")

    def _plan_io(self, b: BlockIO) -> list[Write]:
        leaf = ["blockIO.leafWeight"] if b.leaf_weight is not None else []
        leaf += [f"blockIO.weightDevice[{i}].leafWeight" for i, wd in enumerate(b.weight_device)
                 if wd.leaf_weight is not None]
        if leaf:
            raise Unsupported(f"{RESOURCES}.{leaf[0]}: cgroup v2 has no leaf weights")
        writes: list[Write] = []
        # BFQ's own weight where the BFQ scheduler is there, as runc does; else io.weight
        bfq = os.path.exists(os.path.join(self.dir, "io.bfq.weight"))
        if b.weight is not None:
            writes.append(("io.bfq.weight", b.weight, "blockIO.weight") if bfq
                          else ("io.weight", blkio_to_io_weight(b.weight), "blockIO.weight"))
        for i, wd in enumerate(b.weight_device):
            if wd.weight is None:
                continue
            if not (bfq and _per_device_weights(self.dir)):
                raise Unsupported(f"{RESOURCES}.blockIO.weightDevice[{i}].weight: per-device weights need the "
                                  "BFQ I/O scheduler's io.bfq.weight, which this host lacks")
            writes.append(("io.bfq.weight", f"{wd.major}:{wd.minor} {wd.weight}", f"blockIO.weightDevice[{i}]"))
        from ..spec import THROTTLES
        for key, attr in THROTTLES.items():
            limit = attr.removeprefix("throttle_").replace("read_", "r").replace("write_", "w")  # rbps, wiops
            writes += [("io.max", f"{t.major}:{t.minor} {limit}={t.rate}", f"blockIO.{key}[{i}]")
                       for i, t in enumerate(getattr(b, attr))]
        return writes

    def try_freeze(self) -> bool:
        write(self.dir, "cgroup.freeze", 1)
        return self.frozen()

    def try_thaw(self) -> bool:
        write(self.dir, "cgroup.freeze", 0)
        return not self.frozen()

    def frozen(self) -> bool:
        return read_kv(self.dir, "cgroup.events").get("frozen") == 1

    def kill_steps(self, sig: int = signal.SIGKILL) -> Iterator[float]:
        """SIGKILL through cgroup.kill (Linux 5.14+): the kernel kills every process of the cgroup
        and its children at once, with no freeze and no race with fork; other signals (and older
        kernels) freeze, signal each process and thaw, as on v1."""
        if sig == signal.SIGKILL and os.path.exists(os.path.join(self.dir, "cgroup.kill")):
            write(self.dir, "cgroup.kill", 1)
            return
        yield from super().kill_steps(sig)

    def memory_limit(self) -> int | None:
        return read_int(self.dir, "memory.max")

    def memory_usage(self) -> int:
        return read_int(self.dir, "memory.current") or 0

    def reclaim(self) -> None:
        usage = self.memory_usage()
        if not usage:
            return
        fd = os.open(os.path.join(self.dir, "memory.reclaim"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(usage).encode())
        except OSError as e:   # EAGAIN: less than asked could be reclaimed, which is expected
            if e.errno != errno.EAGAIN:
                raise
        finally:
            os.close(fd)

    def stats(self) -> dict:
        return stats.v2_stats(self.dir)

    def oom_kills(self) -> int:
        return stats.v2_oom_kills(self.dir)

    def swap_limit(self) -> int | None:
        return read_int(self.dir, "memory.swap.max")   # None: "max", or no swap accounting

    def swap_usage(self) -> int | None:
        return read_int(self.dir, "memory.swap.current")

    def memory_stat(self) -> dict[str, int]:
        return read_kv(self.dir, "memory.stat")

    def cpuset_cpus(self) -> list[int] | None:
        try:
            return cpu_list(read(self.dir, "cpuset.cpus.effective"))
        except FileNotFoundError:
            return None

    def cpu_quota(self) -> tuple[int, int] | None:
        try:
            quota, period = read(self.dir, "cpu.max").split()
        except FileNotFoundError:
            return None
        return None if quota == "max" else (int(quota), int(period))

    def cpu_usage_ns(self) -> int | None:
        usec = read_kv(self.dir, "cpu.stat").get("usage_usec")
        return None if usec is None else usec * 1000

    def parent(self) -> V2Cgroup | None:
        up = os.path.dirname(self.path)
        return V2Cgroup(up, self.root) if up not in ("", "/") else None

    def threads(self) -> list[int]:
        return self._threads_in(self.dir, "cgroup.threads")
