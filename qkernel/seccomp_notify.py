"""The seccomp user-notification ioctls (linux/seccomp.h), as thin as they can be."""
from __future__ import annotations

import ctypes
import fcntl

SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
SECCOMP_ADDFD_FLAG_SETFD = 1
SECCOMP_ADDFD_FLAG_SEND = 2
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP = 1


class SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int32), ("arch", ctypes.c_uint32),
                ("instruction_pointer", ctypes.c_uint64), ("args", ctypes.c_uint64 * 6)]


class SeccompNotif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", SeccompData)]


class SeccompNotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class SeccompNotifAddfd(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("srcfd", ctypes.c_uint32),
                ("newfd", ctypes.c_uint32), ("newfd_flags", ctypes.c_uint32)]


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("!") << 8) | nr


_IOW, _IOWR = 1, 3
NOTIF_RECV = _ioc(_IOWR, 0, ctypes.sizeof(SeccompNotif))
NOTIF_SEND = _ioc(_IOWR, 1, ctypes.sizeof(SeccompNotifResp))
NOTIF_ID_VALID = _ioc(_IOW, 2, ctypes.sizeof(ctypes.c_uint64))
NOTIF_ADDFD = _ioc(_IOW, 3, ctypes.sizeof(SeccompNotifAddfd))
NOTIF_SET_FLAGS = _ioc(_IOW, 4, ctypes.sizeof(ctypes.c_uint64))


def sync_wake_up(listener: int) -> bool:
    """SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP (Linux 6.6): the kernel hands the CPU straight from the
    trapping task to the supervisor and back (a switch on the same CPU instead of two cross-CPU
    wake-ups). False where the kernel does not know the flag."""
    try:
        fcntl.ioctl(listener, NOTIF_SET_FLAGS, SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)   # by value, not by pointer
    except OSError:
        return False
    return True


def recv(listener: int) -> SeccompNotif:
    """Raises OSError(ENOENT) if the task went away between poll and receive."""
    notif = SeccompNotif()   # the kernel requires it zeroed
    fcntl.ioctl(listener, NOTIF_RECV, notif, True)
    return notif


def send(listener: int, notif_id: int, val: int = 0, error: int = 0, flags: int = 0) -> None:
    """`error` is a negative errno or 0. Raises OSError(ENOENT) if the notification was abandoned."""
    fcntl.ioctl(listener, NOTIF_SEND, SeccompNotifResp(notif_id, val, error, flags), True)


def id_valid(listener: int, notif_id: int) -> bool:
    try:
        fcntl.ioctl(listener, NOTIF_ID_VALID, ctypes.c_uint64(notif_id), True)
    except OSError:
        return False
    return True


def addfd(listener: int, notif_id: int, srcfd: int, newfd: int = 0, flags: int = 0,
          newfd_flags: int = 0) -> int:
    """Install a dup of our `srcfd` in the task; returns its fd number there."""
    return fcntl.ioctl(listener, NOTIF_ADDFD,
                       SeccompNotifAddfd(notif_id, flags, srcfd, newfd, newfd_flags), True)
