"""Feasibility probe for issue 13's next step (not used by quark): can a cgroup `setsockopt` BPF
program answer TCP_CORK for quark's local-path sockets, so that nginx's per-response cork/uncork
needs no trapped syscall at all?

The probe first answered it with a program assembled in Python that bypassed the kernel for AF_UNIX
ends carrying quark's SO_MARK (bench/README.md, "Socket options without a trap", tells what it
found). What was built keys on the cgroup that made the socket instead (tsor/sockopt_offload.py),
and the probe now checks those programs on this kernel: it loads tsor/bpf/sockopt.bpf.o (built by
`make install`) onto a scratch cgroup of the unified (v2) hierarchy the way a supervisor does, and
in a child moved into that cgroup checks: an AF_UNIX end made there accepts TCP_CORK and reads it
back, one made before the move still gets EOPNOTSUPP, a TCP socket is untouched. The programs run
for the cgroup of the process that *created* the socket. Cleans up (the cgroup, and with it the
programs, removed) before it exits.

Usage (root, a cgroup2 mount at /sys/fs/cgroup/unified or /sys/fs/cgroup):
    .venv/bin/python bench/probe_sockopt_bpf.py
"""
from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tsor import sockopt_offload  # noqa: E402

SCRATCH = "quark-sockopt-probe"


def child(root: str, made_before: socket.socket) -> None:
    if sockopt_offload.join(root, SCRATCH) is None:
        print("the programs could not be attached (the log above says why)")
        return
    a, _ = socket.socketpair()
    for name, s in (("AF_UNIX made in the cgroup", a), ("AF_UNIX made before joining", made_before)):
        try:
            s.setsockopt(socket.SOL_TCP, socket.TCP_CORK, 1)
            print(f"{name}: TCP_CORK accepted, reads back {s.getsockopt(socket.SOL_TCP, socket.TCP_CORK)}")
        except OSError as e:
            print(f"{name}: {e}")
    t = socket.socket()
    t.setsockopt(socket.SOL_TCP, socket.TCP_CORK, 1)
    print("TCP socket: TCP_CORK reads back", t.getsockopt(socket.SOL_TCP, socket.TCP_CORK))


def main() -> None:
    root = sockopt_offload.cgroup2_root()
    if root is None:
        raise SystemExit("probe_sockopt_bpf: no cgroup2 mount")
    made_before, _ = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            child(root, made_before)
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.waitpid(pid, 0)
    if not sockopt_offload.remove_if_unused(root, SCRATCH):
        raise SystemExit(f"probe_sockopt_bpf: {os.path.join(root, SCRATCH)} is still in use")


if __name__ == "__main__":
    main()
