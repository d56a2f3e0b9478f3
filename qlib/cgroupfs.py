"""Which cgroup version the host runs: the one probe every package asks.

The host is unified (v2) when /sys/fs/cgroup itself is a cgroup2 filesystem; otherwise it is legacy
or hybrid (v1 controllers, perhaps a v2 tree under /sys/fs/cgroup/unified), which quark drives as v1.
The probe is statfs(2)'s f_type: a file such as cgroup.controllers can exist on a hybrid host's
/sys/fs/cgroup/unified but says nothing about the mount at /sys/fs/cgroup.
"""
from __future__ import annotations

import ctypes
import os

from qlib.libc import check, libc

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP2_SUPER_MAGIC = 0x63677270


def fs_type(path: str) -> int:
    """statfs(2)'s f_type of the filesystem holding `path`; OSError if it cannot be read."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes; f_type (a long) comes first
    check(libc.statfs(os.fsencode(path), buf), f"statfs {path}", path)
    return ctypes.c_long.from_buffer(buf).value


def version() -> str:
    """"v2" when /sys/fs/cgroup is a cgroup2 mount (unified), else "v1" (legacy or hybrid).
    OSError when /sys/fs/cgroup cannot be looked at."""
    return "v2" if fs_type(CGROUP_ROOT) == CGROUP2_SUPER_MAGIC else "v1"


def unified() -> bool:
    """Whether the host is cgroup v2 only; False also when /sys/fs/cgroup is not there at all."""
    try:
        return version() == "v2"
    except OSError:
        return False
