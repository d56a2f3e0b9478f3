"""The thin layer over bpf(2) quark needs: load a program, make maps and read and write their
entries, attach programs to a cgroup or a map and find what is attached there.

No compiler is involved: quark's programs are a few dozen instructions, assembled in Python (the
cgroup v2 device filter, qvisor/cgroups/devicefilter.py; TSoR's socket-option programs with `Asm`,
tsor/sockopt_offload.py). Each function raises OSError whose message says which step failed; `load`
adds the verifier's complaint, the only way to know why a program was refused.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

from qlib import syscalls

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_ATTR_SIZE = 128   # sizeof(union bpf_attr) is larger; the kernel zero-checks the tail we pass

# commands (linux/bpf.h)
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY = 0, 1, 2, 3, 4
PROG_LOAD, PROG_ATTACH, PROG_DETACH = 5, 8, 9
PROG_GET_FD_BY_ID, MAP_GET_FD_BY_ID, OBJ_GET_INFO_BY_FD, PROG_QUERY, BTF_LOAD = 13, 14, 15, 16, 18
MAP_TYPE_SK_STORAGE = 24
F_NO_PREALLOC = 1
SK_STORAGE_GET_F_CREATE = 1
PROG_TYPE_CGROUP_DEVICE, PROG_TYPE_CGROUP_SOCKOPT = 15, 25
CGROUP_DEVICE, CGROUP_GETSOCKOPT, CGROUP_SETSOCKOPT = 6, 21, 22   # enum bpf_attach_type
F_ALLOW_OVERRIDE, F_ALLOW_MULTI = 1, 2

# instruction classes and modes, as the kernel's filter.h composes them
LDX_W, LDX_DW, STX_W, ST_W = 0x61, 0x79, 0x63, 0x62
MOV64_X, MOV64_K, ADD64_K, AND64_X, OR64_X, XOR64_K = 0xBF, 0xB7, 0x07, 0x5F, 0x4F, 0xA7
JEQ_K, JNE_K, JSLT_K, JGT_X, JA = 0x15, 0x55, 0xC5, 0x2D, 0x05
CALL, EXIT, LD_IMM64 = 0x85, 0x95, 0x18
PSEUDO_MAP_FD = 1
FUNC_SK_STORAGE_GET = 107


def _bpf(cmd: int, attr: bytes | ctypes.Array, what: str) -> int:
    buf = attr if isinstance(attr, ctypes.Array) else ctypes.create_string_buffer(attr, _ATTR_SIZE)
    try:
        nr = syscalls.number("bpf")
    except LookupError:
        raise OSError(errno.ENOSYS, f"{what}: bpf(2) is not known on {platform.machine()}") from None
    ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), buf, ctypes.c_uint(len(buf)))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _attr(fmt: str, *values: object) -> ctypes.Array:
    """A zeroed union bpf_attr with `values` packed at its start."""
    attr = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into(fmt, attr, 0, *values)
    return attr


class Asm:
    """eBPF instructions with named jump targets: `j(op, dst, imm, label)` jumps to where
    `label(name)` was placed (resolved by `code()`)."""

    def __init__(self) -> None:
        self._insns: list[list] = []      # [code, dst, src, off or label, imm]
        self._labels: dict[str, int] = {}

    def __call__(self, code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> Asm:
        self._insns.append([code, dst, src, off, imm])
        return self

    def j(self, code: int, dst: int, imm: int, target: str, src: int = 0) -> Asm:
        return self(code, dst, src, target, imm)

    def label(self, name: str) -> Asm:
        self._labels[name] = len(self._insns)
        return self

    def map_fd(self, dst: int, fd: int) -> Asm:
        """dst = the map whose fd is `fd` (a two-slot load the kernel rewrites to the map's address)."""
        self(LD_IMM64, dst, PSEUDO_MAP_FD, 0, fd)
        return self(0, 0, 0, 0, 0)

    def code(self) -> bytes:
        out = []
        for pc, (code, dst, src, off, imm) in enumerate(self._insns):
            if isinstance(off, str):
                off = self._labels[off] - pc - 1
            out.append(struct.pack("<BBhi", code, (src << 4) | dst, off, imm))
        return b"".join(out)


def load(prog_type: int, insns: bytes, name: str, attach_type: int = 0, license: str = "GPL") -> int:
    """Load a program; its fd. A program the verifier rejects is loaded again with the verifier's
    log, so that the error says why."""
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license.encode())

    def attempt(log: ctypes.Array | None) -> int:
        # prog_type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version, prog_flags,
        # prog_name, prog_ifindex, expected_attach_type
        attr = _attr("<IIQQIIQII16sII", prog_type, len(insns) // 8, ctypes.addressof(code), ctypes.addressof(lic),
                     1 if log else 0, len(log) if log else 0, ctypes.addressof(log) if log else 0, 0, 0,
                     name.encode()[:15], 0, attach_type)
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


