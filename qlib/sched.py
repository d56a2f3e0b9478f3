"""A process's scheduling attributes, as fork passes them on: policy and real-time priority, nice
value, I/O priority and CPU affinity; read from any process, applied to the calling one
(sched_setattr(2) and ioprio_set(2) through ctypes, the rest through os).

The sandbox factory uses this so that a worker, and the supervisor and container it makes, carry
the caller's attributes and not the factory's (qvisor/factory/); the OCI `process.scheduler`,
`process.ioPriority`, `process.execCPUAffinity` and `linux.memoryPolicy` fields are applied with it
(qvisor/process.py, qvisor/sandbox.py).
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Collection
from dataclasses import dataclass

from qlib import syscalls
from qlib.libc import check
from qlib.libc import libc as _libc

# resolved at import, as in qlib/linux.py: the calls may run after a pivot into a container's root
_SYS_SCHED_SETATTR = syscalls.number("sched_setattr")
_SYS_IOPRIO_GET = syscalls.number("ioprio_get")
_SYS_IOPRIO_SET = syscalls.number("ioprio_set")
_SYS_SET_MEMPOLICY = syscalls.number("set_mempolicy")

IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_SHIFT = 13
SCHED_RESET_ON_FORK = 0x40000000   # or'ed into sched_getscheduler's answer when the flag is set
SCHED_DEADLINE = 6
ALL_CPUS = range(8192)   # "every CPU there is": the kernel clamps the mask to its own size and the cpuset


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64), ("util_min", ctypes.c_uint32),
                ("util_max", ctypes.c_uint32)]


def _check(ret: int, what: str) -> int:
    return check(ret, None, what)   # (the call's name as the filename: callers name the field)


def sched_setattr(policy: int, nice: int = 0, priority: int = 0, flags: int = 0, runtime: int = 0,
                  deadline: int = 0, period: int = 0) -> None:
    """sched_setattr(2) on the calling thread (which its later children inherit)."""
    attr = _SchedAttr(ctypes.sizeof(_SchedAttr), policy, flags, nice, priority, runtime, deadline, period, 0, 0)
    _check(_libc.syscall(_SYS_SCHED_SETATTR, ctypes.c_int(0), ctypes.byref(attr), ctypes.c_uint(0)),
           "sched_setattr")


def ioprio_get(pid: int = 0) -> int:
    return _check(_libc.syscall(_SYS_IOPRIO_GET, ctypes.c_int(IOPRIO_WHO_PROCESS), ctypes.c_int(pid)), "ioprio_get")


def ioprio_set(value: int) -> None:
    """The calling process's I/O priority (class << 13 | level; 0: none, the kernel's default)."""
    _check(_libc.syscall(_SYS_IOPRIO_SET, ctypes.c_int(IOPRIO_WHO_PROCESS), ctypes.c_int(0), ctypes.c_int(value)),
           "ioprio_set")


def set_mempolicy(mode: int, nodes: frozenset[int]) -> None:
    """set_mempolicy(2) for the calling thread (inherited by its children); `mode` with its flags."""
    words = (max(nodes) // 64 + 1) if nodes else 1
    mask = (ctypes.c_ulong * words)()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    # maxnode counts one more than the bits the kernel reads (it decrements it first)
    _check(_libc.syscall(_SYS_SET_MEMPOLICY, ctypes.c_int(mode), mask if nodes else None,
                         ctypes.c_ulong(words * 64 + 1 if nodes else 0)), "set_mempolicy")


def ioprio_value(io_class: int, level: int) -> int:
    """ioprio_set(2)'s value of a class (1 RT, 2 BE, 3 IDLE; qvisor/spec/model.py IOPRIO_CLASSES) and level."""
    return io_class << IOPRIO_CLASS_SHIFT | level


@dataclass(frozen=True)
class Scheduling:
    """What fork passes on of a process's scheduling (sched_getscheduler's policy, its flag
    included; the real-time priority; nice; I/O priority; the CPUs it may run on)."""
    policy: int
    priority: int
    nice: int
    ioprio: int
    cpus: Collection[int]   # (a range for "all": no set of thousands of ints)

    @classmethod
    def of(cls, pid: int) -> Scheduling:
        return cls(policy=os.sched_getscheduler(pid), priority=os.sched_getparam(pid).sched_priority,
                   nice=os.getpriority(os.PRIO_PROCESS, pid), ioprio=ioprio_get(pid),
                   cpus=frozenset(os.sched_getaffinity(pid)))

    def apply(self) -> None:
        """Make them the calling process's (raises OSError; a SCHED_DEADLINE one cannot be
        taken on this way: it has parameters sched_getscheduler does not tell)."""
        if self.policy & ~SCHED_RESET_ON_FORK == SCHED_DEADLINE:
            raise OSError(0, "a SCHED_DEADLINE process's parameters cannot be copied")
        os.sched_setaffinity(0, self.cpus)
        os.sched_setscheduler(0, self.policy, os.sched_param(self.priority))
        os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        ioprio_set(self.ioprio)


# what a process started by nobody in particular gets: the kernel's defaults
NEUTRAL = Scheduling(policy=os.SCHED_OTHER, priority=0, nice=0, ioprio=0, cpus=ALL_CPUS)
