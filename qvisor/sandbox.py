"""The code that runs in the processes the supervisor forks into a container.

Creating a container is two forks: stage 1 joins the namespaces given by path, creates the new
ones (a new pid namespace only applies to children), then forks the init and exits; the init is
reparented to the supervisor, a child subreaper. An exec'd process goes the same way, joining the
init's namespaces through a pidfd. Each reports to the supervisor over a SOCK_SEQPACKET channel;
the channel is close-on-exec, so EOF after "go" means the execve succeeded.
"""
from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import pickle
import signal
import socket
import termios
import time
import traceback
from typing import Callable, Iterable, NoReturn

from qlib import linux as L
from qlib import sched
from qlib.errors import QuarkError, SetupError
from qvisor import channel, hooks, page_merge, process, rootfs, rootfs_lock
from qvisor.spec import (MEMORY_POLICY_FLAGS, MEMORY_POLICY_MODES, PERSONALITIES, PROC_NS_NAMES, Process, Spec,
                         sysctl_key)

NS_FLAGS = {"user": L.CLONE_NEWUSER, "mount": L.CLONE_NEWNS, "pid": L.CLONE_NEWPID, "network": L.CLONE_NEWNET,
            "ipc": L.CLONE_NEWIPC, "uts": L.CLONE_NEWUTS, "cgroup": L.CLONE_NEWCGROUP, "time": L.CLONE_NEWTIME}


def run_child(sock: socket.socket, body: Callable[[], None]) -> NoReturn:
    """Run `body` in a forked child; report any failure to the supervisor; never return."""
    code = 0
    try:
        page_merge.withdraw_in_child()   # the container's memory is never offered to KSM
        body()
    except BaseException as e:  # a forked child must never unwind into the parent's code
        code = 1
        if isinstance(e, QuarkError):
            msg = str(e)
        elif isinstance(e, OSError):   # a step that wraps no error of its own: the kernel's words
            msg = f"container set-up: {e.strerror or 'failed'}" + (f": {e.filename}" if e.filename else "")
        else:   # a bug: the user gets a sentence, the supervisor's log the traceback
            logging.getLogger("quark").error("container set-up failed\n%s", traceback.format_exc())
            msg = "container set-up failed with an internal error (the supervisor's log has the details)"
        try:
            kind = e.kind if isinstance(e, QuarkError) else QuarkError.kind
            channel.send(sock, {"type": "error", "error": msg, "kind": kind})
        except OSError:
            pass
    os._exit(code)


