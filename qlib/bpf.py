"""The thin layer over bpf(2) quark needs: load an assembled program, read and write map entries,
attach programs to a cgroup or a map and find what is attached there; and the one eBPF instruction
encoder, `insn`.

Two kinds of program reach the kernel. The cgroup v2 device filter is assembled in Python from the
bundle's rules (qvisor/cgroups/devicefilter.py, with `insn`, as crun assembles its own in C) and
loaded by `load`. TSoR's programs are C (tsor/bpf/*.bpf.c), compiled by `make install` and loaded
with libbpf (qlib/libbpf.py); they are attached and their maps read here. Each function raises
OSError whose message says which step failed; `load` adds the verifier's complaint, the only way to
know why a program was refused.
"""
from __future__ import annotations

import ctypes
import errno
import platform
import struct

from qlib import syscalls
from qlib.libc import check, libc

_ATTR_SIZE = 128   # sizeof(union bpf_attr) is larger; the kernel zero-checks the tail we pass

# commands (linux/bpf.h)
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
MAP_TYPE_HASH = 1
F_NO_PREALLOC = 1
PROG_LOAD, PROG_ATTACH, PROG_DETACH = 5, 8, 9
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY = 13, 14, 15, 16
PROG_TYPE_CGROUP_DEVICE = 15
CGROUP_DEVICE, CGROUP_GETSOCKOPT, CGROUP_SETSOCKOPT = 6, 21, 22   # enum bpf_attach_type
F_ALLOW_MULTI = 2

# eBPF opcodes: class | operation | source (include/uapi/linux/bpf_common.h, bpf.h)
LDX_MEM_W = 0x01 | 0x60 | 0x00     # BPF_LDX | BPF_MEM | BPF_W
ALU32_AND_K = 0x04 | 0x50 | 0x00   # BPF_ALU | BPF_AND | BPF_K
ALU32_RSH_K = 0x04 | 0x70 | 0x00
ALU32_MOV_X = 0x04 | 0xb0 | 0x08   # BPF_X: the source is a register
ALU64_MOV_K = 0x07 | 0xb0 | 0x00
JEQ_K = 0x05 | 0x10 | 0x00         # BPF_JMP | BPF_JEQ | BPF_K
JNE_K = 0x05 | 0x50 | 0x00
JSET_K = 0x05 | 0x40 | 0x00
EXIT = 0x05 | 0x90
R0, R1, R2, R3, R4, R5 = range(6)


def _bpf(cmd: int, attr: bytes | ctypes.Array, what: str) -> int:
    buf = attr if isinstance(attr, ctypes.Array) else ctypes.create_string_buffer(attr, _ATTR_SIZE)
    try:
        nr = syscalls.number("bpf")
    except LookupError:
        raise OSError(errno.ENOSYS, f"{what}: bpf(2) is not known on {platform.machine()}") from None
    return check(libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), buf, ctypes.c_uint(len(buf))), what)


def _attr(fmt: str, *values: object) -> ctypes.Array:
    """A zeroed union bpf_attr with `values` packed at its start."""
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into(fmt, attr, 0, *values)
    return attr


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One struct bpf_insn: u8 code, u8 dst_reg:4 (low nibble) src_reg:4, s16 off, s32 imm.
    An imm of 2**31 or more is stored as its 32-bit two's complement: a 64-bit jump then sees
    it sign-extended and never equal to a u32 register, as no real device number (12 bits of
    major, 20 of minor) equals it either."""
    if imm > 0x7fffffff:
        imm -= 1 << 32
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def load(prog_type: int, insns: bytes, name: str, license: str = "GPL") -> int:
    """Load a program; its fd. A program the verifier rejects is loaded again with the verifier's
    log, so that the error says why."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())

    def attempt(log: ctypes.Array | None) -> int:
        # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags, prog_name
        attr = _attr("<IIQQIIQII16s", prog_type, len(insns) // 8, ctypes.addressof(code), ctypes.addressof(lic),
                     1 if log else 0, len(log) if log else 0, ctypes.addressof(log) if log else 0, 0, 0,
                     name.encode()[:15])
        return _bpf(PROG_LOAD, attr, f"loading the eBPF program {name}")

    try:
        return attempt(None)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EACCES):   # what the verifier answers; EPERM is privilege
            raise
        log = ctypes.create_string_buffer(1 << 16)
        try:
            return attempt(log)
        except OSError as again:
            said = log.value.decode(errors="replace").strip().splitlines()[-4:]
            raise OSError(again.errno, f"{again.strerror}: the verifier said: {' / '.join(said)}") from None


def attach(cgroup_fd: int, prog_fd: int, attach_type: int, flags: int = 0, what: str = "attaching a program") -> None:
    """flags 0: the cgroup's only program of that type (a second attach replaces it)."""
    _bpf(PROG_ATTACH, _attr("<IIII", cgroup_fd, prog_fd, attach_type, flags), what)


