"""Syscall numbers for the architecture quark runs on, from libseccomp's tables (python3-seccomp).

The calls Python's os module lacks (pivot_root, setns, pidfd_*, the new mount API) are made with
syscall(2), which takes the number: these differ between architectures (pivot_root is 155 on
x86_64, 41 on aarch64), so no module hard-codes them. seccomp is imported here, at import time, and
not at the first lookup: a lookup may come after the process pivoted into a container's root,
where the module could no longer be found.
"""
from __future__ import annotations

import functools

import seccomp

# names as `uname -m` and OCI spell them -> libseccomp's architecture tokens
_ARCHES = {"native": seccomp.Arch.NATIVE, "x86_64": seccomp.Arch.X86_64, "aarch64": seccomp.Arch.AARCH64,
           "arm64": seccomp.Arch.AARCH64}


@functools.cache
def number(name: str, arch: str = "native") -> int:
    """The number of syscall `name` on `arch` ("native": the running one; "x86_64", "aarch64").
    Raises LookupError when libseccomp does not know the call on that architecture."""
    token = _ARCHES.get(arch)
    if token is None:
        raise LookupError(f"no syscall table for architecture {arch!r}")
    try:
        nr = seccomp.resolve_syscall(token, name)
    except ValueError:
        nr = -1
    if nr < 0:   # libseccomp answers negative pseudo-numbers for calls an architecture lacks
        raise LookupError(f"syscall {name!r} is not known on {arch}")
    return nr
