"""Runs one program under QKernel the way the supervisor does, without namespaces or a rootfs.

    python tests/progs/qkernel_harness.py --platform seccomp|ptrace [options] -- PROGRAM ARGS...

The harness forks the "container" process, which calls qkernel.install_filter right before execve
(sending the listener fd back over a socketpair on the seccomp platform); the harness runs a
qvisor Loop + qkernel.Kernel, reaps every child itself and hands each status to on_child_status.
It exits with the program's status (128+signal if killed); on stderr it prints one line
`qkernel-harness: deferred=N completed=N cancelled=N` for the tests.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import qkernel  # noqa: E402
from qkernel.request import Continue  # noqa: E402
from qlib.eventloop import Loop  # noqa: E402
from qvisor import procview  # noqa: E402

WALL = 0x40000000
PR_SET_CHILD_SUBREAPER = 36


class FakeCgroup:
    """A cgroup's memory figures without a cgroup: the harness runs without namespaces or a rootfs."""

    def __init__(self, limit: int | None, usage: int) -> None:
        self.limit, self.usage = limit, usage

    def memory_limit(self) -> int | None:
        return self.limit

    def memory_usage(self) -> int:
        return self.usage


def failing_handler(req):
    """A handler with a bug: what QKernel does then is what the application sees."""
    raise RuntimeError(f"injected failure in the {req.name} handler")


def oci_seccomp(path: str) -> SimpleNamespace:
    """linux.seccomp JSON -> the attribute shape of qvisor.spec.Seccomp."""
    with open(path) as f:
        d = json.load(f)
    rules = [SimpleNamespace(names=r["names"], action=r["action"], errno_ret=r.get("errnoRet"),
                             args=[SimpleNamespace(index=a["index"], value=a["value"],
                                                   value_two=a.get("valueTwo", 0), op=a["op"])
                                   for a in r.get("args", [])])
             for r in d.get("syscalls", [])]
    return SimpleNamespace(default_action=d["defaultAction"], default_errno_ret=d.get("defaultErrnoRet"),
                           architectures=d.get("architectures", []), flags=d.get("flags", []),
                           listener_path=d.get("listenerPath", ""), syscalls=rules)


class Counters:
    deferred = completed = cancelled = 0


def delay_handler(loop: Loop, seconds: float, counters: Counters):
    """Holds the call `seconds` (a blocking trapped call, as TSoR's accept will be), then lets it run."""
    def handle(req):
        d = req.defer()
        counters.deferred += 1

        def done():
            if not d.done:
                counters.completed += 1
            d.complete(Continue())

        def cancelled():
            counters.cancelled += 1

        d.on_cancel(cancelled)
        loop.call_later(seconds, done)
        return d
    return handle


def _bounding_set() -> frozenset[str]:
    from qvisor.spec import CAPABILITIES
    with open("/proc/self/status") as f:
        mask = int(next(ln for ln in f if ln.startswith("CapBnd")).split()[1], 16)
    return frozenset(name for name, bit in CAPABILITIES.items() if mask >> bit & 1)


def child(argv: list[str], platform: str, sock: socket.socket, go: int, bundle, nnp: bool) -> None:
    try:
        os.read(go, 1)   # ptrace: wait until the harness has seized us
        # the filter a container with this process's capabilities and no namespace of its own gets:
        # no grant applies, and what is denied only to holders of a capability is denied
        fd = qkernel.install_filter(bundle, platform, nnp, sockets=True, caps=_bounding_set(),
                                    channel_fd=sock.fileno())
        if fd is not None:
            socket.send_fds(sock, [b"L"], [fd])
            os.close(fd)
        os.execvp(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - report anything, then die without running atexit
        print(f"qkernel-harness child: {e!r}", file=sys.stderr)
        os._exit(127)


class Run:
    """One program started under QKernel: `kernel.handlers` may be changed until `serve()` runs."""

    def __init__(self, argv: list[str], platform: str, name: str, cgroup=None, bundle=None,
                 nnp: bool = False) -> None:
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self.platform = platform
        self.parent_sock, child_sock = socket.socketpair()
        go_r, self.go_w = os.pipe()
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)
        self.pid = os.fork()
        if self.pid == 0:
            self.parent_sock.close()
            child(argv, platform, child_sock, go_r, bundle, nnp)
        child_sock.close()
        os.close(go_r)
        self.loop = Loop()
        figures = functools.partial(procview.sysinfo, cgroup, self.pid) if cgroup is not None else None
        self.kernel = qkernel.Kernel(self.loop, platform, qkernel.SandboxContext(name, self.pid, sysinfo=figures))
        self.status: int | None = None

    def serve(self, timeout: float | None = None) -> int | None:
        """Let the program go and serve it until it exits: its exit code (negative: killed by a
        signal), 127 if it never installed its filter, None if `timeout` passed first."""
        if self.platform == "ptrace":
            self.kernel.attach(self.pid)
        os.write(self.go_w, b"g")
        if self.platform == "seccomp":
            _, fds, _, _ = socket.recv_fds(self.parent_sock, 1, 1)
            if not fds:
                os.waitpid(self.pid, 0)
                return 127
            self.kernel.serve_listener(fds[0])
        self.loop.add_reader(self.wake_r, self._reap)
        self._reap()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status is None and (deadline is None or time.monotonic() < deadline):
            self.loop.run_once(0.1)
        return self.status

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                wpid, status = os.waitpid(-1, os.WNOHANG | WALL)
            except ChildProcessError:
                return
            if wpid == 0:
                return
            if self.kernel.on_child_status(wpid, status):
                continue
            if wpid == self.pid:
                self.status = os.waitstatus_to_exitcode(status)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--platform", required=True)
    p.add_argument("--memory-limit", type=int)
    p.add_argument("--memory-usage", type=int, default=0)
    p.add_argument("--delay", action="append", default=[], metavar="SYSCALL=SECONDS")
    p.add_argument("--seccomp-json", help="a bundle's linux.seccomp, stacked on quark's filter")
    p.add_argument("--nnp", action="store_true", help="no_new_privileges")
    p.add_argument("--fail", action="append", default=[], metavar="SYSCALL",
                   help="replace SYSCALL's handler with one that raises")
    p.add_argument("argv", nargs="+")
    args = p.parse_args()
    # QKernel's log (the supervisor's log file in a sandbox) goes to stderr here
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s: %(message)s")

    bundle = oci_seccomp(args.seccomp_json) if args.seccomp_json else None
    cgroup = FakeCgroup(args.memory_limit, args.memory_usage) if args.memory_limit else None
    run = Run(args.argv, args.platform, "harness", cgroup, bundle, args.nnp)
    counters = Counters()
    for spec in args.delay:
        name, seconds = spec.split("=")
        entry = qkernel.table.by_name()[name]
        handler = delay_handler(run.loop, float(seconds), counters)
        run.kernel.handlers[entry.nr(run.kernel.arch)] = dataclasses.replace(entry, handler=handler)
    for name in args.fail:
        entry = qkernel.table.by_name()[name]
        run.kernel.handlers[entry.nr(run.kernel.arch)] = dataclasses.replace(entry, handler=failing_handler)
    code = run.serve()
    # Drain deferred answers still held for tasks that are gone, so their drop path runs.
    deadline = time.monotonic() + 3
    while run.kernel._pending and time.monotonic() < deadline:
        run.loop.run_once(0.05)
    run.kernel.close()
    print(f"qkernel-harness: deferred={counters.deferred} completed={counters.completed} "
          f"cancelled={counters.cancelled}", file=sys.stderr)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
