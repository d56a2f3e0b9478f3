"""Validation of linux.resources (cgroup settings) into the `Resources` model: device rules, memory,
cpu, blockIO, hugepage limits, network, rdma and unified, and `parse_resources` for the lone object
`quark update --resources FILE` reads.

Values that end up in cgroup file names or "name value" lines (hugepage sizes, rdma device names,
unified keys) are checked here so that nothing can lead out of the container's cgroup directory.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .model import (
    THROTTLES,
    BlockIO,
    CpuResources,
    DeviceRule,
    HugepageLimit,
    InterfacePriority,
    MemoryResources,
    NetworkResources,
    RdmaLimit,
    Resources,
    ThrottleDevice,
    WeightDevice,
)
from .reader import I64, U32, U64, boolean, integer, list_of, mapping, one_of, Reader, string, string_map, zero_unset


def _device_rule(r: Reader, f: str, v: Any) -> DeviceRule:
    d = mapping(r, f, v)
    number = integer(-1, 2**63 - 1)
    rule = DeviceRule(allow=r.get(d, f, "allow", boolean),
                      type=r.get(d, f, "type", one_of(("a", "c", "b"), "device type"), "a"),
                      major=r.get(d, f, "major", number, None), minor=r.get(d, f, "minor", number, None),
                      access=r.get(d, f, "access", string, "rwm"))  # empty means all, as in runc
    if not rule.access or set(rule.access) - set("rwm"):
        r.fail(f"{f}.access", f"must be a combination of r, w and m, got {json.dumps(rule.access)}")
    # -1 is the Go spelling of "any"; one spelling (None) is simpler for the cgroup code.
    rule.major = None if rule.major == -1 else rule.major
    rule.minor = None if rule.minor == -1 else rule.minor
    return rule


# memory limits: 0 is unset, as runc reads them (-1 is unlimited)
_MEMORY_LIMIT = zero_unset(I64)


def _memory(r: Reader, f: str, v: Any) -> MemoryResources:
    d = mapping(r, f, v)
    return MemoryResources(
        limit=r.get(d, f, "limit", _MEMORY_LIMIT, None), reservation=r.get(d, f, "reservation", _MEMORY_LIMIT, None),
        swap=r.get(d, f, "swap", _MEMORY_LIMIT, None), kernel=r.get(d, f, "kernel", _MEMORY_LIMIT, None),
        kernel_tcp=r.get(d, f, "kernelTCP", _MEMORY_LIMIT, None), swappiness=r.get(d, f, "swappiness", integer(0, 100), None),
        disable_oom_killer=r.get(d, f, "disableOOMKiller", boolean, False),
        use_hierarchy=r.get(d, f, "useHierarchy", boolean, None),
        check_before_update=r.get(d, f, "checkBeforeUpdate", boolean, False))


def _cpu(r: Reader, f: str, v: Any) -> CpuResources:
    d = mapping(r, f, v)
    return CpuResources(
        shares=r.get(d, f, "shares", U64, None), quota=r.get(d, f, "quota", I64, None),
        period=r.get(d, f, "period", U64, None), realtime_runtime=r.get(d, f, "realtimeRuntime", I64, None),
        realtime_period=r.get(d, f, "realtimePeriod", U64, None), cpus=r.get(d, f, "cpus", string, ""),
        mems=r.get(d, f, "mems", string, ""),
        idle=r.get(d, f, "idle", integer(0, 1), None),  # the kernel's cpu.idle takes 0 or 1
        burst=r.get(d, f, "burst", U64, None))


# the kernel's range for blkio (and BFQ) weights; docker writes "weight": 0 into every spec for "unset"
_BLKIO_WEIGHT = zero_unset(integer(10, 1000))


def _weight_device(r: Reader, f: str, v: Any) -> WeightDevice:
    d = mapping(r, f, v)
    return WeightDevice(major=r.get(d, f, "major", I64), minor=r.get(d, f, "minor", I64),
                        weight=r.get(d, f, "weight", _BLKIO_WEIGHT, None),
                        leaf_weight=r.get(d, f, "leafWeight", _BLKIO_WEIGHT, None))


def _throttle_device(r: Reader, f: str, v: Any) -> ThrottleDevice:
    d = mapping(r, f, v)
    return ThrottleDevice(major=r.get(d, f, "major", I64), minor=r.get(d, f, "minor", I64),
                          rate=r.get(d, f, "rate", U64))


def _block_io(r: Reader, f: str, v: Any) -> BlockIO:
    d = mapping(r, f, v)
    throttles = {attr: r.get(d, f, key, list_of(_throttle_device), []) for key, attr in THROTTLES.items()}
    return BlockIO(weight=r.get(d, f, "weight", _BLKIO_WEIGHT, None),
                   leaf_weight=r.get(d, f, "leafWeight", _BLKIO_WEIGHT, None),
                   weight_device=r.get(d, f, "weightDevice", list_of(_weight_device), []), **throttles)


def _hugepage_limit(r: Reader, f: str, v: Any) -> HugepageLimit:
    d = mapping(r, f, v)
    size = r.get(d, f, "pageSize", string)
    # it becomes part of a file name (hugetlb.<size>.max): only the kernel's spelling may pass
    if not re.fullmatch(r"[0-9]+[KMGTP]B", size):
        r.fail(f"{f}.pageSize", f'must be a huge page size such as "2MB" or "1GB", got {json.dumps(size)}')
    return HugepageLimit(page_size=size, limit=r.get(d, f, "limit", U64))


def _word(r: Reader, f: str, v: Any) -> str:
    """A name the kernel reads from a "name value" line: non-empty, no whitespace."""
    if not string(r, f, v) or any(c.isspace() for c in v):
        r.fail(f, f"must be a non-empty name without whitespace, got {json.dumps(v)}")
    return v


def _network(r: Reader, f: str, v: Any) -> NetworkResources:
    d = mapping(r, f, v)

    def priority(r: Reader, f: str, v: Any) -> InterfacePriority:
        p = mapping(r, f, v)
        return InterfacePriority(name=r.get(p, f, "name", _word), priority=r.get(p, f, "priority", U32))
    return NetworkResources(class_id=r.get(d, f, "classID", zero_unset(U32), None),
                            priorities=r.get(d, f, "priorities", list_of(priority), []))


def _rdma(r: Reader, f: str, v: Any) -> dict[str, RdmaLimit]:
    limits = {}
    for device, x in mapping(r, f, v).items():
        where = f"{f}.{device}"
        d = mapping(r, where, x)
        limits[_word(r, where, device)] = RdmaLimit(hca_handles=r.get(d, where, "hcaHandles", U32, None),
                                                   hca_objects=r.get(d, where, "hcaObjects", U32, None))
    return limits


def _unified(r: Reader, f: str, v: Any) -> dict[str, str]:
    files = string_map(r, f, v)
    for key in files:
        # a key is a file in the container's cgroup directory: nothing that leads out of it
        if not re.fullmatch(r"[a-z0-9_]+\.[A-Za-z0-9_.]+", key):
            r.fail(f"{f}.{key}", "must be a cgroup file name in the form CONTROLLER.PARAMETER")
    return files


def resources_field(r: Reader, f: str, v: Any) -> Resources:
    d = mapping(r, f, v)
    pids = r.get(d, f, "pids", mapping, None)
    return Resources(
        memory=r.get(d, f, "memory", _memory, None), cpu=r.get(d, f, "cpu", _cpu, None),
        pids_limit=None if pids is None else r.get(pids, f"{f}.pids", "limit", I64),
        devices=r.get(d, f, "devices", list_of(_device_rule), []),
        block_io=r.get(d, f, "blockIO", _block_io, None),
        hugepage_limits=r.get(d, f, "hugepageLimits", list_of(_hugepage_limit), []),
        network=r.get(d, f, "network", _network, None), rdma=r.get(d, f, "rdma", _rdma, {}),
        unified=r.get(d, f, "unified", _unified, {}))


def parse_resources(data: Any, path: str) -> Resources:
    """Validate a lone linux.resources object (`quark update --resources FILE`)."""
    return resources_field(Reader(path), "resources", data)
