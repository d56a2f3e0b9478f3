"""Handlers and the dispatcher against a fake platform: answers, deferral, abandoned requests."""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import os

from qkernel import seccomp_notify as sn
from qkernel import table
from qkernel.errors import MemoryFault, TaskGone
from qkernel.kernel import Kernel, SandboxContext
from qkernel.request import Continue, Errno, Request, Return
from qkernel.syscalls import sys_mount, sys_personality, sys_sysinfo
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


class StringsRequest(FakeRequest):
    """A request whose task memory holds NUL-terminated strings at given addresses: the pages they
    touch are mapped (other bytes there are not NUL), any other page faults, as in a task."""

    def __init__(self, kernel, name, args, strings):
        super().__init__(kernel, name, args)
        self.bytes = {addr + i: b for addr, s in strings.items() for i, b in enumerate(s + b"\0")}
        self.pages = {a // PAGE for a in self.bytes}

    def read(self, addr, size):
        if any(a // PAGE not in self.pages for a in (addr, addr + size - 1)):
            raise MemoryFault(addr)
        return bytes(self.bytes.get(a, 0xFF) for a in range(addr, addr + size))


PAGE = 4096
TYPE, TARGET, SOURCE, DATA = 10 * PAGE, 20 * PAGE, 30 * PAGE, 40 * PAGE - 8   # DATA crosses a page


def mount_request(k, fstype, flags, data=b"size=1m", target=b"/mnt/t"):
    args = (SOURCE, TARGET, TYPE, flags, DATA if data is not None else 0, 0)
    return StringsRequest(k, "mount", args, {TYPE: fstype, TARGET: target, SOURCE: b"tmpfs", DATA: data or b""})


def test_a_trapped_mount_makes_a_tmpfs_and_nothing_else(monkeypatch):
    """Only a granted process's new-filesystem mounts are trapped (qkernel/table.py); the handler makes
    a tmpfs from its own copy of the arguments and refuses other types as the filter did."""
    k = kernel()
    assert k.handlers[table.by_name()["mount"].nr(k.arch)].handler is sys_mount.handle
    made = []
    monkeypatch.setattr(sys_mount, "mount_for", lambda req, *a: made.append(a) or Return(0))
    for fstype, flags, answer in ((b"proc", 0, Errno(errno.EPERM)), (b"cgroup", 0xC0ED0000, Errno(errno.EPERM)),
                                  (b"tmpfs", 1 << 22, Errno(errno.EINVAL)),             # MS_KERNMOUNT
                                  (b"tmpfs", 0xC0ED0000 | L.MS_NOSUID, Return(0)),      # the magic is dropped
                                  (b"tmpfs", L.MS_NODEV | L.MS_RELATIME, Return(0))):
        req = mount_request(k, fstype, flags)
        k.dispatch(req)
        assert req.sent == [answer], (fstype, flags)
    assert made == [(b"tmpfs", b"/mnt/t", b"tmpfs", L.MS_NOSUID, b"size=1m"),
                    (b"tmpfs", b"/mnt/t", b"tmpfs", L.MS_NODEV | L.MS_RELATIME, b"size=1m")]
    req = mount_request(k, b"tmpfs", 0, target=b"x" * 5000)   # no NUL within PATH_MAX
    k.dispatch(req)
    assert req.sent == [Errno(errno.ENAMETOOLONG)]


def test_the_mount_child_answers_through_its_pipe_even_when_the_reaper_collects_it():
    """The supervisor's reaper waits for any child (waitpid(-1)): the child's answer must not depend
    on the handler collecting its exit status."""
    def refused():
        raise OSError(errno.EACCES, "denied")
    assert sys_mount._in_child(lambda: None) == Return(0)
    assert sys_mount._in_child(refused) == Errno(errno.EACCES)
    real_waitpid = os.waitpid
    try:
        os.waitpid = lambda pid, options: (real_waitpid(pid, options), (_ for _ in ()).throw(ChildProcessError()))[1]
        assert sys_mount._in_child(refused) == Errno(errno.EACCES)
    finally:
        os.waitpid = real_waitpid


def test_read_string_stops_at_the_nul_and_at_its_limit():
    req = StringsRequest(kernel(), "mount", (0,) * 6, {PAGE - 3: b"abcdef"})   # crosses a page boundary
    assert req.read_string(PAGE - 3, 64) == b"abcdef"
    assert req.read_string(PAGE - 3, 4) is None
