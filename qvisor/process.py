"""The last steps of a container process before execve: limits, identity, capabilities, seccomp.

Runs in the forked child that becomes the container's init or an exec'd process, inside the
container's namespaces. The order follows runc: rlimits (set by the caller: for the init already
at create, so a bad limit fails `create`) and oom score while still privileged;
seccomp early unless noNewPrivileges (installing a filter needs CAP_SYS_ADMIN or no_new_privs);
bounding set; uid/gid with keep-caps; capsets; ambient; no_new_privs; seccomp late; exec.
"""
from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import stat
from typing import Callable

from qlib import linux as L
from qlib import procfs
from qlib import sched
from qlib.errors import SetupError
from qvisor import paths, trampoline
from qvisor.spec import CAPABILITIES, IOPRIO_CLASSES, RLIMITS, SCHED_FLAGS, SCHED_POLICIES, Capabilities, Process

log = logging.getLogger("quark.process")


def _mask(names: list[str], last: int) -> int:
    m = 0
    for n in names:
        bit = CAPABILITIES[n]
        if bit <= last:  # capabilities this kernel does not know are skipped, as runc does
            m |= 1 << bit
    return m


def _rlim(value: int) -> int:
    """The spec's uint64 as Python's signed setrlimit argument with the same 64 bits: 2**64-1
    (unlimited) is resource.RLIM_INFINITY (-1), and no value overflows a C long."""
    return value - 2**64 if value >= 2**63 else value


def set_rlimits(proc: Process) -> None:
    for r in proc.rlimits:
        try:
            resource.setrlimit(RLIMITS[r.type], (_rlim(r.soft), _rlim(r.hard)))
        except (OSError, ValueError, OverflowError) as e:
            raise SetupError(f"process.rlimits: setting {r.type} to {r.soft}/{r.hard}: {e}") from None


def set_scheduling(proc: Process) -> None:
    """process.scheduler and process.ioPriority, applied to this process before it execs the
    container's (its children inherit them), as runc applies them."""
    s = proc.scheduler
    if s is not None:
        flags = 0
        for name in set(s.flags):
            flags |= SCHED_FLAGS[name]
        try:
            sched.sched_setattr(SCHED_POLICIES[s.policy], s.nice, s.priority, flags, s.runtime, s.deadline, s.period)
        except OSError as e:
            raise SetupError(f"process.scheduler: {s.policy}: {e.strerror}") from None
    if proc.io_priority is not None:
        io = proc.io_priority
        try:
            sched.ioprio_set(sched.ioprio_value(IOPRIO_CLASSES[io.io_class], io.priority))
        except OSError as e:
            raise SetupError(f"process.ioPriority: {io.io_class} {io.priority}: {e.strerror}") from None


def set_oom_score_adj(value: int | None) -> None:
    if value is None:
        return
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except PermissionError:
        # lowering the score needs CAP_SYS_RESOURCE in the initial namespace; some hosts refuse it
        # even to root (containerd's restrict_oom_score_adj exists for this). Keep the inherited one.
        log.warning("oomScoreAdj %d refused by the kernel (EACCES); keeping the inherited score", value)


def _drop_bounding(caps: Capabilities, last: int) -> None:
    keep = _mask(caps.bounding, last)
    for bit in range(last + 1):
        if not keep & (1 << bit):
            L.prctl(L.PR_CAPBSET_DROP, bit)


def _switch_user(proc: Process) -> None:
    u = proc.user
    os.setgroups(u.additional_gids)
    os.setresgid(u.gid, u.gid, u.gid)
    os.setresuid(u.uid, u.uid, u.uid)


def not_held(names: list[str], last: int) -> list[str]:
    """Those of `names` outside this process's permitted set (capset may not add them)."""
    try:
        held = procfs.permitted_caps()
    except (OSError, ValueError):
        return []
    return sorted({n for n in names if n in CAPABILITIES and CAPABILITIES[n] <= last
                   and not held & (1 << CAPABILITIES[n])})


def _set_caps(caps: Capabilities, last: int) -> None:
    L.capset(_mask(caps.effective, last), _mask(caps.permitted, last), _mask(caps.inheritable, last))
    L.prctl(L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_CLEAR_ALL)
    for name in caps.ambient:
        bit = CAPABILITIES[name]
        if bit > last:
            continue
        try:
            L.prctl(L.PR_CAP_AMBIENT, L.PR_CAP_AMBIENT_RAISE, bit)
        except OSError as e:
            # ambient caps must also be permitted and inheritable; runc warns and goes on
            log.warning("ambient capability %s not raised: %s", name, e.strerror)


def reset_signals() -> None:
    """Python ignores SIGPIPE and SIGXFSZ and blocks nothing; a program expects defaults."""
    signal.set_wakeup_fd(-1)
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def chdir_in_root(cwd: str) -> None:
    """chdir to `cwd`, resolved inside the container's root with no /proc magic links: a cwd such
    as /proc/self/fd/N can never name a directory the runtime holds open (CVE-2024-21626 class).
    Runs as the container's user, so search permissions apply as they would to chdir(2)."""
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = paths.open_in_root(root, cwd, os.O_PATH | os.O_DIRECTORY)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EPERM):
            raise
        # the bundle's seccomp profile refuses openat2: chdir, then refuse a directory that is not
        # under our root (getcwd fails with ENOENT for one), as runc does
        os.chdir(cwd)
        os.getcwd()
        return
    finally:
        os.close(root)
    try:
        os.fchdir(fd)
    finally:
        os.close(fd)