class _ChannelLog(logging.Handler):
    """A forked child's log records travel to the supervisor as {"type": "log"} messages on its
    channel, so the child needs no fd of the supervisor's log file (a host file)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            channel.send(self.sock, {"type": "log", "level": record.levelno, "logger": record.name,
                                     "message": record.getMessage()})
        except Exception:  # noqa: BLE001 - logging must never break container set-up
            pass


_inherited: list = []  # the supervisor's handlers, kept referenced so no finaliser ever runs in a child


def drop_runtime_fds(sock: socket.socket, keep: Iterable[int] = ()) -> None:
    """First thing in a child forked from the supervisor: close every fd it inherited but stdio, its
    channel and `keep` (the fds --preserve-fds passes to the container) — the supervisor's log
    file, control and client sockets, the seccomp listeners of other processes, its event loop,
    tsord's socket, the `quark create` pipe, whatever the caller of `quark` leaked — before it joins
    any namespace of the container (CVE-2024-21626 class).
    The objects that own those fds are never finalised here: collection is off and the handlers
    stay referenced, so no finaliser can close an fd number the child reuses."""
    gc.disable()
    signal.set_wakeup_fd(-1)   # the supervisor's wake-up pipe is closed below: no write may go there
    root = logging.getLogger()
    _inherited.extend(root.handlers)
    root.handlers[:] = [_ChannelLog(sock)]
    L.close_fds_except({sock.fileno(), *keep})


def _place_preserved(fds: list[int]) -> None:
    """Put the fds an exec's caller preserves (--preserve-fds) at 3, 4, ..., the numbers the caller
    had them at, wherever they arrived. Nothing else is open in that range after drop_runtime_fds:
    the supervisor puts the channel above it."""
    top = 3 + len(fds)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top) for fd in fds]
    for fd in fds:
        os.close(fd)
    for i, fd in enumerate(high):
        os.dup2(fd, 3 + i)   # inheritable: they are meant to survive execve
        os.close(fd)


def _expect_with_fds(sock: socket.socket, kind: str) -> tuple[dict, list[int]]:
    msg, fds = channel.recv_packet(sock)
    if msg.get("type") not in (kind, "error"):
        msg = {"type": "error", "error": f"protocol: expected {kind!r}, got {msg.get('type')!r}"}
    if msg["type"] == "error":
        for fd in fds:
            os.close(fd)
        raise SetupError(msg.get("error", "supervisor reported an error"))
    return msg, fds


def _expect(sock: socket.socket, kind: str) -> dict:
    msg, fds = _expect_with_fds(sock, kind)
    for fd in fds:
        os.close(fd)
    return msg


def _fork_reported(sock: socket.socket) -> tuple[int, int]:
    """Fork the process stage 1 exists for. Only stage 1 can tell the supervisor its pid; if stage 1
    dies first (the OOM killer picks it under a tight memory limit), the child would wait for the
    supervisor forever and the supervisor for the pid, each holding the channel open. So the child
    first waits on a pipe for stage 1's word that the pid is sent: EOF instead means stage 1 died,
    and the child exits, which closes the channel and fails the create or exec cleanly.
    Returns (pid, fd): in the child the pipe's read end, in stage 1 its write end."""
    r, w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(w)
        return 0, r
    os.close(r)
    return pid, w


def _report_pid(sock: socket.socket, pid: int, w: int) -> None:
    channel.send(sock, {"type": "pid", "pid": pid, "t": time.monotonic()})
    os.write(w, b"s")
    os.close(w)


def _await_report(r: int) -> None:
    try:
        sent = os.read(r, 1)
    finally:
        os.close(r)
    if not sent:
        os._exit(1)   # stage 1 died before it could report us: nothing will ever answer


