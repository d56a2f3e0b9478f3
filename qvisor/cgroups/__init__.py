"""The cgroup manager the sandbox supervisor uses, for cgroup v1 and v2 behind one interface.

`open_cgroup(path)` picks the implementation for this host (`detect()`); the returned
`Cgroup` creates the container's cgroup, applies the OCI `linux.resources`, moves
processes in, freezes, reports usage, kills and removes it. Everything the two versions
share (moving pids, listing, killing, removing) lives here; v1.py and v2.py only know
their file names.
"""
from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import signal
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from ..errors import SetupError, Unsupported

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP2_SUPER_MAGIC = 0x63677270
# v1 reports "no limit" as LONG_MAX rounded down to a page; anything this large is no limit.
UNLIMITED = 1 << 62


def detect() -> str:
    """Return "v2" when /sys/fs/cgroup is a cgroup2 mount (unified), else "v1" (legacy/hybrid)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes; f_type comes first
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(CGROUP_ROOT.encode(), buf) != 0:
        err = ctypes.get_errno()
        raise SetupError(f"cgroup: statfs {CGROUP_ROOT}: {os.strerror(err)}")
    return "v2" if ctypes.c_long.from_buffer(buf).value == CGROUP2_SUPER_MAGIC else "v1"


def default_path(container_id: str) -> str:
    return f"/quark/{container_id}"


def open_cgroup(path: str, version: str | None = None) -> Cgroup:
    """The cgroup at cgroupsPath `path`; a relative path is placed under /quark/."""
    if ".." in path.split("/"):
        raise SetupError(f"cgroup: invalid cgroupsPath {path!r}: '..' is not allowed")
    path = posixpath.normpath(path if path.startswith("/") else "/quark/" + path)
    if path == "/":
        raise SetupError("cgroup: cgroupsPath may not be the root cgroup")
    version = version or detect()
    if version == "v1":
        from .v1 import V1Cgroup
        return V1Cgroup(path)
    if version == "v2":
        from .v2 import V2Cgroup
        return V2Cgroup(path)
    raise ValueError(f"unknown cgroup version {version!r}")


def device_rule(rule: Any) -> str:
    """An OCI device rule in the kernel's "type major:minor access" form ('*' = any)."""
    def num(n: int | None) -> str:
        return "*" if n is None or n < 0 else str(n)
    return f"{rule.type or 'a'} {num(rule.major)}:{num(rule.minor)} {rule.access or 'rwm'}"


def write(d: str, name: str, value: object) -> None:
    """Write one control file; a kernel rejection becomes a SetupError naming file and value."""
    path = os.path.join(d, name)
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except OSError as e:
        raise SetupError(f"cgroup: writing {value!r} to {path}: {e.strerror}") from e


def read(d: str, name: str) -> str:
    with open(os.path.join(d, name)) as f:
        return f.read().strip()


def read_int(d: str, name: str) -> int | None:
    """An integer control file; None when it is missing or says "max"."""
    try:
        value = read(d, name)
    except FileNotFoundError:
        return None
    return None if value == "max" else int(value)


def read_kv(d: str, name: str) -> dict[str, int]:
    """A "key value" per line file (cpu.stat, memory.events, ...); {} when missing."""
    try:
        lines = read(d, name).splitlines()
    except FileNotFoundError:
        return {}
    return {k: int(v) for k, v, *_ in (line.split() for line in lines)}


def poll(done: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Retry `done` until it holds; freezing and removal settle asynchronously."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SetupError(f"cgroup: timed out {what}")
        time.sleep(0.01)


class Cgroup(ABC):
    """One container's cgroup; subclasses map the operations onto v1 or v2 files."""

    version = ""

    def __init__(self, path: str) -> None:
        self.path = path  # absolute cgroupsPath, e.g. "/quark/abc"

    # Version-specific operations.
    @abstractmethod
    def dirs(self) -> list[str]:
        """This cgroup's directory in every hierarchy it lives in."""
    @abstractmethod
    def create(self) -> None: ...
    @abstractmethod
    def apply(self, resources: Any) -> None: ...
    @abstractmethod
    def freeze(self) -> None: ...
    @abstractmethod
    def thaw(self) -> None: ...
    @abstractmethod
    def frozen(self) -> bool: ...
    @abstractmethod
    def stats(self) -> dict[str, int | None]: ...
    @abstractmethod
    def memory_limit(self) -> int | None: ...
    @abstractmethod
    def memory_usage(self) -> int: ...

    # Shared operations.
    def add_pid(self, pid: int) -> None:
        # Every hierarchy, so no controller (nor systemd's tracking) still sees it outside.
        for d in self.dirs():
            write(d, "cgroup.procs", pid)

    def pids(self) -> list[int]:
        found: set[int] = set()
        for top in self.dirs():
            for d, _, _ in os.walk(top):
                try:
                    found.update(int(p) for p in read(d, "cgroup.procs").split())
                except FileNotFoundError:
                    pass  # a child cgroup removed while we walked
        return sorted(found)

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process; frozen meanwhile so none escapes by forking. Leaves it thawed.
        A cgroup that no longer exists has no process to signal."""
        if not any(os.path.isdir(d) for d in self.dirs()):
            return
        try:
            self.freeze()
            frozen = True
        except Unsupported:
            frozen = False
        try:
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        finally:
            if frozen:
                self.thaw()

    def destroy(self) -> None:
        """Remove the cgroup and its children everywhere; kills nothing, idempotent."""
        for top in self.dirs():
            for d, _, _ in os.walk(top, topdown=False):  # children before parents
                _rmdir(d)

    def exists(self) -> bool:
        return any(os.path.isdir(d) for d in self.dirs())


def _rmdir(d: str, timeout: float = 2.0) -> None:
    # EBUSY while the last processes are still exiting; give them a moment.
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise SetupError(f"cgroup: removing {d}: {e.strerror}") from e
            time.sleep(0.02)
