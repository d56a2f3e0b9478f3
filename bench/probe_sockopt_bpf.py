"""Feasibility probe for issue 13's next step (not used by quark): can a cgroup `setsockopt` BPF
program answer TCP_CORK for quark's local-path sockets, so that nginx's per-response cork/uncork
needs no trapped syscall at all?

It loads a hand-assembled BPF_PROG_TYPE_CGROUP_SOCKOPT program (no compiler: 14 instructions) that,
for setsockopt(SOL_TCP, TCP_CORK) on an AF_UNIX socket whose SO_MARK is quark's, sets optlen = -1
(the kernel then skips its own handler and returns 0), attaches it to a scratch cgroup of the
unified (v2) hierarchy, and in a child moved into that cgroup checks: a marked AF_UNIX end accepts
TCP_CORK, an unmarked one still gets EOPNOTSUPP, a TCP socket is untouched. The program runs for the
cgroup of the process that *created* the socket, which is what a real design must arrange (see
bench/README.md, "Supervisor to supervisor"). Cleans up (detach, rmdir) before it exits.
2026-12-04, kernel 6.18: all three as expected.

Usage (root, a cgroup2 mount at /sys/fs/cgroup/unified or /sys/fs/cgroup):
    python3 bench/probe_sockopt_bpf.py
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct

libc = ctypes.CDLL(None, use_errno=True)
NR_BPF = 321                                   # x86_64
BPF_PROG_LOAD, BPF_PROG_ATTACH, BPF_PROG_DETACH = 5, 8, 9
BPF_PROG_TYPE_CGROUP_SOCKOPT, BPF_CGROUP_SETSOCKOPT, BPF_F_ALLOW_MULTI = 25, 22, 2
MAGIC = 0x71756172                             # the SO_MARK a real design would give local-path ends
MOV64_X, LDXW, LDXDW, STXW, JNE_K, MOV64_K, EXIT = 0xBF, 0x61, 0x79, 0x63, 0x55, 0xB7, 0x95


def bpf(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, 128)
    r = libc.syscall(NR_BPF, cmd, buf, 128)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def setsockopt_program() -> bytes:
    """struct bpf_sockopt: sk @0, optval @8, optval_end @16, level @24, optname @28, optlen @32;
    struct bpf_sock: family @4, mark @16."""
    return b"".join([
        insn(MOV64_X, 6, 1),
        insn(LDXW, 2, 6, 24), insn(JNE_K, 2, 0, 9, socket.SOL_TCP),       # another level: the kernel's
        insn(LDXW, 2, 6, 28), insn(JNE_K, 2, 0, 7, socket.TCP_CORK),
        insn(LDXDW, 7, 6, 0),                                             # the socket
        insn(LDXW, 2, 7, 4), insn(JNE_K, 2, 0, 4, socket.AF_UNIX),
        insn(LDXW, 2, 7, 16), insn(JNE_K, 2, 0, 2, MAGIC),
        insn(MOV64_K, 2, 0, 0, -1), insn(STXW, 6, 2, 32),                 # optlen = -1: skip the kernel
        insn(MOV64_K, 0, 0, 0, 1), insn(EXIT)])


def load(code: bytes, attach_type: int) -> int:
    insns, lic, log = ctypes.create_string_buffer(code), ctypes.create_string_buffer(b"GPL"), \
        ctypes.create_string_buffer(65536)
    attr = struct.pack("<IIQQIIQII16sII", BPF_PROG_TYPE_CGROUP_SOCKOPT, len(code) // 8, ctypes.addressof(insns),
                       ctypes.addressof(lic), 1, len(log), ctypes.addressof(log), 0, 0, b"qprobe", 0, attach_type)
    try:
        return bpf(BPF_PROG_LOAD, attr)
    except OSError as e:
        raise SystemExit(f"load failed: {e}\n{log.value.decode()[-2000:]}") from None


def child(cg: str) -> None:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write("0")
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, MAGIC)
    for name, s in (("marked AF_UNIX", a), ("unmarked AF_UNIX", b)):
        try:
            s.setsockopt(socket.SOL_TCP, socket.TCP_CORK, 1)
            print(f"{name}: TCP_CORK accepted")
        except OSError as e:
            print(f"{name}: {e}")
    t = socket.socket()
    t.setsockopt(socket.SOL_TCP, socket.TCP_CORK, 1)
    print("TCP socket: TCP_CORK reads back", t.getsockopt(socket.SOL_TCP, socket.TCP_CORK))


def main() -> None:
    root = "/sys/fs/cgroup/unified" if os.path.ismount("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
    cg = os.path.join(root, "quark-sockopt-probe")
    os.makedirs(cg, exist_ok=True)
    cgfd = os.open(cg, os.O_RDONLY | os.O_DIRECTORY)
    prog = load(setsockopt_program(), BPF_CGROUP_SETSOCKOPT)
    try:
        bpf(BPF_PROG_ATTACH, struct.pack("<IIII", cgfd, prog, BPF_CGROUP_SETSOCKOPT, BPF_F_ALLOW_MULTI))
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    child(cg)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
        finally:
            bpf(BPF_PROG_DETACH, struct.pack("<IIII", cgfd, prog, BPF_CGROUP_SETSOCKOPT, 0))
    finally:
        os.close(prog)
        os.close(cgfd)
        os.rmdir(cg)


if __name__ == "__main__":
    main()
