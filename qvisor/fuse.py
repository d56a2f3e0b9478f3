"""A FUSE file server in pure Python, for the supervisor's single-threaded event loop.

Just enough of the kernel's wire protocol (include/uapi/linux/fuse.h) to serve one flat, read-only
directory of generated files: the /proc view (qvisor/procview.py). No libfuse, no threads, no
splice. /dev/fuse is pollable and each read returns one whole request, so the fd sits in the loop
like any other and every request is answered as soon as it is read.

Files are opened with FOPEN_DIRECT_IO, so every read() of the container reaches us (no page cache).
A read at offset 0 makes the text afresh and keeps it with the open file, so a reader paging
through with several reads sees one consistent text. A file's size is its text's: since Linux 6.5
the kernel splices (sendfile, which busybox cat uses) even a direct-io FUSE file through the page
cache, bounded by the size, so a size of 0 as /proc has would read as empty there. Attributes are
never cached (TTL 0), so each open refreshes them (default_permissions asks before every open):
GETATTR makes the text to tell its size, and the OPEN right after it serves that same text.

The filesystem is made by the supervisor (host root) with the new mount API and handed to the
container's init as a detached mount (`mount_detached`): the init could not open /dev/fuse itself,
since the device cgroup the container's init already lives in allows no such device.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import time
from collections.abc import Callable

from qlib import syscalls
from qlib.libc import check
from qlib.libc import libc as _libc

# opcodes
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE = 1, 2, 3, 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR = 22, 23, 25, 26, 27, 28, 29
ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 34, 36, 38, 42
_NO_REPLY = (FORGET, BATCH_FORGET, INTERRUPT)   # the kernel expects no answer to these

KERNEL_VERSION = 7
MINOR = 31            # what we speak; the kernel's INIT says what it speaks, and the lower wins
_MIN_MINOR = 9        # the struct sizes below (fuse_entry_out, fuse_attr_out) are those from 7.9 on
FOPEN_DIRECT_IO = 1
MAX_WRITE = 4096      # nothing is ever written; the smallest value the kernel takes
# a read of /dev/fuse must offer max(8 KiB, header + max_write); requests here are tiny
BUFFER = 16384
BATCH = 64            # requests handled per wake-up before the loop serves its other fds
TTL = 86400           # the names never change: let the kernel keep them (attributes: see above)
FRESH = 1.0           # seconds a text made for GETATTR is still served to the OPEN that follows

ROOT = 1
_IN = struct.Struct("=IIQQIIIHH")       # fuse_in_header: len opcode unique nodeid uid gid pid extlen pad
_OUT = struct.Struct("=IiQ")            # fuse_out_header: len error unique
_ATTR = struct.Struct("=QQQQQQIIIIIIIIII")  # fuse_attr: ino size blocks a/m/ctime a/m/cnsec mode nlink
#                                            uid gid rdev blksize flags
_ENTRY = struct.Struct("=QQQQII")       # fuse_entry_out before its attr
_ATTR_OUT = struct.Struct("=QII")       # fuse_attr_out before its attr
_OPEN_OUT = struct.Struct("=QIi")       # fh open_flags backing_id
_OPEN_IN = struct.Struct("=II")         # flags open_flags
_READ_IN = struct.Struct("=QQI")        # fh offset size (then flags we do not need)
_FH = struct.Struct("=Q")               # the fh that leads fuse_release_in
_INIT_IN = struct.Struct("=IIII")       # major minor max_readahead flags
_INIT_OUT = struct.Struct("=IIIIHHII")  # major minor max_readahead flags max_background
#                                         congestion_threshold max_write time_gran (then zeros)
_INIT_OUT_SIZE = 64                     # since 7.23; 24 bytes before
_STATFS = struct.Struct("=QQQQQIII")    # blocks bfree bavail files ffree bsize namelen frsize
_STATFS_SIZE = 80
_DIRENT = struct.Struct("=QQII")        # ino off namelen type, then the name padded to 8 bytes


class Server:
    """Serves `files` (name -> a function making the file's content) at the root of one FUSE
    connection, `fd` (a non-blocking /dev/fuse fd; the caller owns and closes it)."""

    def __init__(self, fd: int, files: dict[str, Callable[[], bytes]]) -> None:
        self.fd = fd
        self.files = files
        self.names = list(files)          # node id 2 + i is names[i]
        self.open: dict[int, list] = {}   # file handle -> [node id, its text, whether it is unread]
        self.sized: dict[int, tuple[float, bytes]] = {}   # node id -> (when, text) its last GETATTR made
        self.next_fh = 1
        self.minor = 0
        self.buf = bytearray(BUFFER)
        self.mtime = int(time.time())

    def on_readable(self) -> bool:
        """Answer the requests waiting; False once the connection is gone (the filesystem was
        unmounted everywhere, or aborted): the caller then stops watching and closes the fd."""
        for _ in range(BATCH):
            try:
                n = os.readv(self.fd, [self.buf])
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:   # the request was interrupted before we could read it
                    continue
                return False                  # ENODEV: no filesystem uses this connection any more
            if n == 0:
                return False
            if not self._dispatch(memoryview(self.buf)[:n]):
                return False
        return True

    # ---- requests -----------------------------------------------------------------------------

    def _dispatch(self, req: memoryview) -> bool:
        _, opcode, unique, node, _, _, _, _, _ = _IN.unpack_from(req)
        body = req[_IN.size:]
        if opcode in _NO_REPLY:
            return True   # FORGET: the nodes are fixed; INTERRUPT: every request is answered at once
        handler = _HANDLERS.get(opcode)
        try:
            reply = handler(self, node, body) if handler else -errno.ENOSYS
        except (struct.error, ValueError, KeyError):
            reply = -errno.EINVAL
        except OSError:   # a source of the generated text failed: the reader gets EIO
            reply = -errno.EIO
        return self._reply(unique, reply)

    def _reply(self, unique: int, reply: bytes | int) -> bool:
        if isinstance(reply, int):
            data = _OUT.pack(_OUT.size, reply, unique)
        else:
            data = _OUT.pack(_OUT.size + len(reply), 0, unique) + reply
        try:
            os.write(self.fd, data)
        except OSError as e:
            return e.errno != errno.ENODEV   # ENOENT: the request was aborted meanwhile
        return True

    def _attr(self, node: int, size: int = 0) -> bytes:
        if node == ROOT:
            mode, nlink = stat.S_IFDIR | 0o555, 2
        elif self._is_file(node):
            mode, nlink = stat.S_IFREG | 0o444, 1
        else:
            raise KeyError(node)
        t = self.mtime
        return _ATTR.pack(node, size, (size + 511) // 512, t, t, t, 0, 0, 0, mode, nlink, 0, 0, 0, 4096, 0)

    def _is_file(self, node: int) -> bool:
        return 2 <= node < 2 + len(self.names)

    def _make(self, node: int) -> bytes:
        return self.files[self.names[node - 2]]()

    def _init(self, node: int, body: memoryview) -> bytes | int:
        major, minor, readahead, _ = _INIT_IN.unpack_from(body)
        if major != KERNEL_VERSION or minor < _MIN_MINOR:
            return -errno.EPROTO
        self.minor = min(minor, MINOR)
        out = _INIT_OUT.pack(KERNEL_VERSION, self.minor, readahead, 0, 0, 0, MAX_WRITE, 1)
        return out.ljust(_INIT_OUT_SIZE, b"\0") if self.minor >= 23 else out[:24]

    def _lookup(self, node: int, body: memoryview) -> bytes | int:
        name = bytes(body).split(b"\0", 1)[0].decode(errors="replace")
        if node != ROOT or name not in self.files:
            return -errno.ENOENT
        child = 2 + self.names.index(name)
        return _ENTRY.pack(child, 0, TTL, 0, 0, 0) + self._attr(child)   # size: asked again before use

    def _getattr(self, node: int, body: memoryview) -> bytes | int:
        if node != ROOT and not self._is_file(node):
            return -errno.ENOENT
        size = 0
        if self._is_file(node):
            text = self._make(node)
            self.sized[node] = (time.monotonic(), text)
            size = len(text)
        return _ATTR_OUT.pack(0, 0, 0) + self._attr(node, size)

    def _open(self, node: int, body: memoryview) -> bytes | int:
        flags, _ = _OPEN_IN.unpack_from(body)
        if not self._is_file(node):
            return -errno.EISDIR if node == ROOT else -errno.ENOENT
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            return -errno.EACCES   # root passes default_permissions' mode check: refuse writers here
        when, text = self.sized.pop(node, (0.0, None))
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        self.open[fh] = [node, text if time.monotonic() - when < FRESH else None, True]
        return _OPEN_OUT.pack(fh, FOPEN_DIRECT_IO, 0)

    def _read(self, node: int, body: memoryview) -> bytes | int:
        fh, offset, size = _READ_IN.unpack_from(body)
        handle = self.open.get(fh)
        if handle is None:
            return -errno.EBADF
        # afresh at offset 0 (a reader that keeps the file open and reads it again from the start
        # wants new figures), except for the first read, which gets the text its size was told from
        if handle[1] is None or (offset == 0 and not handle[2]):
            handle[1] = self._make(handle[0])
        handle[2] = False
        return handle[1][offset:offset + size]

    def _release(self, node: int, body: memoryview) -> bytes | int:
        (fh,) = _FH.unpack_from(body)
        self.open.pop(fh, None)
        return b""

    def _opendir(self, node: int, body: memoryview) -> bytes | int:
        return _OPEN_OUT.pack(0, 0, 0) if node == ROOT else -errno.ENOTDIR

    def _readdir(self, node: int, body: memoryview) -> bytes | int:
        _, offset, size = _READ_IN.unpack_from(body)
        if node != ROOT:
            return -errno.ENOTDIR
        entries = [(ROOT, ".", stat.S_IFDIR), (ROOT, "..", stat.S_IFDIR)] + \
            [(2 + i, name, stat.S_IFREG) for i, name in enumerate(self.names)]
        out = b""
        for i in range(offset, len(entries)):
            ino, name, kind = entries[i]
            raw = name.encode()
            ent = _DIRENT.pack(ino, i + 1, len(raw), kind >> 12) + raw
            ent += b"\0" * (-len(ent) % 8)
            if len(out) + len(ent) > size:
                break
            out += ent
        return out

    def _statfs(self, node: int, body: memoryview) -> bytes | int:
        return _STATFS.pack(0, 0, 0, len(self.names) + 1, 0, 4096, 255, 4096).ljust(_STATFS_SIZE, b"\0")

    def _ok(self, node: int, body: memoryview) -> bytes | int:
        return b""

    def _unsupported(self, node: int, body: memoryview) -> bytes | int:
        # ENOSYS is remembered: the kernel stops asking (FLUSH on every close, the xattr calls)
        return -errno.ENOSYS


_HANDLERS = {
    INIT: Server._init, LOOKUP: Server._lookup, GETATTR: Server._getattr, OPEN: Server._open,
    READ: Server._read, RELEASE: Server._release, OPENDIR: Server._opendir, READDIR: Server._readdir,
    RELEASEDIR: Server._ok, STATFS: Server._statfs, ACCESS: Server._ok, DESTROY: Server._ok,
    FLUSH: Server._unsupported, GETXATTR: Server._unsupported, LISTXATTR: Server._unsupported,
}


# ---- making the filesystem (the new mount API: same numbers on every architecture) -------------

_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = (syscalls.number(n) for n in ("fsopen", "fsconfig", "fsmount"))
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 1
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8


def _fsconfig(fs: int, cmd: int, key: str | None = None, value: str | None = None) -> None:
    check(_libc.syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(cmd), key and key.encode(),
                         value and value.encode(), ctypes.c_int(0)), f"fsconfig {key or 'create'}")


def open_device() -> int:
    """A non-blocking /dev/fuse: the server's end of a new connection."""
    try:
        return os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"/dev/fuse: {e.strerror}") from None


def mount_detached(dev: int, source: str) -> int:
    """A FUSE filesystem on connection `dev`, as a detached mount (an fd, attached nowhere yet):
    read-only, nosuid, nodev, noexec, its root a 0555 directory owned by root; allow_other so any
    user of the container may read it, default_permissions so the kernel checks the modes.
    The kernel's INIT request waits on `dev`: nothing that looks up a name in the filesystem can
    finish until the server answers it."""
    fs = check(_libc.syscall(_SYS_FSOPEN, b"fuse", ctypes.c_uint(_FSOPEN_CLOEXEC)), "fsopen fuse")
    try:
        for key, value in (("source", source), ("fd", str(dev)), ("rootmode", "40555"), ("user_id", "0"),
                           ("group_id", "0")):
            _fsconfig(fs, _FSCONFIG_SET_STRING, key, value)
        for flag in ("allow_other", "default_permissions"):
            _fsconfig(fs, _FSCONFIG_SET_FLAG, flag)
        _fsconfig(fs, _FSCONFIG_CMD_CREATE)
        attrs = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC
        return check(_libc.syscall(_SYS_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(_FSMOUNT_CLOEXEC),
                                    ctypes.c_uint(attrs)), "fsmount")
    finally:
        os.close(fs)
