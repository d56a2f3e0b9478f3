"""Handlers and the dispatcher against a fake platform: answers, deferral, abandoned requests."""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools

from qkernel import seccomp_notify as sn
from qkernel import table
from qkernel.errors import TaskGone
from qkernel.kernel import Kernel, SandboxContext
from qkernel.request import Continue, Errno, Request, Return
from qkernel.syscalls import sys_personality, sys_sysinfo
from qlib import linux as L
from qlib.eventloop import Loop
from qvisor import procview

MiB = 1024 * 1024


class FakeRequest(Request):
    """A request whose task 'memory' is a dict and whose validity the test controls."""

    def __init__(self, kernel, name, args, valid=True):
        super().__init__(kernel, 0, table.by_name()[name].nr(kernel.arch), args)
        self.valid, self.sent, self.memory, self.interrupted = valid, [], {}, False

    def is_valid(self):
        return self.valid

    def is_interrupted(self):
        return not self.valid

    def send(self, answer):
        self.sent.append(answer)

    def interrupt(self):
        self.interrupted = True

    def write(self, addr, data):
        self.memory[addr] = data

    def read(self, addr, size):
        if not self.valid:
            raise TaskGone(self.pid)
        return b"\0" * size


class Cgroup:
    def memory_limit(self):
        return 256 * MiB

    def memory_usage(self):
        return 56 * MiB


def kernel(cgroup=None):
    figures = functools.partial(procview.sysinfo, cgroup, 1) if cgroup is not None else None
    return Kernel(Loop(), "seccomp", SandboxContext("c1", 1, sysinfo=figures))


def swap_handler(k, name, handler):
    entry = table.by_name()[name]
    k.handlers[entry.nr(k.arch)] = dataclasses.replace(entry, handler=handler)


def test_abi_struct_sizes():
    assert ctypes.sizeof(sn.SeccompNotif) == 80
    assert ctypes.sizeof(sn.SeccompNotifResp) == 24
    assert ctypes.sizeof(sn.SeccompNotifAddfd) == 24
    assert ctypes.sizeof(L.Sysinfo) == 112
    assert (sn.NOTIF_RECV, sn.NOTIF_SEND, sn.NOTIF_ID_VALID, sn.NOTIF_ADDFD) == \
        (0xC0502100, 0xC0182101, 0x40082102, 0x40182103)


def test_sysinfo_answers_from_the_cgroup():
    k = kernel(Cgroup())
    req = FakeRequest(k, "sysinfo", (0x1000, 0, 0, 0, 0, 0))
    k.dispatch(req)
    assert req.sent == [Return(0)]
    info = L.Sysinfo.from_buffer_copy(req.memory[0x1000])
    assert (info.totalram, info.freeram, info.mem_unit) == (256 * MiB, 200 * MiB, 1)
    assert info.procs > 0 and info.uptime > 0


def test_sysinfo_without_a_view_is_the_hosts_in_bytes():
    host = L.sysinfo()
    info = sys_sysinfo.sandbox_sysinfo(None)
    assert info.totalram == host.totalram * host.mem_unit and info.mem_unit == 1


def test_personality_allows_only_default_personas():
    k = kernel()
    assert sys_personality.handle(FakeRequest(k, "personality", (0xFFFFFFFF,))) == Continue()
    assert sys_personality.handle(FakeRequest(k, "personality", (0x1_0000_0008,))) == Continue()
    assert sys_personality.handle(FakeRequest(k, "personality", (0x0040000,))) == Errno(errno.EPERM)


def test_sockets_pass_through():
    k = kernel()
    req = FakeRequest(k, "connect", (3, 0x1000, 16))
    k.dispatch(req)
    assert req.sent == [Continue()]


def test_task_gone_during_a_handler_is_dropped():
    k = kernel(Cgroup())
    swap_handler(k, "getsockopt", lambda r: r.read(0x1000, 4))
    req = FakeRequest(k, "getsockopt", (3, 1, 7, 0x1000, 0x2000), valid=False)
    k.dispatch(req)
    assert req.sent == []


def test_deferred_answer_and_abandoned_deferred():
    k = kernel()
    defers = []
    swap_handler(k, "accept", lambda r: defers.append(r.defer()) or defers[-1])
    done = FakeRequest(k, "accept", (3, 0, 0))
    gone = FakeRequest(k, "accept", (4, 0, 0))
    cancelled = []
    k.dispatch(done)
    k.dispatch(gone)
    defers[1].on_cancel(lambda: cancelled.append(gone))
    assert done.sent == [] and gone.sent == []
    defers[0].complete(Return(5))
    assert done.sent == [Return(5)]
    gone.valid = False          # e.g. a signal made the kernel abandon it
    k._poll_pending()
    assert cancelled == [gone] and gone.interrupted
    defers[1].complete(Return(6))   # too late: dropped, never sent
    assert gone.sent == []
