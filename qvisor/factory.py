"""The sandbox factory: a pre-imported quark that forks supervisors and runs the hot verbs.

Every `quark` call used to be a new CPython process that paid the interpreter's start and then
its imports before any work, each longer than runc's whole `start`, and every supervisor paid the
imports again (measured: bench/README.md, "Start-up and supervisor memory"). The factory
imports everything once, freezes its objects out of the garbage collector's reach (so forked
children keep sharing those pages), and listens on a unix socket. A client (the C front end,
qvisor/frontend.c, the Python CLI, or the shim) sends one request: the argv of a `quark` call, its
environment and umask, and its stdin, stdout, stderr and working directory as fds. The factory
checks that the caller may do what it asks and is in the same place, forks a worker that becomes
that caller's `quark` process (its stdio, cwd, environment, umask, rlimits, oom_score_adj, nice,
scheduling policy, I/O priority and CPUs, for create its cgroups, and a cmdline naming the call),
and the worker runs the verb exactly as the CLI does and sends back the exit status. The factory
itself runs with the kernel's default scheduling attributes, whatever its first caller had. A
create's supervisor is forked from the worker as it is from the CLI, so it is its own process,
session and confinement; it only shares, copy-on-write, the factory's pages of imported code.

The factory is optional. It answers "fall back" (and the client runs the verb itself, as before)
when the verb is not one it serves, when the caller is not root or not in the factory's
namespaces, root, credentials, capabilities, seccomp and LSM context, when the caller's
rlimits exceed the factory's, when the caller's parent chain holds a runc-compatible manager
that reaps the container's init itself (the supervisor must then be re-parented to it, see
Supervisor._choose_reaper), and when quark's code on disk changed since the factory imported it
(then it also exits; the next create starts a fresh one). It is started by the first create and
exits after QUARK_FACTORY_IDLE seconds without a request (default 300). QUARK_FACTORY=0 turns it
off; QUARK_FACTORY_DIR moves its socket, lock and pid file (default /run/quark).
"""
from __future__ import annotations

import array
import errno
import fcntl
import gc
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

log = logging.getLogger("quark.factory")

MAGIC = b"quark-factory/2"
# programs besides quark that the factory runs: entry points of this group (name -> a dict with
# "main", "serves", "adopts_cgroups", "preload"; the shim registers containerd-shim-quark-v1)
PROGRAM_GROUP = "quark.factory"
SOCK_NAME, LOCK_NAME, PID_NAME, LOG_NAME = "factory.sock", "factory.lock", "factory.pid", "factory.log"
# verbs that end promptly and need no terminal or signal forwarding; the others run in the client
SERVED = frozenset({"create", "start", "state", "kill", "delete", "pause", "resume", "ps", "list", "snapshot"})
MAX_REQUEST = 1 << 20          # argv + environment; a bigger request falls back
_NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup", "time")
_SAME_STATUS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
_RLIMITS = {getattr(resource, n): n for n in sorted(dir(resource), reverse=True) if n.startswith("RLIMIT_")}
_PACKAGES = ("qlib", "qvisor", "qkernel", "tsor")


def enabled() -> bool:
    return os.environ.get("QUARK_FACTORY", "1") != "0"


def directory() -> str:
    return os.environ.get("QUARK_FACTORY_DIR", "/run/quark")


def socket_path(where: str | None = None) -> str:
    return os.path.join(where or directory(), SOCK_NAME)


# ---- the wire: one SOCK_SEQPACKET message each way ------------------------------------------
# request: MAGIC, program ("quark", or one of PROGRAM_GROUP), argc, argv..., envc, env..., umask
# (octal), NUL-separated; SCM_RIGHTS carries stdin, stdout, stderr and an O_PATH fd of the working
# directory. Reply: b"F" + reason (the client runs the verb itself), or b"X" + the exit status once
# the verb is done.

def encode_request(argv: list[str], env: dict[str, str], umask: int, prog: str = "quark") -> bytes:
    fields = [MAGIC, prog.encode(), str(len(argv)).encode(), *(os.fsencode(a) for a in argv), str(len(env)).encode(),
              *(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()), b"%o" % umask]
    return b"\0".join(fields)


