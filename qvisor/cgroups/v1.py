"""cgroup v1: the container has one directory per mounted hierarchy.

Hierarchies come from /proc/self/mountinfo (never from assumed paths): each `cgroup`
mount with its controllers (comounts such as cpu,cpuacct map both names to one mount)
plus named hierarchies such as name=systemd, which only track processes.
"""
from __future__ import annotations

import os
import re
from typing import Any

from ..errors import SetupError, Unsupported
from . import UNLIMITED, Cgroup, device_rule, poll, read, read_int, read_kv, write


def hierarchies() -> dict[str, str]:
    """Map each mounted v1 controller (and "name=..." hierarchy) to its mount point."""
    with open("/proc/cgroups") as f:
        known = {line.split()[0] for line in f if not line.startswith("#")}
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = right.split()[:3]
            if fstype != "cgroup":
                continue
            # Mount points escape space, tab, newline and backslash as \ooo.
            mountpoint = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), left.split()[4])
            for opt in options.split(","):
                if opt in known or opt.startswith("name="):
                    found.setdefault(opt, mountpoint)  # first mount wins over bind mounts
    return found


class V1Cgroup(Cgroup):
    version = "v1"

    def __init__(self, path: str, mounts: dict[str, str] | None = None) -> None:
        super().__init__(path)
        self.mounts = hierarchies() if mounts is None else mounts

    def dirs(self) -> list[str]:
        return [mp + self.path for mp in dict.fromkeys(self.mounts.values())]

    def _dir(self, controller: str) -> str:
        if controller not in self.mounts:
            raise Unsupported(f"cgroup v1 controller {controller!r} is not mounted on this host")
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

    def apply(self, resources: Any) -> None:
        mem = getattr(resources, "memory", None)
        if mem is not None:
            self._apply_memory(mem)
        cpu = getattr(resources, "cpu", None)
        if cpu is not None:
            # Period before quota: the kernel checks the quota against the current period.
            for name, value in (("cpu.shares", cpu.shares), ("cpu.cfs_period_us", cpu.period),
                                ("cpu.cfs_quota_us", cpu.quota)):
                if value:
                    write(self._dir("cpu"), name, value)
            for name, value in (("cpuset.cpus", cpu.cpus), ("cpuset.mems", cpu.mems)):
                if value:
                    write(self._dir("cpuset"), name, value)
        limit = getattr(resources, "pids_limit", None)
        if limit:  # 0 means unset in OCI, negative means unlimited
            write(self._dir("pids"), "pids.max", "max" if limit < 0 else limit)
        for rule in getattr(resources, "devices", None) or []:
            write(self._dir("devices"), "devices.allow" if rule.allow else "devices.deny",
                  device_rule(rule))

    def _apply_memory(self, mem: Any) -> None:
        d = self._dir("memory")
        writes = []
        if mem.limit is not None:
            writes.append(("memory.limit_in_bytes", mem.limit))
        # memory+swap must never drop below the memory limit: when the new limit exceeds the
        # current memsw limit, raise memsw first. The file is absent without swap accounting.
        if mem.swap is not None and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
            current = read_int(d, "memory.memsw.limit_in_bytes") or 0
            first = mem.swap == -1 or (mem.limit is not None and (mem.limit == -1 or mem.limit > current))
            writes.insert(0 if first else len(writes), ("memory.memsw.limit_in_bytes", mem.swap))
        if mem.reservation is not None:
            writes.append(("memory.soft_limit_in_bytes", mem.reservation))
        for name, value in writes:
            write(d, name, value)

    def _freezer_state(self) -> str:
        return read(self._dir("freezer"), "freezer.state")

    def freeze(self) -> None:
        d = self._dir("freezer")

        def done() -> bool:
            # FREEZING can stall on a task mid-syscall; asking again retries the freeze.
            write(d, "freezer.state", "FROZEN")
            return self._freezer_state() == "FROZEN"
        poll(done, f"freezing {d}")

    def thaw(self) -> None:
        write(self._dir("freezer"), "freezer.state", "THAWED")
        poll(lambda: self._freezer_state() == "THAWED", f"thawing {self._dir('freezer')}")

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

    def stats(self) -> dict[str, int | None]:
        oom = read_kv(self._dir("memory"), "memory.oom_control") if "memory" in self.mounts else {}
        return {
            "memory_usage": self._int("memory", "memory.usage_in_bytes"),
            "memory_limit": self.memory_limit(),
            "memory_max_usage": self._int("memory", "memory.max_usage_in_bytes"),
            "cpu_usage_ns": self._int("cpuacct", "cpuacct.usage"),
            "pids_current": self._int("pids", "pids.current"),
            "oom_events": oom.get("oom_kill"),  # kernel 4.13+
        }