def stage1(sock: socket.socket, spec: Spec, preserve_fds: int = 0) -> None:
    """Namespaces, then fork the init (pid 1 of a new pid namespace). The caller's fds 3..2+preserve_fds
    were inherited at their numbers (nothing of the runtime can sit there) and go on to the init."""
    L.prctl(L.PR_SET_DUMPABLE, 0)  # nothing in the container may open /proc/<us>/exe or /mem
    drop_runtime_fds(sock, range(3, 3 + preserve_fds))
    _expect(sock, "go")  # the supervisor has put us in the cgroup
    _cpus_in_cgroup(None)
    joined = sorted((ns for ns in spec.linux.namespaces if ns.path), key=lambda ns: ns.type != "user")
    for ns in joined:
        try:
            fd = os.open(ns.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise SetupError(f"linux.namespaces: {ns.type} path {ns.path}: {e.strerror}") from None
        try:
            L.setns(fd, NS_FLAGS[ns.type])
        except OSError as e:
            raise SetupError(f"linux.namespaces: joining {ns.type} namespace {ns.path}: {e.strerror}") from None
        finally:
            os.close(fd)
    new = {ns.type for ns in spec.linux.namespaces if not ns.path}
    if any(ns.type == "user" for ns in joined):
        # our host ids mean nothing in the joined namespace (files we create would fail with
        # EOVERFLOW): become its root, as runc's nsexec does
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    if "user" in new:
        L.unshare(L.CLONE_NEWUSER)
        channel.send(sock, {"type": "userns"})
        _expect(sock, "userns-ok")  # the supervisor wrote our uid_map/gid_map
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    flags = 0
    for t in new - {"user"}:
        flags |= NS_FLAGS[t]
    try:
        L.unshare(flags)
    except OSError as e:
        raise SetupError(f"linux.namespaces: creating {sorted(new - {'user'})}: {e.strerror}") from None
    if "time" in new and spec.linux.time_offsets:   # before any process is in it: the init is forked next
        _time_offsets(spec.linux.time_offsets)
    pid, reported = _fork_reported(sock)
    if pid == 0:
        run_child(sock, lambda: init(sock, spec, "user" in new or any(ns.type == "user" for ns in joined), reported,
                                     preserve_fds))
    _report_pid(sock, pid, reported)


def _time_offsets(offsets: dict[str, tuple[int, int]]) -> None:
    text = "".join(f"{clock} {secs} {nsecs}\n" for clock, (secs, nsecs) in offsets.items())
    try:
        with open("/proc/self/timens_offsets", "w") as f:
            f.write(text)
    except OSError as e:
        raise SetupError(f"linux.timeOffsets: {e.strerror}") from None


def _cpus_in_cgroup(final: frozenset[int] | None) -> None:
    """Once in the container's cgroup: the CPUs the container's processes run on. As runc: those
    `final` lists (process.execCPUAffinity, for exec'd processes), else every CPU the cpuset allows,
    never those of whoever ran quark (`taskset -c 0 quark run`, or the factory's)."""
    try:
        os.sched_setaffinity(0, final if final is not None else sched.ALL_CPUS)
    except OSError as e:
        raise SetupError(f"process.execCPUAffinity.final: {e.strerror} (none of its CPUs is online "
                         "and in the container's cpuset?)" if final is not None
                         else f"resetting the CPU affinity: {e.strerror}") from None


def _sysctls(spec: Spec) -> None:
    for key, value in spec.linux.sysctl.items():
        # the dotted form swaps '.' and '/' against the path (eth0.100 -> net.ipv4.conf.eth0/100)
        path = sysctl_key(key).translate(str.maketrans("./", "/."))
        try:
            with open("/proc/sys/" + path, "w") as f:
                f.write(value)
        except OSError as e:
            raise SetupError(f"linux.sysctl: {key}={value}: {e.strerror}") from None


def _terminal(sock: socket.socket, proc: Process) -> None:
    """Make a pty in the container's devpts, hand the master to the supervisor, use the slave."""
    try:
        master, slave = os.openpty()
    except OSError as e:
        raise SetupError(f"process.terminal: cannot allocate a pty in the container: {e.strerror}") from None
    if proc.console_size:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, L.winsize(*proc.console_size))
    channel.send(sock, {"type": "console", "name": os.ttyname(slave)}, [master])
    os.close(master)
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    for fd in (0, 1, 2):
        os.dup2(slave, fd)
    if slave > 2:
        os.close(slave)


def _set_names(spec: Spec) -> None:
    for field, value, set_name in (("hostname", spec.hostname, L.sethostname),
                                   ("domainname", spec.domainname, L.setdomainname)):
        if value:
            try:
                set_name(value)
            except OSError as e:
                hint = " (at most 64 bytes)" if e.errno == errno.EINVAL else ""
                raise SetupError(f"{field}: {value!r}: {os.strerror(e.errno)}{hint}") from None


def mounts_granted(spec: Spec, own_namespaces: frozenset[str] | None = None) -> bool:
    """Will QKernel let the container's processes mount (qkernel/table.py's grant for mount)? Exec'd
    processes cannot hold more than the supervisor keeps, which is what the init's process lists.
    `own_namespaces`: validate.own_namespaces(spec), for a caller before create has set
    spec.own_namespaces."""
    from qkernel import table
    caps = spec.process.capabilities
    held = set().union(caps.bounding, caps.effective, caps.permitted) if caps is not None else set()
    return table.by_name()["mount"].granted(held, spec.own_namespaces if own_namespaces is None else own_namespaces)


