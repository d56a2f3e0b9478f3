"""Reading and writing a trapped task's memory through /proc/PID/mem.

/proc/PID/mem rather than process_vm_readv: the file is opened once per request and the caller then
checks that the request is still valid (SECCOMP_IOCTL_NOTIF_ID_VALID); from then on the open file
refers to that task even if its pid is reused, so a write can never land in a stranger.
"""
from __future__ import annotations

import errno
import os

from qkernel.errors import MemoryFault, TaskGone


class TaskMemory:
    def __init__(self, pid: int) -> None:
        try:
            self._fd = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError) as e:
            raise TaskGone(pid) from e
        self.pid = pid

    def read(self, addr: int, size: int) -> bytes:
        try:
            data = os.pread(self._fd, size, addr)
        except (OSError, OverflowError) as e:
            raise self._fault(e) from e
        if len(data) != size:
            raise MemoryFault(addr)
        return data

    def write(self, addr: int, data: bytes) -> None:
        try:
            n = os.pwrite(self._fd, data, addr)
        except (OSError, OverflowError) as e:
            raise self._fault(e) from e
        if n != len(data):
            raise MemoryFault(addr)

    def _fault(self, e: Exception) -> Exception:
        # EIO is an unmapped address (the task's fault); ESRCH means its memory is already gone.
        if isinstance(e, OSError) and e.errno == errno.ESRCH:
            return TaskGone(self.pid)
        return MemoryFault(e)

    def close(self) -> None:
        os.close(self._fd)
