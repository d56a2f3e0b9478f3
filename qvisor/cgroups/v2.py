"""cgroup v2: the container has one directory in the unified hierarchy.

Controllers must be enabled in every ancestor's cgroup.subtree_control before their files
appear in the container's cgroup, and the OCI v1-style values are converted the way runc
converts them (shares to weight, quota/period to cpu.max, memory+swap to swap alone).
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import SetupError, Unsupported
from . import CGROUP_ROOT, Cgroup, poll, read, read_int, read_kv, write

CONTROLLERS = ("cpu", "cpuset", "memory", "pids", "io")


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
        raise SetupError("cgroup: memory.swap.max: a swap limit needs a memory limit")
    if swap < limit:
        raise SetupError(f"cgroup: memory.swap.max: memory+swap {swap} is below memory {limit}")
    return str(swap - limit)


class V2Cgroup(Cgroup):
    """A v2 cgroup. Device rules need a BPF_CGROUP_DEVICE program, which quark does not
    load: apply() accepts only allow-all rules and raises Unsupported for any other."""

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

    def apply(self, resources: Any) -> None:
        devices = getattr(resources, "devices", None) or []
        for rule in devices:  # checked first so nothing is half-applied
            if not (rule.allow and (rule.type or "a") == "a" and rule.major is None
                    and rule.minor is None):
                raise Unsupported("cgroup v2 device rules need an eBPF device program, "
                                  "which quark does not support yet")
        writes: list[tuple[str, object]] = []
        mem = getattr(resources, "memory", None)
        if mem is not None:
            if mem.limit is not None:
                writes.append(("memory.max", "max" if mem.limit < 0 else mem.limit))
            if mem.reservation is not None:
                writes.append(("memory.low", mem.reservation))
            writes.append(("memory.swap.max", swap_max(mem.swap, mem.limit)))
        cpu = getattr(resources, "cpu", None)
        if cpu is not None:
            writes += [("cpu.weight", shares_to_weight(cpu.shares or 0) or None),
                       ("cpu.max", cpu_max(cpu.quota, cpu.period)),
                       ("cpuset.cpus", cpu.cpus or None), ("cpuset.mems", cpu.mems or None)]
        limit = getattr(resources, "pids_limit", None)
        if limit:
            writes.append(("pids.max", "max" if limit < 0 else limit))
        for name, value in writes:
            if value is not None:
                write(self.dir, name, value)

    def freeze(self) -> None:
        write(self.dir, "cgroup.freeze", 1)
        poll(self.frozen, f"freezing {self.dir}")

    def thaw(self) -> None:
        write(self.dir, "cgroup.freeze", 0)
        poll(lambda: not self.frozen(), f"thawing {self.dir}")

    def frozen(self) -> bool:
        return read_kv(self.dir, "cgroup.events").get("frozen") == 1

    def memory_limit(self) -> int | None:
        return read_int(self.dir, "memory.max")

    def memory_usage(self) -> int:
        return read_int(self.dir, "memory.current") or 0

    def stats(self) -> dict[str, int | None]:
        usec = read_kv(self.dir, "cpu.stat").get("usage_usec")
        return {
            "memory_usage": read_int(self.dir, "memory.current"),
            "memory_limit": self.memory_limit(),
            "memory_max_usage": read_int(self.dir, "memory.peak"),  # kernel 5.19+
            "cpu_usage_ns": None if usec is None else usec * 1000,
            "pids_current": read_int(self.dir, "pids.current"),
            "oom_events": read_kv(self.dir, "memory.events").get("oom_kill"),
        }