def init(sock: socket.socket, spec: Spec, in_userns: bool, reported: int, preserve_fds: int = 0) -> None:
    """The container's init, until it execs the user's process."""
    L.prctl(L.PR_SET_DUMPABLE, 0)
    _await_report(reported)
    os.setsid()
    msg, fds = _expect_with_fds(sock, "prepare")
    source_fds = dict(zip(msg.get("source_fds", []), fds))
    L.last_cap()   # read now, while /proc is the runtime's: the container may mount none
    new_mounts = spec.linux.new_namespace("mount")
    locked = new_mounts and mounts_granted(spec)
    later: dict[int, int] = {}
    if new_mounts:
        later = rootfs.prepare(spec, msg["cgroup_path"], in_userns, source_fds,
                               frozenset(rootfs_lock.unlocked_binds(spec)) if locked else frozenset())
    for fd in fds:
        os.close(fd)
    if new_mounts and rootfs.procview_wanted(spec):
        _procview(sock, spec)
    if spec.linux.new_namespace("network"):
        try:
            L.set_link_up("lo")   # a new network namespace starts with lo down (runc brings it up)
        except OSError as e:
            raise SetupError(f"linux.namespaces: network: bringing up lo: {e.strerror}") from None
    channel.send(sock, {"type": "create-runtime"})  # prestart and createRuntime hooks, in the runtime namespace
    state = _expect(sock, "create-runtime-ok")["state"]
    _set_names(spec)
    # sysctls resolve against the writer's namespaces, so /proc here (the runtime's) is right, and
    # it works for a container that mounts no /proc of its own
    _sysctls(spec)
    # createContainer hooks run in the container's namespaces before pivot_root, from the
    # rootfs, so host paths still resolve (OCI runtime spec, as runc)
    os.chdir(spec.root.path)
    hooks.run_hooks("createContainer", spec.hooks.create_container, state)
    assert spec.process is not None
    process.make_cwd(spec.root.path, spec.process.cwd)
    if new_mounts:
        rootfs.pivot(spec.root.path)
        rootfs.finalize(spec)
        if locked:
            rootfs_lock.lock_mounts()   # before the container can mount: quark's mounts are locked
            if later:
                rootfs.attach_unlocked(spec, later)   # the binds that guard nothing: not locked
                process.make_cwd("/", spec.process.cwd)   # in one of those volumes, as runc makes it
    else:
        rootfs.chroot(spec.root.path)   # a shared mount table: only this process's view changes
    process.set_rlimits(spec.process)
    process.check_executable(spec.process)
    if spec.process.terminal:
        _terminal(sock, spec.process)
    channel.send(sock, {"type": "created", "t": time.monotonic()})
    start = _expect(sock, "start")
    hooks.run_hooks("startContainer", spec.hooks.start_container, start["state"])
    _exec(sock, spec, spec.process, start["platform"], preserve_fds, _socket_filter(start))


def _procview(sock: socket.socket, spec: Spec) -> None:
    """The container's own /proc/meminfo, cpuinfo, ... (qvisor/procview.py): the supervisor makes
    the FUSE filesystem and serves it (this process could not open /dev/fuse: the container's
    device cgroup, which it is in already, does not allow it), and we bind its files in. Without
    it (no FUSE here: the supervisor sends none) the container runs on with the host's files."""
    channel.send(sock, {"type": "procview"})
    _, fds = _expect_with_fds(sock, "procview-ok")
    try:
        if fds:
            rootfs.attach_procview(spec, fds[0])
    finally:
        for fd in fds:
            os.close(fd)


def _socket_filter(start: dict) -> dict[str, bool]:
    """What the filter traps of the socket family: the start message's fields (the supervisor's
    `_socket_filter`), as install_filter's keyword arguments."""
    return {key: bool(start.get(key, False)) for key in ("sockets", "sockopt_offload", "sockmap")}