def detach(cgroup_fd: int, prog_fd: int, attach_type: int, what: str = "detaching a program") -> None:
    _bpf(PROG_DETACH, _attr("<IIII", cgroup_fd, prog_fd, attach_type, 0), what)


def query(cgroup_fd: int, attach_type: int, what: str = "listing a cgroup's programs") -> tuple[int, list[int]]:
    """The attach flags and ids of the programs attached to the cgroup itself (not inherited ones)."""
    count = 64
    for _ in range(10):
        ids = (ctypes.c_uint32 * count)()
        # target_fd, attach_type, query_flags, attach_flags, prog_ids, prog_cnt
        attr = _attr("<IIIIQI", cgroup_fd, attach_type, 0, 0, ctypes.addressof(ids), count)
        try:
            _bpf(PROG_QUERY, attr, what)
        except OSError as e:
            if e.errno != errno.ENOSPC:   # ENOSPC: more than `count`; prog_cnt says how many
                raise
            count = struct.unpack_from("<I", attr, 24)[0]
            continue
        flags, = struct.unpack_from("<I", attr, 12)
        n, = struct.unpack_from("<I", attr, 24)
        return flags, list(ids[:n])
    raise OSError(errno.EAGAIN, f"{what}: the list kept changing")


def prog_by_id(prog_id: int) -> int:
    return _bpf(PROG_GET_FD_BY_ID, _attr("<I", prog_id), f"opening program {prog_id}")


def prog_info(prog_fd: int) -> tuple[str, list[int]]:
    """A loaded program's name and the ids of the maps it uses (struct bpf_prog_info)."""
    map_ids = (ctypes.c_uint32 * 16)()   # (quark's programs use at most 5)
    info = ctypes.create_string_buffer(256)
    struct.pack_into("<IQ", info, 52, len(map_ids), ctypes.addressof(map_ids))   # nr_map_ids @52, map_ids @56
    _bpf(OBJ_GET_INFO_BY_FD, _attr("<IIQ", prog_fd, len(info), ctypes.addressof(info)), "reading a program's info")
    nr = struct.unpack_from("<I", info.raw, 52)[0]
    name = info.raw[64:80].split(b"\0", 1)[0].decode(errors="replace")
    return name, list(map_ids[:min(nr, len(map_ids))])


def map_info(map_fd: int) -> tuple[int, int, str]:
    """A map's type, key size and name (struct bpf_map_info)."""
    info = ctypes.create_string_buffer(96)
    _bpf(OBJ_GET_INFO_BY_FD, _attr("<IIQ", map_fd, len(info), ctypes.addressof(info)), "reading a map's info")
    map_type, _, key_size = struct.unpack_from("<III", info.raw, 0)
    return map_type, key_size, info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")


def map_by_id(map_id: int) -> int:
    return _bpf(MAP_GET_FD_BY_ID, _attr("<I", map_id), f"opening map {map_id}")


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, flags: int = 0,
               name: str = "") -> int:
    """A new map's fd (close it when done): e.g. a hash map as a BPF object file declares one."""
    return _bpf(MAP_CREATE, _attr("<IIIIIII16s", map_type, key_size, value_size, max_entries, flags, 0, 0,
                                  name.encode()[:15]), f"creating map {name or '(unnamed)'}")


def full(e: OSError) -> bool:
    """Whether a failed map_update means the map has no room (a hash map answers E2BIG, a
    preallocated one ENOMEM)."""
    return e.errno in (errno.E2BIG, errno.ENOSPC, errno.ENOMEM)


def map_update(map_fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    _bpf(MAP_UPDATE_ELEM, _attr("<IxxxxQQQ", map_fd, ctypes.addressof(k), ctypes.addressof(v), flags),
         "updating a map entry")


def map_delete(map_fd: int, key: bytes) -> bool:
    """False when there was no such entry."""
    k = ctypes.create_string_buffer(key, len(key))
    try:
        _bpf(MAP_DELETE_ELEM, _attr("<IxxxxQ", map_fd, ctypes.addressof(k)), "deleting a map entry")
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def map_lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value_size)
    try:
        _bpf(MAP_LOOKUP_ELEM, _attr("<IxxxxQQ", map_fd, ctypes.addressof(k), ctypes.addressof(v)),
             "reading a map entry")
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        raise
    return v.raw


def map_keys(map_fd: int, key_size: int) -> list[bytes]:
    """Every key of a hash-like map (sockhash included), in the kernel's order."""
    keys: list[bytes] = []
    prev = None
    nxt = ctypes.create_string_buffer(key_size)
    while True:
        k = ctypes.create_string_buffer(prev, key_size) if prev is not None else None
        try:
            _bpf(MAP_GET_NEXT_KEY, _attr("<IxxxxQQ", map_fd, ctypes.addressof(k) if k is not None else 0,
                                         ctypes.addressof(nxt)), "listing a map's keys")
        except OSError as e:
            if e.errno == errno.ENOENT:
                return keys
            raise
        prev = nxt.raw
        keys.append(prev)
