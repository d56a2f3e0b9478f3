"""The exit status of a process that is not our child, from its pidfd (PIDFD_GET_INFO, Linux 6.15+).

When the caller of `quark create` adopts orphans (containerd's runc shim and conmon are child
subreapers and reap the container's init themselves, as they do with runc), the supervisor is not
the init's parent and cannot waitpid() it. The kernel keeps the wait status in pidfs once the
process has been reaped, and hands it to anyone holding a pidfd.
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct

_INFO_SIZE = 64                     # struct pidfd_info, PIDFD_INFO_SIZE_VER0
_PIDFS_IOCTL_MAGIC = 0xFF
_PIDFD_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (_PIDFS_IOCTL_MAGIC << 8) | 11   # _IOWR(0xFF, 11, ...)
_PIDFD_INFO_EXIT = 1 << 3
_EXIT_CODE_OFFSET = 60              # mask, cgroupid (u64 each), then 11 u32 ids, then exit_code


def exit_status(pidfd: int) -> int | None:
    """The wait status (as os.waitpid gives it) of the process, or None while it is not yet
    reaped. Raises OSError(ENOTTY/EINVAL) on kernels without PIDFD_GET_INFO."""
    buf = bytearray(_INFO_SIZE)
    struct.pack_into("Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError as e:
        if e.errno == errno.ESRCH:   # exited, not reaped yet by its parent
            return None
        raise
    if not struct.unpack_from("Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("i", buf, _EXIT_CODE_OFFSET)[0]


def supported() -> bool:
    """Whether this kernel reports exit statuses through pidfds."""
    fd = os.pidfd_open(os.getpid())
    try:
        exit_status(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