def decode_request(data: bytes) -> tuple[list[str], dict[str, str], int, str]:
    """(argv, env, umask, program); ValueError for anything malformed."""
    f = data.split(b"\0")
    if f[0] != MAGIC or len(f) < 3:
        raise ValueError("not a quark-factory/2 request")
    prog = os.fsdecode(f[1])
    if not prog:
        raise ValueError("no program named")
    argc = int(f[2])
    if argc < 0 or len(f) < 5 + argc:
        raise ValueError("truncated request")
    argv = [os.fsdecode(a) for a in f[3:3 + argc]]
    envc = int(f[3 + argc])
    pairs = f[4 + argc:4 + argc + envc]
    if envc < 0 or len(pairs) != envc or len(f) != 5 + argc + envc:
        raise ValueError("truncated request")
    env = {}
    for p in pairs:
        k, sep, v = p.partition(b"=")
        if not sep:
            raise ValueError("environment entry without '='")
        env[os.fsdecode(k)] = os.fsdecode(v)
    return argv, env, int(f[-1], 8), prog


def request(argv: list[str], stdio: tuple[int, int, int] = (0, 1, 2), env: dict[str, str] | None = None,
            where: str | None = None, prog: str = "quark") -> int | None:
    """Run `quark argv` (or `prog argv`) in the factory; its exit status, or None when the caller
    must run it itself (no factory, or it declined)."""
    data = encode_request(argv, dict(os.environ) if env is None else env, _umask(), prog)
    if len(data) > MAX_REQUEST:
        return None
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    except OSError:
        return None
    cwd = -1
    try:
        s.connect(socket_path(where))
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        socket.send_fds(s, [data], [*stdio, cwd])
    except OSError:
        s.close()
        return None   # no factory, or it went away before taking the request
    finally:
        if cwd >= 0:
            os.close(cwd)
    try:
        reply = s.recv(4096)
    except ConnectionResetError:
        return None   # the factory exited with our request still queued: nothing of it ran
    except OSError:
        reply = b""
    finally:
        s.close()
    if reply[:1] == b"X":
        return int(reply[1:])
    if reply[:1] == b"F":
        log.debug("factory declined: %s", reply[1:].decode(errors="replace"))
        return None   # declined before anything ran
    # the worker ran (part of) the verb and died: running it again could do it twice
    from qlib.errors import QuarkError
    raise QuarkError(f"{prog}: the factory's worker ended without an exit status")


def _umask() -> int:
    old = os.umask(0o22)
    os.umask(old)
    return old


