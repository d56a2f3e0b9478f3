"""What the cgroup v1 and v2 implementations share: the `Cgroup` interface and its common work
(moving pids, listing, freezing, killing, removing), the helpers that read and write a cgroup's
files, and the constants errors and limits use. v1.py and v2.py only know their file names;
__init__.py picks one for the host."""
from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Iterator

from qlib import cgroupfs, procfs
from qlib.errors import SetupError, Unsupported

# the spec model is slow to import (bench/README.md, "Start-up and supervisor memory"): `start`,
# `kill`, `delete` ... never need it
if TYPE_CHECKING:
    from ..spec import HugepageLimit, RdmaLimit

CGROUP_ROOT = cgroupfs.CGROUP_ROOT
RESOURCES = "linux.resources"  # errors name the config.json field they concern under this
# v1 reports "no limit" as LONG_MAX rounded down to a page; anything this large is no limit.
UNLIMITED = 1 << 62
KERNEL_MEMORY = "kernel memory limits are deprecated and no longer enforced by Linux"

log = logging.getLogger("quark")


def device_rule(rule: Any) -> str:
    """An OCI device rule in the kernel's "type major:minor access" form ('*' = any)."""
    def num(n: int | None) -> str:
        return "*" if n is None or n < 0 else str(n)
    return f"{rule.type or 'a'} {num(rule.major)}:{num(rule.minor)} {rule.access or 'rwm'}"


def write(d: str, name: str, value: object, field: str = "") -> None:
    """Write one control file; a kernel rejection becomes a SetupError naming file and value.
    With `field`, the linux.resources field the write sets, errors name that field, and a file
    this host lacks (the kernel has no such setting) is Unsupported."""
    path = os.path.join(d, name)
    where = f"{RESOURCES}.{field}" if field else "cgroup"
    try:
        # Never O_CREAT: on cgroupfs that turns a missing file into EACCES, hiding what is wrong.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)
    except FileNotFoundError as e:
        if field and os.path.isdir(d):
            raise Unsupported(f"{where}: not supported on this host: the kernel has no {path}") from e
        raise SetupError(f"{where}: writing {value!r} to {path}: {e.strerror}") from e
    except OSError as e:
        raise SetupError(f"{where}: writing {value!r} to {path}: {e.strerror}") from e


def warn_ignored(field: str, why: str) -> None:
    """A setting the kernel no longer has: runc ignores it with a warning, and so does quark."""
    log.warning("%s.%s is ignored: %s", RESOURCES, field, why)


def hugetlb_writes(d: str, limits: list[HugepageLimit], suffix: str) -> list[tuple[str, object, str]]:
    """(file, value, field) for hugepageLimits in cgroup directory `d`: each limit, and its
    reservation limit where the kernel has one (5.7+), as runc sets both."""
    writes: list[tuple[str, object, str]] = []
    for i, h in enumerate(limits):
        prefix, field = f"hugetlb.{h.page_size}", f"hugepageLimits[{i}]"
        writes.append((prefix + suffix, h.limit, field))
        if os.path.exists(os.path.join(d, f"{prefix}.rsvd{suffix}")):
            writes.append((f"{prefix}.rsvd{suffix}", h.limit, field))
    return writes


def rdma_line(device: str, limit: RdmaLimit) -> str:
    """An rdma.max line: "DEVICE hca_handle=N hca_object=N" with the limits that are set."""
    values = (("hca_handle", limit.hca_handles), ("hca_object", limit.hca_objects))
    return " ".join([device] + [f"{key}={n}" for key, n in values if n is not None])


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


def start_move_grace_period() -> threading.Thread:
    """Start now, beside the caller's work, the RCU grace period its next cgroup move waits for.

    Writing a pid to cgroup.procs takes the kernel's cgroup_threadgroup_rwsem for writing, and
    when no move happened lately percpu_down_write's rcu_sync_enter first waits out a whole RCU
    grace period (milliseconds: bench/README.md, "Start-up and supervisor memory"); a move that
    comes while such a wait is under way, or within a grace period after it, waits only for what
    is left of it (kernel/rcu/sync.c). A create moves its stage 1 into the container's cgroup
    only after loading the spec, making the cgroup and starting the supervisor; so at its start a
    thread writes this process's own pid into the cgroup it is in (a move that changes nothing),
    and the grace period passes during that work instead of after it. Best effort: any failure
    only means the move pays the wait itself. Join the thread before forking: a fork meanwhile
    would give the child its open cgroup.procs."""
    thread = threading.Thread(target=_move_to_where_i_am, name="cgroup-grace-period", daemon=True)
    thread.start()
    return thread


