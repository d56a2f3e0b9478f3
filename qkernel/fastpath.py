"""The compiled fast path (qkernel/fastpath.c), loaded with ctypes: the seccomp receiver loop that
answers TCP_NODELAY/TCP_CORK on TSoR's local-path sockets without Python and lets every sendmsg
through that carries nothing TCP would drop, and TSoR's connect-time check that a socket is not
also held elsewhere in the task.

`make install` builds qkernel/_fastpath.so (gcc). Without it, or when it is older than its source,
`load()` answers None and every trapped call goes through Python as before: same answers, slower.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

from qkernel import seccomp_notify as sn

log = logging.getLogger("quark.qkernel")

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastpath.c")
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fastpath.so")
TCP_NODELAY, TCP_CORK = 1, 3
OPTIONS = (TCP_NODELAY, TCP_CORK)


class FastPath:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._keys: dict[tuple, _OptionKeys] = {}
        lib.qfp_serve.argtypes = [ctypes.c_int, ctypes.POINTER(sn.SeccompNotif)]
        lib.qfp_serve.restype = ctypes.c_int
        lib.qfp_add.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
        lib.qfp_get.argtypes = [ctypes.c_uint64, ctypes.c_int]
        lib.qfp_set.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
        lib.qfp_remove.argtypes = [ctypes.c_uint64]
        lib.qfp_init.argtypes = [ctypes.c_int, ctypes.c_uint32]
        lib.qfp_init_send.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.qfp_end_add.argtypes = [ctypes.c_uint64]
        lib.qfp_end_remove.argtypes = [ctypes.c_uint64]
        lib.qfp_answered.restype = ctypes.c_uint64
        lib.qfp_held_elsewhere.argtypes = [ctypes.c_uint32, ctypes.c_int, ctypes.c_uint64]
        lib.qfp_sockopts.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
        lib.qfp_sockopts.restype = None

    def init(self, setsockopt_nr: int, audit_arch: int, sendmsg_nr: int = -1, sendmmsg_nr: int = -1,
             strict: bool = False) -> None:
        """`strict`: every sendmsg on a local-path end goes to Python (the kernel cannot make the ends
        refuse fds, so none may be let through to a second read of the task's msghdr)."""
        self._lib.qfp_init(setsockopt_nr, audit_arch)
        self._lib.qfp_init_send(sendmsg_nr, sendmmsg_nr, int(strict))

    # The local-path ends (by socket inode): their sendmsg calls with a control buffer go to Python.
    def end_add(self, inode: int) -> bool:
        return self._lib.qfp_end_add(inode) == 0

    def end_remove(self, inode: int) -> None:
        self._lib.qfp_end_remove(inode)

    def serve(self, listener: int) -> sn.SeccompNotif:
        """The next notification Python must answer (the fast ones are answered inside). Raises
        OSError as RECV does. ctypes releases the GIL for the call."""
        notif = sn.SeccompNotif()
        r = self._lib.qfp_serve(listener, ctypes.byref(notif))
        if r < 0:
            raise OSError(-r, os.strerror(-r))
        return notif

    # The option table of local-path sockets (by socket inode); the C loop reads and updates it.
    def add(self, inode: int, nodelay: bool, cork: bool) -> bool:
        return self._lib.qfp_add(inode, int(nodelay), int(cork)) == 0

    def remove(self, inode: int) -> None:
        self._lib.qfp_remove(inode)

    def get(self, inode: int, opt: int) -> int | None:
        v = self._lib.qfp_get(inode, opt)
        return None if v < 0 else v

    def set(self, inode: int, opt: int, value: bool) -> bool:
        return self._lib.qfp_set(inode, opt, int(value)) == 0

    def held_elsewhere(self, pid: int, fd: int, ino: int) -> bool:
        """tsor/kernel_sockets.py's held_elsewhere, compiled: is the socket at the task's fd also another fd
        of the task, or in one of its epoll sets (or are its fds unreadable)?"""
        return self._lib.qfp_held_elsewhere(pid, fd, ino) != 0

    def sockopts(self, fd: int, keys: tuple[tuple[int, int], ...]) -> list[bytes | None]:
        """getsockopt(fd, level, opt) of every (level, opt) of `keys`, at most 64 bytes each, in
        one call; None where the socket refuses the option. One caller at a time (the supervisor's
        loop): the buffers are kept per `keys`."""
        keys = self._keys.get(keys) or self._keys.setdefault(keys, _OptionKeys(keys))
        self._lib.qfp_sockopts(fd, keys.n, keys.levels, keys.opts, keys.vals, keys.lens)
        raw, out = keys.vals.raw, []
        for i, n in enumerate(keys.lens):
            out.append(raw[i * 64:i * 64 + n] if n >= 0 else None)
        return out

    @property
    def answered(self) -> int:
        return self._lib.qfp_answered()


class _OptionKeys:
    """A fixed list of (level, optname) for `FastPath.sockopts`, with the buffers it fills."""

    def __init__(self, keys: tuple[tuple[int, int], ...]) -> None:
        self.n = len(keys)
        self.levels = (ctypes.c_int * self.n)(*(k[0] for k in keys))
        self.opts = (ctypes.c_int * self.n)(*(k[1] for k in keys))
        self.vals = ctypes.create_string_buffer(64 * self.n)
        self.lens = (ctypes.c_int * self.n)()


@cache
def load() -> FastPath | None:
    """The fast path, or None (not built, stale, or not loadable here)."""
    try:
        if os.stat(LIBRARY).st_mtime < os.stat(_SRC).st_mtime:
            log.warning("%s is older than its source (run make install); trapped calls all go through Python",
                        LIBRARY)
            return None
        return FastPath(ctypes.CDLL(LIBRARY))
    except OSError as e:
        log.debug("no compiled fast path (%s); trapped calls all go through Python", e)
        return None