def _exec(sock: socket.socket, spec: Spec, proc: Process, platform: str, preserve_fds: int,
          socket_filter: dict[str, bool]) -> None:
    import qkernel
    # no fd of the runtime survives into the container (CVE-2024-21626 class); the preserved ones do
    L.mark_fds_cloexec(3 + preserve_fds)

    caps = frozenset(proc.capabilities.bounding) if proc.capabilities is not None else frozenset()

    process.set_scheduling(proc)   # (while this process still holds CAP_SYS_NICE)
    mp = spec.linux.memory_policy
    if mp is not None:   # the init's and each exec'd process's, as runc
        mode = MEMORY_POLICY_MODES[mp.mode][0]
        for flag in mp.flags:
            mode |= MEMORY_POLICY_FLAGS[flag]
        try:
            sched.set_mempolicy(mode, mp.nodes)
        except OSError as e:
            nodes = ",".join(map(str, sorted(mp.nodes)))
            raise SetupError(f"linux.memoryPolicy: {mp.mode}{' ' + nodes if nodes else ''}: {e.strerror}") from None
    if spec.linux.personality is not None:   # the init's and each exec'd process's, as runc
        try:
            L.personality(PERSONALITIES[spec.linux.personality])
        except OSError as e:
            raise SetupError(f"linux.personality: {spec.linux.personality}: {e.strerror}") from None

    def install_filter(no_new_privs: bool) -> None:
        fd = qkernel.install_filter(spec.linux.seccomp, platform, no_new_privs, caps=caps,
                                    own_namespaces=spec.own_namespaces, channel_fd=sock.fileno(), **socket_filter)
        if fd is not None:
            channel.send(sock, {"type": "listener", "t": time.monotonic()}, [fd])
            os.close(fd)

    process.finish_and_exec(proc, install_filter=install_filter,
                            keep_fds=(sock.fileno(), *range(3, 3 + preserve_fds)))


def exec_stage1_of_caller(sock: socket.socket, preserved: list[int]) -> None:
    """Stage 1 of an exec that its caller forked, where the caller reaps (container.exec_process):
    the supervisor's first message is what a fork of its own would have had; then as exec_stage1."""
    import qkernel   # noqa: F401 - what _exec imports, while the host's files are still what we see
    data = sock.recv(channel.MAX_MSG)
    if not data:
        raise SetupError("exec: the supervisor ended the exec")   # (it told the caller why)
    init_pid, spec, proc = pickle.loads(data)
    exec_stage1(sock, init_pid, spec, proc, preserved)


def exec_stage1(sock: socket.socket, init_pid: int, spec: Spec, proc: Process, preserved: list[int]) -> None:
    """Join the init's namespaces (all at once, through its pidfd), then fork the process."""
    L.prctl(L.PR_SET_DUMPABLE, 0)
    drop_runtime_fds(sock, preserved)
    _place_preserved(preserved)
    go = _expect(sock, "go")
    if go.get("error"):   # a step the supervisor took for us (execCPUAffinity.initial)
        raise SetupError(go["error"])
    affinity = proc.exec_cpu_affinity or (spec.process.exec_cpu_affinity if spec.process else None)
    if affinity is None or affinity.final is not None or affinity.initial is None:
        _cpus_in_cgroup(affinity.final if affinity is not None else None)
    # (initial alone: the process stays on those CPUs, as the spec says of an omitted final)
    flags = 0
    for t, name in PROC_NS_NAMES.items():
        try:
            if os.stat(f"/proc/{init_pid}/ns/{name}").st_ino != os.stat(f"/proc/self/ns/{name}").st_ino:
                flags |= NS_FLAGS[t]
        except FileNotFoundError:
            continue
    # a container without a new mount namespace lives in a chroot: enter the same one, through
    # the init's root opened before setns (another mount namespace may show another /proc)
    shared_mounts = not spec.linux.new_namespace("mount")
    root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if shared_mounts else -1
    pidfd = L.pidfd_open(init_pid)
    try:
        L.setns(pidfd, flags)
    except OSError as e:
        raise SetupError(f"exec: joining the container's namespaces: {e.strerror}") from None
    finally:
        os.close(pidfd)
    if shared_mounts:
        try:
            rootfs.chroot(root)
        finally:
            os.close(root)
    pid, reported = _fork_reported(sock)
    if pid == 0:
        run_child(sock, lambda: exec_init(sock, spec, proc, reported, len(preserved)))
    _report_pid(sock, pid, reported)


def exec_init(sock: socket.socket, spec: Spec, proc: Process, reported: int, preserve_fds: int) -> None:
    L.prctl(L.PR_SET_DUMPABLE, 0)
    _await_report(reported)
    os.setsid()
    start = _expect(sock, "start")
    process.set_rlimits(proc)
    if proc.terminal:
        _terminal(sock, proc)
    _exec(sock, spec, proc, start["platform"], preserve_fds, _socket_filter(start))