def make_cwd(rootfs: str, cwd: str) -> None:
    """Create process.cwd if it is missing, as runc does for the init (MkdirAll, 0755, by the
    runtime's root and before the root turns read-only). It is resolved inside `rootfs` as the
    container would resolve it, so a symlink in the image cannot place it outside; a path through
    a /proc magic link (/proc/self/fd/N/...) is never created, and chdir_in_root refuses it."""
    root = os.open(rootfs, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.close(paths.open_in_root(root, cwd))
            return   # there: whether it is a directory is chdir's to say
        except FileNotFoundError:
            pass
        except OSError:
            return   # ELOOP for a magic link on the way: not ours to create
        os.close(paths.ensure_in_root(root, cwd, is_dir=True))
    except OSError as e:
        raise SetupError(f"process.cwd: creating {cwd}: {e.strerror}") from None
    finally:
        os.close(root)


def home_of(uid: int) -> str:
    """The home directory of `uid` in the container's /etc/passwd (its first entry, as runc's
    user.GetExecUser reads it), or "/" when there is no such file or entry. Runs in the container's
    root; the file is opened inside it, with no /proc magic link, and only if it is a regular file."""
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = paths.open_in_root(root, "/etc/passwd", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return "/"
    finally:
        os.close(root)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return "/"
        text = f.read().decode("utf-8", "replace")
    for line in text.splitlines():
        fields = line.strip().split(":")   # name:password:uid:gid:gecos:home:shell
        if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) == uid:
            return fields[5] if len(fields) > 5 else ""
    return "/"


def environment(proc: Process) -> dict[str, str]:
    """process.env, with HOME from the container's passwd (else "/") when it is missing or empty,
    as runc sets it. Called before the user switch and the seccomp filter, which could deny it."""
    env = dict(e.split("=", 1) if "=" in e else (e, "") for e in proc.env)
    if not env.get("HOME"):
        env["HOME"] = home_of(proc.user.uid)
    return env


def finish_and_exec(proc: Process, *, install_filter: Callable[[bool], None], keep_fds: tuple[int, ...] = ()) -> None:
    """Apply the process spec and execve. Does not return; raises SetupError before exec.
    Every fd >= 3 but `keep_fds` (the close-on-exec channel that reports a failed execve, and the
    fds --preserve-fds passes on) is closed before execve, so not even the path of the program can
    reach a runtime fd through /proc/self/fd."""
    last = L.last_cap()
    env = environment(proc)
    set_oom_score_adj(proc.oom_score_adj)
    if proc.user.umask is not None:
        os.umask(proc.user.umask)
    if not proc.no_new_privileges:
        install_filter(False)
    caps = proc.capabilities
    try:
        if caps is not None:
            _drop_bounding(caps, last)
        L.prctl(L.PR_SET_KEEPCAPS, 1)
        _switch_user(proc)
        L.prctl(L.PR_SET_KEEPCAPS, 0)
    except OSError as e:
        raise SetupError(f"process.user: switching to uid {proc.user.uid} gid {proc.user.gid}: {e.strerror}") from None
    try:
        chdir_in_root(proc.cwd)
    except OSError as e:
        raise SetupError(f"process.cwd: {proc.cwd}: {e.strerror}") from None
    if caps is not None:
        try:
            _set_caps(caps, last)
        except OSError as e:
            missing = not_held(caps.permitted + caps.effective + caps.inheritable, last)
            why = (f"; not held by the runtime: {', '.join(missing)} (an exec'd process gets at most "
                   "the capabilities the container's process was configured with, or the host withholds "
                   "them)") if missing else ""
            raise SetupError(f"process.capabilities: {e.strerror}{why}") from None
    if proc.no_new_privileges:
        L.prctl(L.PR_SET_NO_NEW_PRIVS, 1)
        install_filter(True)
    reset_signals()
    L.close_fds_except(set(keep_fds))
    try:
        # never execve the container's program from the runtime's own binary (qvisor/trampoline.py)
        path = trampoline.resolve(proc.args[0], env)
        trampoline.execve(trampoline.sealed_memfd(), path, proc.args, env)
    except OSError as e:
        raise _exec_error(proc, e) from None


def check_executable(proc: Process) -> None:
    """At create, as runc does before it waits for start: a program that is not there fails the
    create, not the start (podman then says 127, "command not found", as with runc). A path relative
    to the working directory is left to the exec."""
    program = proc.args[0]
    if "/" in program and not program.startswith("/"):
        return
    try:
        trampoline.resolve(program, environment(proc))
    except OSError as e:
        raise _exec_error(proc, e) from None


def _exec_error(proc: Process, e: OSError) -> SetupError:
    what = "executable file not found in $PATH" if e.errno == errno.ENOENT else e.strerror
    return SetupError(f"exec: {proc.args[0]!r}: {what}")
