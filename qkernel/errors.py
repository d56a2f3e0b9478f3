"""Errors inside QKernel: the ones users see derive from qlib.errors.QuarkError."""
from __future__ import annotations

from qlib.errors import QuarkError


class UnknownPlatform(QuarkError):
    def __init__(self, value: str, source: str) -> None:
        self.value = value
        self.source = source
        super().__init__(f"{source}: unknown platform {value!r} (expected one of: seccomp, ptrace)")


class FilterError(QuarkError):
    """The seccomp filter could not be built or loaded; says which part."""


class TaskGone(Exception):
    """The trapped task died or its notification was abandoned: never act on it."""


class MemoryFault(Exception):
    """A handler touched an address the task cannot access: the syscall gets EFAULT."""