def ensure_running(where: str | None = None) -> None:
    """Start a factory in the background unless one answers (called by a create that ran without
    one). Never waits for it: this create goes on by itself, the next one uses it."""
    if not enabled():
        return
    path = socket_path(where)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        return
    except OSError:
        pass
    finally:
        s.close()
    where = where or directory()
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        logf = os.open(os.path.join(where, LOG_NAME), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("cannot start the sandbox factory in %s: %s", where, e.strerror)
        return
    try:
        subprocess.Popen([sys.executable, "-m", "qvisor.factory", "--dir", where], stdin=subprocess.DEVNULL,
                         stdout=logf, stderr=logf, close_fds=True, start_new_session=True, cwd="/")
    except OSError as e:
        log.warning("cannot start the sandbox factory: %s", e.strerror)
    finally:
        os.close(logf)


def stop(where: str | None = None, timeout: float = 5.0) -> int:
    """Stop the factory serving `where` (SIGTERM by the pid it recorded, confirmed by the lock it
    holds); its pid, or 0 when none ran."""
    where = where or directory()
    try:
        with open(os.path.join(where, PID_NAME)) as f:
            pid = int(f.read().strip() or 0)
        lock = os.open(os.path.join(where, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return 0
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return 0   # nobody holds the lock: no factory runs; the pid file is stale
        except BlockingIOError:
            pass
        pidfd = os.pidfd_open(pid)
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        return pid
    except ProcessLookupError:
        return 0
    finally:
        os.close(lock)


# ---- the server ----------------------------------------------------------------------------

def _package_dirs() -> list[str]:
    """The directories of quark's modules (and the compiled fast path): a change in any of them
    makes a running factory stale."""
    base = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = []
    for pkg in _PACKAGES:
        for d, subdirs, _files in os.walk(os.path.join(base, pkg)):
            subdirs[:] = [x for x in subdirs if x != "__pycache__"]
            dirs.append(d)
    return dirs


def _watch_code() -> int:
    """An inotify fd that has an event queued once any of quark's modules changes (written,
    touched, added, removed, renamed). Set up before the imports, so nothing changed in between
    goes unseen; checking it costs one read(2) per request."""
    from qlib import linux as L
    fd = L.inotify_init()
    for d in _package_dirs():
        L.inotify_add_watch(fd, d, L.IN_CHANGES)
    return fd


def _code_changed(fd: int) -> bool:
    from qlib import linux as L
    # __pycache__ appearing (the first import of a never-compiled package) is no change of code
    return any(name != "__pycache__" for name in L.inotify_names(fd))


def _namespaces(pid: int | str) -> tuple:
    out = []
    for ns in _NAMESPACES:
        try:
            out.append(os.stat(f"/proc/{pid}/ns/{ns}").st_ino)
        except FileNotFoundError:
            out.append(None)   # a kernel without this namespace type
    return tuple(out)


def _lsm(pid: int | str) -> bytes:
    try:
        with open(f"/proc/{pid}/attr/current", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ancestors(pid: int) -> list[str]:
    from qlib import procfs
    names = []
    while pid > 1:
        try:
            names.append(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
        except OSError:
            break
        pid = procfs.parent_pid(pid) or 0
    return names


class Factory:
    def __init__(self, where: str, idle_s: float) -> None:
        self.where, self.idle_s = where, idle_s
        self.listener: socket.socket | None = None
        self.lock_fd = -1
        self.me: tuple = ()
        self.watch = -1                # inotify on quark's code (_watch_code)
        self.stale = False
        self.spare: socket.socket | None = None   # our end of the pre-forked worker's socket
        self.spare_pid = 0
        self.seed: socket.socket | None = None    # our end of the pre-forked supervisor's socket (_fork_seed)
        self.zygote: socket.socket | None = None  # our end of the seeds' forking process's socket (_zygote)
        self.seed_asked = False                   # the zygote is forking one
        self.wakeup: tuple[int, int] = (-1, -1)   # the signal wake-up pipe

    def serve(self) -> int:
        os.makedirs(self.where, mode=0o700, exist_ok=True)
        self.lock_fd = os.open(os.path.join(self.where, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0   # another factory serves this directory
        self.watch = _watch_code()
        _preload()
        # the factory serves every caller: it runs with the kernel's defaults, not the first
        # caller's (a `nice -n 19` or `taskset -c 0` create started it); workers take on theirs
        from qlib import sched
        try:
            sched.NEUTRAL.apply()
        except OSError as e:
            log.warning("the factory keeps its starter's scheduling attributes: %s", e)
        path = socket_path(self.where)
        try:
            os.unlink(path)   # a dead factory's (we hold the lock: no live one owns it)
        except FileNotFoundError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)   # 0600 from birth: only root may connect (and SO_PEERCRED checks)
        finally:
            os.umask(old)
        self.listener.listen(64)
        with open(os.path.join(self.where, PID_NAME + ".tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(self.where, PID_NAME + ".tmp"), os.path.join(self.where, PID_NAME))
        self.me = self._identity(os.getpid())
        stop_r, stop_w = self.wakeup = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(stop_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        gc.collect()
        gc.freeze()   # the imported objects stay out of the collector's passes: their pages stay shared
        log.info("serving %s (pid %d)", path, os.getpid())
        self._fork_spare()
        self._start_zygote()
        self._fork_seed()
        idle_until = time.monotonic() + self.idle_s
        try:
            while not self.stale:
                watched = [self.listener, stop_r] + ([self.zygote] if self.zygote is not None else [])
                ready, _, _ = select.select(watched, [], [], max(0.0, idle_until - time.monotonic()))
                if self.zygote is not None and self.zygote in ready:
                    ready.remove(self.zygote)
                    self._take_seed_from_zygote()
                if stop_r in ready:
                    sigs = os.read(stop_r, 64)
                    from qlib import linux as L   # here, not at the top: clients import this module
                    L.reap_exited()   # workers (spares included)
                    if set(sigs) - {signal.SIGCHLD}:
                        break   # SIGTERM, SIGINT or SIGHUP
                if self.listener in ready:
                    self._accept()
                    idle_until = time.monotonic() + self.idle_s
                elif not ready and time.monotonic() >= idle_until:
                    log.info("idle for %.0f s: exiting", self.idle_s)
                    break
        finally:
            self._close()
        return 0

    def _close(self) -> None:
        # the socket first, while the lock still says the name is ours
        try:
            os.unlink(socket_path(self.where))
        except OSError:
            pass
        try:
            os.unlink(os.path.join(self.where, PID_NAME))
        except OSError:
            pass
        if self.listener is not None:
            self.listener.close()
        if self.spare is not None:
            self.spare.close()   # the spare worker reads EOF and exits
        if self.seed is not None:
            self.seed.close()    # and so does the seed
        if self.zygote is not None:
            self.zygote.close()  # and the zygote
        os.close(self.lock_fd)

    @staticmethod
    def _identity(pid: int) -> tuple:
        from qlib import procfs
        st = procfs.status(pid)
        root = os.stat(f"/proc/{pid}/root")
        return (_namespaces(pid), (root.st_dev, root.st_ino), tuple(st.get(k) for k in _SAME_STATUS), _lsm(pid))

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(5)   # a client that connects and sends nothing must not block the factory
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 4)
            pid, uid, _gid = array.array("i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if not data and not fds:
                return   # a probe (ensure_running): it connected to see that we answer, and left
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 4:
                return self._decline(conn, "malformed request")
            try:
                argv, env, umask, prog = decode_request(data)
            except ValueError as e:
                return self._decline(conn, str(e))
            reason = self._refusal(pid, uid, argv, env, prog)
            if reason:
                return self._decline(conn, reason)
            if not self._hand_to_spare(pid, data, conn, fds, self._seed_for(prog, argv)):
                if os.fork() == 0:
                    self._detach()
                    self._work(conn, fds, argv, env, umask, pid, prog)   # never returns
        except (OSError, ValueError) as e:
            log.warning("request failed: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
        if not self.stale:
            self._fork_spare()   # the next request's worker, forked while nobody waits for it
            self._fork_seed()    # and the next create's supervisor, if this request took it

    def _seed_for(self, prog: str, argv: list[str]) -> socket.socket | None:
        """The seed's channel when this request forks a supervisor (a quark create or run -d)."""
        if prog != "quark" or not PROGRAMS[prog]["adopts_cgroups"](argv):
            return None
        if self.seed is None and self.seed_asked:   # creates back to back: the zygote is forking it
            self._take_seed_from_zygote(timeout=0.5)
        seed, self.seed = self.seed, None
        return seed

    def _hand_to_spare(self, caller: int, data: bytes, conn: socket.socket, fds: list[int],
                       seed: socket.socket | None = None) -> bool:
        spare, self.spare = self.spare, None
        try:
            if spare is None:
                return False
            _foreground(self.spare_pid)   # (it may still be rehearsing, at idle priority)
            socket.send_fds(spare, [caller.to_bytes(4, "little") + data],
                            [conn.fileno(), *fds] + ([seed.fileno()] if seed is not None else []))
            return True
        except OSError:
            return False   # it died: fork one for this request (which forks its supervisor itself)
        finally:
            if spare is not None:
                spare.close()
            if seed is not None:
                seed.close()   # the worker has it now (or, if it could not take it, the seed exits)

    def _fork_spare(self) -> None:
        """Fork a worker ahead of its request: the fork of a process this size (a few ms, and
        the copy-on-write faults of its first steps) is then off the path of the next request."""
        if self.spare is not None:
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as e:
            log.warning("cannot fork a spare worker: %s", e)
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            self._detach()
            _background()   # until a request comes: the rehearsal never competes with one
            _rehearse()
            try:
                data, fds, _flags, _ = socket.recv_fds(theirs, MAX_REQUEST + 4, 6)
            except OSError:
                os._exit(0)
            if len(fds) not in (5, 6) or len(data) < 4:
                os._exit(0)   # the factory exited, or was done with us
            theirs.close()
            if len(fds) == 6:   # a create: the supervisor to hand over to (container.create)
                _keep_seed(fds.pop())
            try:
                argv, env, umask, prog = decode_request(data[4:])
            except ValueError:
                os._exit(1)   # cannot be: the factory decoded it before handing it on
            self._work(socket.socket(fileno=fds[0]), fds[1:], argv, env, umask, int.from_bytes(data[:4], "little"),
                       prog)
        theirs.close()
        self.spare, self.spare_pid = ours, pid

    def _fork_seed(self) -> None:
        """Fork, ahead of the next create, the process that becomes its supervisor.

        A process forked from the factory pays a private page for every page of the factory's it
        writes; CPython writes to every object it touches (reference counts). A supervisor forked
        from the worker that ran `quark create` inherited the pages that worker wrote (the
        rehearsal, argument parsing, loading and checking the spec: pages it never touches again)
        and kept them for the container's life (measured: bench/README.md, "Start-up and
        supervisor memory"). The seed is forked ahead (by the zygote,
        _start_zygote; by the factory if there is none) and waits; the worker hands it what its
        fork would have given it (container._hand_over:
        the state, the spec, its stdio, cwd, environment, umask, limits and cgroups) and it becomes
        the supervisor, exactly as the forked one would have. A create that gets none (no spare
        worker, or the seed died) forks its supervisor as before."""
        if self.seed is not None or self.seed_asked:
            return
        if self.zygote is not None:
            try:
                self.zygote.send(b"s")   # its answer comes to the loop (_take_seed_from_zygote)
                self.seed_asked = True
                return
            except OSError:
                self._lost_zygote()
        self.seed = self._fork_detached("a supervisor seed", _await_hand_over)

    def _start_zygote(self) -> None:
        """Fork the process that forks the seeds. Every page the factory writes after a fork is a
        page the child no longer shares with it, and the factory writes many of them serving each
        request (a waiting seed's private memory grows with every request; measured:
        bench/README.md, "Start-up and supervisor memory"); a supervisor, which lives as long as
        its container, kept a copy of them all. The zygote runs one small loop and writes little,
        so what its seeds share with it stays shared."""
        self.zygote = self._fork_detached("the seeds' zygote", _zygote)

    def _fork_detached(self, what: str, run: Callable[[socket.socket], None]) -> socket.socket | None:
        """Fork a child that drops what is the factory's own (_detach) and runs `run` with its end
        of a new channel, never to return; our end, or None when it could not be forked."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError as e:
            log.warning("cannot fork %s: %s", what, e)
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            ours.close()
            self._detach()
            try:
                run(theirs)
            finally:
                os._exit(0)
        theirs.close()
        return ours

    def _take_seed_from_zygote(self, timeout: float | None = None) -> None:
        self.zygote.settimeout(timeout)
        try:
            data, fds, _, _ = socket.recv_fds(self.zygote, 16, 1)
        except TimeoutError:
            return   # still forking: this create forks its own supervisor
        except OSError:
            data, fds = b"", []
        finally:
            self.zygote.settimeout(None)
        self.seed_asked = False
        if not data:
            return self._lost_zygote()
        if not fds:
            return   # it could not fork one: the next create forks its supervisor itself
        self.seed = socket.socket(fileno=fds[0])
        self.seed.set_inheritable(False)

    def _lost_zygote(self) -> None:
        log.warning("the seeds' zygote is gone: seeds are forked from the factory")
        self.zygote.close()
        self.zygote = None
        self.seed_asked = False

    def _detach(self) -> None:
        """In a forked worker: drop everything of the factory's own, so none of it goes on to a
        supervisor (its socket, lock, wake-up pipe, code watch, the next spare's channel)."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        if self.listener is not None:
            self.listener.close()
        if self.spare is not None:
            self.spare.close()
        if self.seed is not None:
            self.seed.close()
        if self.zygote is not None:
            self.zygote.close()
        for fd in (self.lock_fd, self.watch, *self.wakeup):
            if fd >= 0:
                os.close(fd)

    @staticmethod
    def _decline(conn: socket.socket, reason: str) -> None:
        log.info("declined: %s", reason)
        try:
            conn.send(b"F" + reason.encode())
        except OSError:
            pass

    def _refusal(self, pid: int, uid: int, argv: list[str], env: dict[str, str], prog: str = "quark") -> str:
        """Why this request must run in the client instead ("" when the factory may run it)."""
        if uid != 0:
            return "the caller is not root"
        program = PROGRAMS.get(prog)
        if program is None:
            return f"not a program the factory runs: {prog!r}"
        if not program["serves"](argv):
            return "not a verb the factory serves"
        if any(a.startswith("--preserve-fds") for a in argv):
            return "--preserve-fds: the fds are the client's to hand on"
        if env.get("QUARK_INIT_REAPER") or env.get("QUARK_FACTORY") == "0":
            return "the caller chose how the init is reaped, or turned the factory off"
        if self.stale or _code_changed(self.watch):
            self.stale = True
            return "quark's code changed since the factory started: it exits"
        try:
            if self._identity(pid) != self.me:
                return "the caller's namespaces, root, credentials or security context differ from the factory's"
            for r in _RLIMITS:   # the worker takes the caller's limits: it cannot raise a hard one
                caller, mine = resource.prlimit(pid, r)[1], resource.getrlimit(r)[1]
                if mine != resource.RLIM_INFINITY and (caller == resource.RLIM_INFINITY or caller > mine):
                    return f"the caller's hard {_RLIMITS[r]} is above the factory's"
            from qlib.procfs import RUNC_MANAGERS   # they reap the init themselves
            if any(name.startswith(RUNC_MANAGERS) for name in _ancestors(pid)):
                return "a runc-compatible manager above the caller reaps the container's init"
        except (OSError, KeyError):
            return "the caller went away"
        return ""

    def _work(self, conn: socket.socket, fds: list[int], argv: list[str], env: dict[str, str],
              umask: int, caller: int, prog: str = "quark") -> None:
        """The forked worker: become the caller's `quark` process and run the verb."""
        code = 1
        # what the verb forks (a create's supervisor, the shim's server) must not hold the
        # client's connection: its child closes its copy at once (a no-op further down, where the
        # object already says closed)
        os.register_at_fork(after_in_child=conn.close)
        try:
            conn.settimeout(None)
            try:
                self._adopt(caller, fds, env, umask, argv, prog)
            except OSError as e:
                self._decline(conn, f"cannot take on the caller's context: {e}")
                os._exit(0)
            try:
                code = PROGRAMS[prog]["main"](argv)
            except SystemExit as e:   # argparse's usage errors, --help, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            _forget_the_caller()
            try:
                conn.send(b"X%d" % code)
            except OSError:
                pass
            # the exit of a process this size (its page tables: a few ms) runs when a CPU has
            # nothing else to do, not beside the caller's next step (a create's supervisor, or start)
            _background()
            os._exit(code & 0xFF)

    @staticmethod
    def _adopt(caller: int, fds: list[int], env: dict[str, str], umask: int, argv: list[str], prog: str) -> None:
        for i in range(3):
            os.dup2(fds[i], i)   # inheritable: these are the process's stdio from now on
        os.fchdir(fds[3])
        for fd in fds:
            if fd > 2:
                os.close(fd)
        fds.clear()
        os.umask(umask)
        os.environ.clear()
        os.environ.update(env)
        for r in _RLIMITS:
            resource.setrlimit(r, resource.prlimit(caller, r))
        with open(f"/proc/{caller}/oom_score_adj") as f:
            adj = f.read().strip()
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(adj)
        # what fork would have passed on (nice, policy, I/O priority, CPUs): the caller's, not the
        # factory's, for the verb and for the supervisor and container a create makes
        from qlib import sched
        sched.Scheduling.of(caller).apply()
        if PROGRAMS[prog]["adopts_cgroups"](argv):   # a create's supervisor (the shim's server)
            _join_cgroups_of(caller)                 # lives where the caller's processes live
        try:
            from qlib import linux as L
            L.set_cmdline([prog, *argv], env)
        except OSError as e:   # cosmetic (ps); a kernel without PR_SET_MM_MAP
            log.debug("cmdline not set: %s", e)


# in a worker handed a supervisor seed with its request: the channel to it (take_seed)
_seed_channel: socket.socket | None = None
MAX_HAND_OVER = 1 << 20


def _keep_seed(fd: int) -> None:
    global _seed_channel
    os.set_inheritable(fd, False)   # SCM_RIGHTS gave it without O_CLOEXEC
    _seed_channel = socket.socket(fileno=fd)


def take_seed() -> socket.socket | None:
    """In a factory worker: the channel to a pristine supervisor-to-be, if this request came with
    one (only once: a create forks one supervisor)."""
    global _seed_channel
    seed, _seed_channel = _seed_channel, None
    return seed


def _zygote(sock: socket.socket) -> None:
    """Fork a seed for each byte the factory sends, and send it back our end of the seed's
    socket; exit on EOF. Its children (the seeds, then the supervisors they become) are reaped by
    the kernel (SIGCHLD ignored here, and set back to the default in each of them)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    _fill_free_blocks()
    while True:
        try:
            if not sock.recv(16):
                os._exit(0)
        except OSError:
            os._exit(0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            ours.close()
            _await_hand_over(theirs)   # never returns
        theirs.close()
        try:
            socket.send_fds(sock, [b"s"], [ours.fileno()] if pid > 0 else [])
        except OSError:
            os._exit(0)
        finally:
            ours.close()


_fillers: list = []   # the zygote's: objects that fill the free blocks of the allocator's pools


def _fill_free_blocks() -> None:
    """Fill every free block of pymalloc's partly used pools with an object kept for good, so that
    what a seed allocates goes to fresh pools instead. Each free block sits on a page the seed
    shares with us; an object a supervisor allocates there costs it that whole 4 KiB page, and
    the few thousand objects it keeps were spread over as many pages. In fresh pools they lie
    side by side, and a supervisor keeps fewer private pages (measured: bench/README.md, "Start-up
    and supervisor memory")."""
    for size, free in _free_blocks().items():
        if size == 32:
            _fillers.extend(1_000_000_000 + i for i in range(free))   # a one-digit int: 28 bytes
        elif size >= 48:
            _fillers.extend(bytes(size - 33) for _ in range(free))   # bytes(n): a block of n + 33
        # (16: no object of CPython's is that small; a few such blocks stay free)


def _free_blocks() -> dict[int, int]:
    """Free blocks in used pools per block size, from sys._debugmallocstats (which prints to fd 2:
    nothing of it is shown). Empty when the interpreter does not report them (PYTHONMALLOC=malloc)."""
    import tempfile
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    free = {}
    for line in text.splitlines():   # "class size pools in-use free", after its header
        fields = line.split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            free[int(fields[1])] = int(fields[4])
    return free


def _await_hand_over(sock: socket.socket) -> None:
    """The seed: wait for a worker's hand-over and become that create's supervisor; exit on EOF
    (the factory is gone, or the worker that had us created nothing)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_HAND_OVER, 8)
    except OSError:
        os._exit(0)
    sock.close()
    if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        os._exit(0)
    from qvisor import container
    container.supervise_handed_over(data, fds)   # never returns


def _background() -> None:
    """Run at SCHED_IDLE: only when no other task wants the CPU. For the factory's own work off a
    request's path (a spare's rehearsal, a worker's exit), which on a machine of two CPUs otherwise
    ran beside the create or start that followed it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass


def _foreground(pid: int) -> None:
    """Back to the default policy (a spare handed a request, which then takes on its caller's)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:   # (gone: the hand-off fails and the request gets a fork of its own)
        pass


def _forget_the_caller() -> None:
    """The verb is done; before the caller hears so, drop what this process holds of it: its stdio
    (a pipe reader sees end of file now), its cwd (a bundle the caller is in) and its command line
    (`ps` and /proc/PID/cmdline name the bundle). The exit that follows takes a few ms for a process
    this size (its page tables); the caller does not wait for it."""
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.chdir("/")
        from qlib import linux as L
        L.set_cmdline(["quark-factory-worker"], {})
    except OSError:
        pass


def _rehearse() -> None:
    """In a spare worker, while no request waits: run `quark state` of a container under a root
    that does not exist (it fails at once, writes nothing; its output goes to /dev/null). A forked
    process pays a copy-on-write fault for each page it first writes, and running Python writes
    to every object it touches (reference counts): a verb takes hundreds of such faults. The
    rehearsal takes more than half of them before the request comes (how many, and what it saves
    `quark state`: bench/README.md, "Start-up and supervisor memory")."""
    null = os.open(os.devnull, os.O_RDWR)
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        PROGRAMS["quark"]["main"](["--root", "/nonexistent/quark-factory-rehearsal", "state", "rehearsal"])
    except BaseException:   # noqa: BLE001 — a rehearsal's outcome is no one's concern
        pass
    finally:
        for fd, old in zip((0, 1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def _join_cgroups_of(pid: int) -> None:
    """Move this process into the cgroups `pid` is in, in every hierarchy (v1 and v2)."""
    with open(f"/proc/{pid}/cgroup") as f:
        join_cgroups(f.read())


def join_cgroups(theirs: str) -> None:
    """Move this process into the cgroups a /proc/PID/cgroup text names."""
    from qlib import procfs
    with open("/proc/self/cgroup") as f:
        if f.read() == theirs:
            # where the caller is already (the usual case): a move is slow on v1
            # (bench/README.md, "Start-up and supervisor memory")
            return
    # (controllers or name=, or {""} for v2) and mount point of each hierarchy mounted at its root
    mounts = [({""} if m.fstype == "cgroup2" else set(m.super_options.split(",")), m.mount_point)
              for m in procfs.mountinfo() if m.fstype in ("cgroup", "cgroup2") and m.root == "/"]
    me = str(os.getpid())
    for line in theirs.splitlines():
        _hid, ctrls, path = line.split(":", 2)
        want = set(ctrls.split(",")) if ctrls else {""}
        for opts, mnt in mounts:
            if want <= opts:
                try:
                    with open(os.path.join(mnt + path, "cgroup.procs"), "w") as f:
                        f.write(me)
                except OSError as e:
                    if e.errno != errno.ENOENT:   # a hierarchy that vanished meanwhile
                        raise
                break


def served(argv: list[str]) -> bool:
    """Whether the factory runs this quark command line: the SERVED verbs, and `run -d` (a run in
    the foreground waits for its container and forwards signals, which only the CLI can)."""
    from qvisor import cli
    verb = cli._verb_of(argv)
    return verb in SERVED or (verb == "run" and cli.detached(argv))


def _quark_program() -> dict:
    from qvisor import cli
    return {"main": lambda argv: cli.main(argv, in_factory=True),
            "serves": served,
            "adopts_cgroups": lambda argv: cli._verb_of(argv) in ("create", "run"),
            "preload": ()}


# name -> program, filled by _preload in the factory (quark's own, and PROGRAM_GROUP's entry points)
PROGRAMS: dict[str, dict] = {}


def _preload() -> None:
    """Import what the served verbs and a supervisor use, so forks start with it loaded."""
    import importlib
    from importlib.metadata import entry_points
    from qvisor import cli
    PROGRAMS["quark"] = _quark_program()
    for ep in entry_points(group=PROGRAM_GROUP):
        try:
            PROGRAMS[ep.name] = ep.load()
            for name in PROGRAMS[ep.name].get("preload", ()):
                importlib.import_module(name)
        except Exception as e:   # noqa: BLE001 — a broken plugin: its program runs without the factory
            PROGRAMS.pop(ep.name, None)
            log.warning("program %s not served: %s", ep.name, e)
    for verb in SERVED | {"run"}:
        importlib.import_module(f"qvisor.commands.{cli.COMMANDS[verb][0]}")
    for name in ("qvisor.container", "qvisor.validate", "qvisor.spec", "qvisor.supervisor", "qvisor.hooks",
                 "qvisor.procview", "qvisor.fuse", "qvisor.security", "qvisor.hibernate", "qvisor.readiness",
                 "qvisor.swap", "qkernel.fastpath",
                 "qkernel", "qkernel.seccomp_platform", "qkernel.policy", "tsor.intercept", "tsor.sandbox",
                 "qvisor.cgroups.v1", "qvisor.cgroups.v2", "yaml", "seccomp",
                 "pickle"):   # the hand-over to a supervisor seed (container._hand_over)
        try:
            importlib.import_module(name)
        except ImportError as e:   # optional parts (libseccomp's bindings): the worker imports on use
            log.info("not preloaded: %s (%s)", name, e)
    for verb in SERVED | {"run"}:
        cli.build_parser(verb)   # cached: a worker only parses
    # a supervisor's first filter build pays libseccomp's and the table's set-up: pay it here once
    try:
        from qkernel import policy
        policy.build_base_filter("seccomp", False)
        policy.build_base_filter("seccomp", True)
        from qvisor import confine
        confine.warm()   # the supervisor's own filter, compiled to BPF: a supervisor only loads it
    except Exception as e:   # noqa: BLE001 — only a warm-up: the supervisor builds (and reports) for real
        log.info("seccomp filter warm-up skipped: %s", e)


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m qvisor.factory", description="quark's sandbox factory")
    p.add_argument("--dir", default=directory(), help="where its socket, lock and pid file live")
    p.add_argument("--idle", type=float, default=float(os.environ.get("QUARK_FACTORY_IDLE", "300")),
                   help="exit after this many seconds without a request")
    p.add_argument("--stop", action="store_true", help="stop the factory serving --dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.stop:
        pid = stop(args.dir)
        print(f"stopped {pid}" if pid else "no factory was running")
        return 0
    return Factory(args.dir, args.idle).serve()


if __name__ == "__main__":
    # run as the module qvisor.factory, not as a second copy of it named __main__: a worker's code
    # reaches the factory's state through the module (container._hand_over: take_seed)
    from qvisor import factory
    sys.exit(factory.main())
