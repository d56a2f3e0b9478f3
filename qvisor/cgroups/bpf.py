"""The bpf(2) calls that put a device program on a cgroup v2 directory, via ctypes.

Errors are OSErrors whose strerror says which step failed (and, for a program the verifier
rejects, what the verifier said); the caller names the config field.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct

from qlib import syscalls

PROG_LOAD, PROG_ATTACH, PROG_DETACH, PROG_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 5, 8, 9, 13, 15, 16
PROG_TYPE_CGROUP_DEVICE = 15
CGROUP_DEVICE = 6  # enum bpf_attach_type
F_ALLOW_OVERRIDE, F_ALLOW_MULTI = 1, 2
ATTR_SIZE = 128  # larger than every union bpf_attr member used here; the kernel wants the tail zero
INSN_SIZE = 8
PROG_NAME = "quark_devices"  # how `bpftool cgroup show` and tests tell quark's program

log = logging.getLogger("quark")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array, what: str) -> int:
    try:
        nr = syscalls.number("bpf")
    except LookupError:
        raise OSError(errno.ENOSYS, f"{what}: bpf(2) is not known on {platform.machine()}") from None
    r = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr)))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return r


def _attr(fmt: str, *values: object) -> ctypes.Array:
    """A zeroed union bpf_attr with `values` packed (native layout) at its start."""
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def prog_load(insns: bytes, license: str = "Apache") -> int:
    """Load a BPF_PROG_TYPE_CGROUP_DEVICE program; its fd. A rejected program is loaded again
    with the verifier's log, so the error says why."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())
    name = PROG_NAME.encode()

    def load(log_buf: ctypes.Array | None) -> int:
        # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags, prog_name
        attr = _attr("=IIQQIIQII16s", PROG_TYPE_CGROUP_DEVICE, len(insns) // INSN_SIZE, ctypes.addressof(code),
                     ctypes.addressof(lic), 1 if log_buf else 0, len(log_buf) if log_buf else 0,
                     ctypes.addressof(log_buf) if log_buf else 0, 0, 0, name)
        return _bpf(PROG_LOAD, attr, "loading the eBPF device program")

    try:
        return load(None)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EACCES):  # what the verifier answers; EPERM is privilege
            raise
        buf = ctypes.create_string_buffer(1 << 16)
        try:
            return load(buf)
        except OSError as again:
            said = buf.value.decode(errors="replace").strip().splitlines()[-4:]
            raise OSError(again.errno, f"{again.strerror}: the verifier said: {' / '.join(said)}") from None


def prog_query(cgroup_fd: int) -> tuple[int, list[int]]:
    """The attach flags and ids of the device programs attached to this cgroup itself."""
    count = 64
    for _ in range(10):
        ids = (ctypes.c_uint32 * count)()
        # target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt
        attr = _attr("=IIIIQI", cgroup_fd, CGROUP_DEVICE, 0, 0, ctypes.addressof(ids), count)
        try:
            _bpf(PROG_QUERY, attr, "listing the cgroup's device programs")
        except OSError as e:
            if e.errno != errno.ENOSPC:  # ENOSPC: more than `count`; prog_cnt says how many
                raise
            count = struct.unpack_from("=I", attr, 24)[0]
            continue
        flags, = struct.unpack_from("=I", attr, 12)
        n, = struct.unpack_from("=I", attr, 24)
        return flags, list(ids[:n])
    raise OSError(errno.EAGAIN, "listing the cgroup's device programs: the list kept changing")


def prog_fd_by_id(prog_id: int) -> int:
    return _bpf(PROG_GET_FD_BY_ID, _attr("=I", prog_id), f"opening device program {prog_id}")


def prog_name(prog_fd: int) -> str:
    """The name a program was loaded with (struct bpf_prog_info.name, at offset 64)."""
    info = ctypes.create_string_buffer(256)
    _bpf(OBJ_GET_INFO_BY_FD, _attr("=IIQ", prog_fd, len(info), ctypes.addressof(info)), "reading a program's info")
    return info.raw[64:80].split(b"\0")[0].decode(errors="replace")


def prog_attach(cgroup_fd: int, prog_fd: int, flags: int = F_ALLOW_MULTI) -> None:
    # target_fd, attach_bpf_fd, attach_type, attach_flags
    _bpf(PROG_ATTACH, _attr("=IIII", cgroup_fd, prog_fd, CGROUP_DEVICE, flags), "attaching the device program")


def prog_detach(cgroup_fd: int, prog_fd: int) -> None:
    _bpf(PROG_DETACH, _attr("=IIII", cgroup_fd, prog_fd, CGROUP_DEVICE, 0), "detaching the old device program")


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