def _move_to_where_i_am() -> None:
    try:
        with open("/proc/self/cgroup") as f:
            dirs = dirs_of(f.readline())   # one hierarchy is enough: the lock is the kernel's, for all
        if dirs:
            with open(os.path.join(dirs[0], "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
    except (OSError, ValueError):
        pass


def dirs_of(text: str) -> list[str]:
    """The directories a /proc/PID/cgroup text names, in the hierarchies mounted at their root:
    a v1 controller's (or name=) line, and the unified hierarchy's."""
    # (controllers or name=, or {""} for v2) and mount point of each hierarchy mounted at its root
    mounts = [({""} if m.fstype == "cgroup2" else set(m.super_options.split(",")), m.mount_point)
              for m in procfs.mountinfo() if m.fstype in ("cgroup", "cgroup2") and m.root == "/"]
    dirs = []
    for line in text.splitlines():
        _hid, ctrls, path = line.split(":", 2)
        want = set(ctrls.split(",")) if ctrls else {""}
        mnt = next((mnt for opts, mnt in mounts if want <= opts), None)   # the first: a hierarchy before its bind mounts
        if mnt is not None:
            dirs.append(mnt + path)
    return dirs


def join(text: str) -> None:
    """Move this process into the cgroups a /proc/PID/cgroup text names, in every hierarchy."""
    with open("/proc/self/cgroup") as f:
        if f.read() == text:
            # where it is already (the usual case for a factory worker): a move waits for an RCU
            # grace period (start_move_grace_period)
            return
    me = str(os.getpid())
    for d in dirs_of(text):
        try:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(me)
        except OSError as e:
            if e.errno != errno.ENOENT:   # a hierarchy that vanished meanwhile
                raise


def settle(done: Callable[[], bool], what: str, timeout: float = 5.0) -> Iterator[float]:
    """Retry `done` until it holds, yielding the pause wanted before each retry: freezing and
    removal settle asynchronously. A caller with an event loop waits on a timer, not a sleep."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SetupError(f"cgroup: timed out {what}")
        yield 0.01


def run_steps(steps: Iterator[float]) -> None:
    """Run a step generator (settle, Cgroup.kill_steps) to its end, sleeping between steps."""
    for pause in steps:
        time.sleep(pause)


def poll(done: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    run_steps(settle(done, what, timeout))


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
    def try_freeze(self) -> bool:
        """Ask for frozen (again: a stalled freeze retries); True once it is. Unsupported
        without a freezer."""
    @abstractmethod
    def try_thaw(self) -> bool: ...
    @abstractmethod
    def frozen(self) -> bool: ...
    @abstractmethod
    def stats(self) -> dict:
        """Statistics in runc's `events --stats` layout (stats.py)."""
    @abstractmethod
    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in this cgroup so far."""
    @abstractmethod
    def memory_limit(self) -> int | None: ...
    @abstractmethod
    def memory_usage(self) -> int: ...
    @abstractmethod
    def reclaim(self) -> None:
        """Reclaim what the cgroup's memory holds that no process pins (hibernation)."""

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

    def freeze(self) -> None:
        poll(self.try_freeze, f"freezing {self.path}")

    def thaw(self) -> None:
        poll(self.try_thaw, f"thawing {self.path}")

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process; frozen meanwhile so none escapes by forking. Leaves it thawed.
        A cgroup that no longer exists has no process to signal."""
        run_steps(self.kill_steps(sig))

    def kill_steps(self, sig: int = signal.SIGKILL) -> Iterator[float]:
        """kill_all as steps, each yield the pause before the next: the supervisor runs them on
        its event loop's timers, so a freeze that takes seconds to settle holds nothing."""
        if not any(os.path.isdir(d) for d in self.dirs()) or not self.pids():
            return   # nothing to signal, and nothing in it to fork: no freeze needed (the common
                     # case once an init that kept no other process has exited)
        try:
            yield from settle(self.try_freeze, f"freezing {self.path}")
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
                yield from settle(self.try_thaw, f"thawing {self.path}")

    def destroy(self) -> None:
        """Remove the cgroup and its children everywhere; kills nothing, idempotent."""
        for top in self.dirs():
            for d, _, _ in os.walk(top, topdown=False):  # children before parents
                _rmdir(d)

    def exists(self) -> bool:
        return any(os.path.isdir(d) for d in self.dirs())

    # What the container sees of its resources (qvisor/procview.py, sysinfo(2)): reads only.
    @abstractmethod
    def swap_limit(self) -> int | None:
        """Bytes of swap (swap alone, not memory+swap) the cgroup may use; None when unlimited
        or when the host does not account swap."""
    @abstractmethod
    def swap_usage(self) -> int | None:
        """Bytes of swap in use; None when the host does not account swap."""
    @abstractmethod
    def memory_stat(self) -> dict[str, int]:
        """memory.stat ({} without a memory controller)."""
    @abstractmethod
    def cpuset_cpus(self) -> list[int] | None:
        """The CPUs the cgroup may run on (the effective cpuset); None without a cpuset controller."""
    @abstractmethod
    def cpu_quota(self) -> tuple[int, int] | None:
        """(quota, period) in microseconds when CPU bandwidth is limited, else None."""
    @abstractmethod
    def cpu_usage_ns(self) -> int | None: ...
    @abstractmethod
    def parent(self) -> Cgroup | None:
        """The cgroup above this one (a Kubernetes pod's, for one of its containers); None at the top."""
    @abstractmethod
    def threads(self) -> list[int]:
        """Every thread (host tid) in the cgroup and its descendants."""

    def _threads_in(self, top: str, name: str) -> list[int]:
        found: set[int] = set()
        for d, _, _ in os.walk(top):
            try:
                found.update(int(t) for t in read(d, name).split())
            except FileNotFoundError:
                pass   # a child cgroup removed while we walked
        return sorted(found)


def cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


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
