"""The one handle on the C library and the one way its failures become OSError.

Every ctypes call into libc goes through `libc` here (qlib's thin kernel-facing modules and the few
above them that need a call qlib does not wrap), so a restype set once holds for every caller, and
every failure reads errno the same way: right after the call, from ctypes' copy.
"""
from __future__ import annotations

import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long   # a syscall's result is a long (an fd, a count or -1)


def errno_error(what: str | None = None, filename: str | None = None) -> OSError:
    """The OSError for the errno the last failed call left: `what` ("mount") leads its message,
    `filename` is its filename (a path, or the call's name where callers name the field)."""
    err = ctypes.get_errno()
    message = f"{what}: {os.strerror(err)}" if what else os.strerror(err)
    exc = OSError(err, message) if filename is None else OSError(err, message, filename)
    return exc


def check(ret: int, what: str | None = None, filename: str | None = None) -> int:
    """`ret`, or the OSError errno says when the call failed (returned a negative value)."""
    if ret < 0:
        raise errno_error(what, filename)
    return ret
