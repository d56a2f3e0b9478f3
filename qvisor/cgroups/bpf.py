"""The device program on a cgroup v2 directory (the bpf(2) calls are qlib/bpf.py's).

Errors are OSErrors whose strerror says which step failed (and, for a program the verifier
rejects, what the verifier said); the caller names the config field.
"""
from __future__ import annotations

import errno
import logging
import os

from qlib import bpf
from qlib.bpf import CGROUP_DEVICE, F_ALLOW_MULTI

PROG_NAME = "quark_devices"  # how `bpftool cgroup show` and tests tell quark's program

log = logging.getLogger("quark")


def prog_load(insns: bytes, license: str = "Apache") -> int:
    """Load a BPF_PROG_TYPE_CGROUP_DEVICE program; its fd (a rejected one: the verifier's words)."""
    return bpf.load(bpf.PROG_TYPE_CGROUP_DEVICE, insns, PROG_NAME, license=license)


def prog_query(cgroup_fd: int) -> tuple[int, list[int]]:
    """The attach flags and ids of the device programs attached to this cgroup itself."""
    return bpf.query(cgroup_fd, CGROUP_DEVICE, "listing the cgroup's device programs")


def prog_fd_by_id(prog_id: int) -> int:
    return bpf.prog_by_id(prog_id)


def prog_name(prog_fd: int) -> str:
    return bpf.prog_info(prog_fd)[0]


def prog_attach(cgroup_fd: int, prog_fd: int, flags: int = F_ALLOW_MULTI) -> None:
    bpf.attach(cgroup_fd, prog_fd, CGROUP_DEVICE, flags, "attaching the device program")


def prog_detach(cgroup_fd: int, prog_fd: int) -> None:
    bpf.detach(cgroup_fd, prog_fd, CGROUP_DEVICE, "detaching the old device program")


def replace_device_program(cgroup_dir: str, insns: bytes) -> None:
    """Load `insns` and make it the cgroup's only device program, as runc does: attach it with
    BPF_F_ALLOW_MULTI, then detach the ones that were there, so that there is never a moment
    without a filter (for a moment both apply, which only denies more)."""
    try:
        cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"opening {cgroup_dir}: {e.strerror}") from None
    old: list[int] = []
    prog = -1
    try:
        flags, ids = prog_query(cg)
        if ids and not flags & F_ALLOW_MULTI:
            # The kernel refuses a multi program next to an exclusive one (runc fails there too);
            # detaching it first would leave the cgroup unfiltered.
            raise OSError(errno.EPERM, f"{cgroup_dir} has a device program attached without BPF_F_ALLOW_MULTI "
                                       "(not quark's); detach it first")
        for prog_id in ids:
            try:
                old.append(prog_fd_by_id(prog_id))
            except OSError as e:
                # Gone meanwhile, or hidden from us by an LSM (runc skips those too: one more
                # filter can only deny more).
                if e.errno not in (errno.ENOENT, errno.EPERM, errno.EACCES):
                    raise
                log.debug("device program %d left attached to %s: %s", prog_id, cgroup_dir, e.strerror)
        prog = prog_load(insns)
        prog_attach(cg, prog)
        for fd in old:
            try:
                prog_detach(cg, fd)
            except FileNotFoundError:
                pass  # detached meanwhile
    finally:
        for fd in old + ([prog] if prog >= 0 else []) + [cg]:
            os.close(fd)