def _int_btf() -> bytes:
    """A BTF blob of one type, [1] = a signed 32-bit int: what a socket storage map must name for
    its key and value (the kernel insists on BTF there; nothing else of BTF is needed)."""
    types = struct.pack("<III", 1, 1 << 24, 4) + struct.pack("<I", (1 << 24) | 32)   # "int", KIND_INT, signed 32
    strings = b"\0int\0"
    return struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings)) + types + strings


def sk_storage_map(name: str) -> int:
    """A socket-local storage map of one int per socket (freed with the socket); its fd."""
    blob = _int_btf()
    buf = ctypes.create_string_buffer(blob, len(blob))
    btf = _bpf(BTF_LOAD, _attr("<QQIII", ctypes.addressof(buf), 0, len(blob), 0, 0), "loading BTF")
    try:
        # map_type, key_size, value_size, max_entries, map_flags, inner_map_fd, numa_node, map_name,
        # map_ifindex, btf_fd, btf_key_type_id, btf_value_type_id
        return _bpf(MAP_CREATE, _attr("<IIIIIII16sIIII", MAP_TYPE_SK_STORAGE, 4, 4, 0, F_NO_PREALLOC, 0, 0,
                                      name.encode()[:15], 0, btf, 1, 1), f"making the map {name}")
    finally:
        os.close(btf)


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
    map_ids = (ctypes.c_uint32 * 4)()
    info = ctypes.create_string_buffer(256)
    struct.pack_into("<IQ", info, 52, len(map_ids), ctypes.addressof(map_ids))   # nr_map_ids @52, map_ids @56
    _bpf(OBJ_GET_INFO_BY_FD, _attr("<IIQ", prog_fd, len(info), ctypes.addressof(info)), "reading a program's info")
    nr = struct.unpack_from("<I", info.raw, 52)[0]
    name = info.raw[64:80].split(b"\0", 1)[0].decode(errors="replace")
    return name, list(map_ids[:min(nr, len(map_ids))])


def map_create(map_type: int, key_size: int, value_size: int, max_entries: int, name: str, flags: int = 0) -> int:
    """A map without BTF (hash, array, sockhash, ...); its fd."""
    return _bpf(MAP_CREATE, _attr("<IIIIIII16s", map_type, key_size, value_size, max_entries, flags, 0, 0,
                                  name.encode()[:15]), f"making the map {name}")


def map_info(map_fd: int) -> tuple[int, int, str]:
    """A map's type, key size and name (struct bpf_map_info)."""
    info = ctypes.create_string_buffer(96)
    _bpf(OBJ_GET_INFO_BY_FD, _attr("<IIQ", map_fd, len(info), ctypes.addressof(info)), "reading a map's info")
    map_type, _, key_size = struct.unpack_from("<III", info.raw, 0)
    return map_type, key_size, info.raw[24:40].split(b"\0", 1)[0].decode(errors="replace")


def map_by_id(map_id: int) -> int:
    return _bpf(MAP_GET_FD_BY_ID, _attr("<I", map_id), f"opening map {map_id}")


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
