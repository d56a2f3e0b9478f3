"""Container operations behind the CLI verbs (and usable as a library, e.g. by the shim).

Every function takes the state root and the container id, validates the container's status the
way runc does, and raises a QuarkError subclass that says what is wrong.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import socket
import time
from typing import TYPE_CHECKING

from qlib import linux as L
from qlib import procfs
from qlib.errors import InvalidArgument, InvalidState, NotFound, QuarkError, SupervisorGone, from_kind
from qlib.version import VERSION
from qvisor import cgroups, channel, logfile
from qvisor.client import Connection
from qvisor.factory import caller, seeds
from qvisor.state import (
    CREATED,
    CREATING,
    PAUSED,
    RUNNING,
    SOCK_NAME,
    STOPPED,
    ContainerState,
    StateStore,
    init_alive,
    now_rfc3339,
)

if TYPE_CHECKING:   # imported by create itself: the other verbs would pay for it
    from qvisor.spec import Spec

log = logging.getLogger("quark")
CONFIG_COPY = "config.json"
DEVICE_UPDATES = "device-updates.json"   # rules `quark update` added (cgroup v2 rebuilds its program)

def preserved_fds(count: int) -> list[int]:
    """The caller's fds that --preserve-fds N passes to the container's process: 3 .. 2+N, which
    must be open (they cannot be the runtime's own: those open above the caller's)."""
    if count < 0:
        raise InvalidArgument(f"--preserve-fds {count}: must not be negative")
    for fd in range(3, 3 + count):
        try:
            os.fstat(fd)
        except OSError:
            raise InvalidArgument(f"--preserve-fds {count}: fd {fd} is not open") from None
    return list(range(3, 3 + count))


def create(root: str, container_id: str, bundle: str, *, pid_file: str = "", console_socket: str = "",
           platform: str = "seccomp", log_file: str = "", log_format: str = "text", preserve_fds: int = 0,
           in_factory: bool = False) -> ContainerState:
    """Build the sandbox; its init waits for start. The caller's fds 3..2+preserve_fds are the
    init's too (the supervisor inherits them at those numbers and hands them on).

    The supervisor is forked twice (a grandchild), so that its parent exits at once and it learns
    who adopts it (see Supervisor._choose_reaper). In a sandbox factory's worker (`in_factory`)
    the answer is known — the factory declines every caller whose manager reaps the init itself —
    so one fork does, and the supervisor reaps its container's processes."""
    from qvisor import page_merge, security, validate
    from qvisor.spec import load_spec
    preserved_fds(preserve_fds)   # first: loading the spec must not take one of those numbers
    grace = cgroups.start_move_grace_period()   # the supervisor's move of stage 1 then waits less
    store = StateStore(root)
    bundle = os.path.abspath(bundle)
    spec = load_spec(bundle)
    validate.check_supported(spec)
    spec.own_namespaces = validate.own_namespaces(spec)
    # privileged / Unconfined: refused here (nothing made yet) or honoured in the sandbox and reported
    report = security.apply(spec, security.load_settings())
    merge_pages = page_merge.load_setting()   # supervisor.memory_merge
    if spec.process.terminal and not console_socket:
        raise QuarkError("process.terminal is true: --console-socket is required to receive the pty master")
    store.reserve(container_id)
    try:
        shutil.copyfile(os.path.join(bundle, "config.json"), store.path(container_id, CONFIG_COPY))
        # the supervisor takes this object on rather than opening the cgroup again (which parses the
        # mount table and costs it private memory; measured: bench/README.md, "Start-up and
        # supervisor memory")
        cgroup = cgroups.open_cgroup(spec.linux.cgroups_path or cgroups.default_path(container_id))
        st = ContainerState(id=container_id, bundle=bundle, created=now_rfc3339(),
                            annotations=security.reported(spec.annotations, report), rootfs=spec.root.path,
                            platform=platform, cgroup_path=cgroup.path, version=VERSION)
        r, w = os.pipe2(os.O_CLOEXEC)
        pid = 0
        args = SupervisorArgs(store, st, spec, platform, console_socket, preserve_fds, log_file, log_format, cgroup,
                              merge_pages)
        if not (in_factory and hand_over(w, args)):   # (handed over: a seed of the factory's is the supervisor)
            grace.join()   # a fork while it writes would give the supervisor its open cgroup.procs
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(r)
                    os.setsid()   # detach: a new session
                    if in_factory:
                        _supervise(w, 0, args)
                    launcher = os.getpid()
                    if os.fork() == 0:   # the supervisor is the grandchild
                        _supervise(w, launcher, args)
                finally:
                    os._exit(0)
        os.close(w)
        if not in_factory:
            os.waitpid(pid, 0)   # (in a factory worker the supervisor is our child: it outlives us)
        reply = _read_line(r)
        if "ok" not in reply:
            _wait_closed(r, 10.0)   # the supervisor, having removed everything, exits: wait for it
        os.close(r)
    except BaseException:
        store.remove(container_id)
        raise
    if "error" in reply or "ok" not in reply:
        if os.path.isdir(store.dir(container_id)) and not os.path.exists(store.path(container_id, "state.json")):
            store.remove(container_id)
        raise from_kind(reply.get("kind"), reply.get("error", "the supervisor exited before the container was created"))
    if pid_file:
        write_pid_file(pid_file, reply["pid"])
    return store.load(container_id)


def hand_over(ready_fd: int, args: SupervisorArgs) -> bool:
    """In a factory worker that was given a seed (qvisor/factory/seeds.py): hand it what a fork of this
    worker would give the supervisor (its SupervisorArgs; stdio, cwd, environment, umask,
    rlimits, oom score, scheduling attributes, cgroups and command line), and it becomes the
    supervisor. False when there is no seed, or it cannot take the hand-over: the caller forks the
    supervisor itself."""
    from qlib import sched
    from qvisor import phases
    seed = seeds.take_seed()
    if seed is None:
        return False
    import pickle
    import resource
    cwd = -1
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = f.read()
        with open("/proc/self/oom_score_adj") as f:
            oom = f.read().strip()
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = [os.fsdecode(a) for a in f.read().split(b"\0")[:-1]]
        context = {"args": args, "umask": caller.current_umask(), "env": dict(os.environ), "cmdline": cmdline,
                   "rlimits": {r: resource.getrlimit(r) for r in caller.RLIMITS}, "oom_score_adj": oom,
                   "cgroup": cgroup, "log_level": logging.getLogger().level, "verb_started": phases.verb_started,
                   "sched": sched.Scheduling.of(os.getpid())}
        cwd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        socket.send_fds(seed, [pickle.dumps(context, pickle.HIGHEST_PROTOCOL)], [0, 1, 2, cwd, ready_fd])
        return True
    except OSError as e:   # it died, or the message is too big for its socket
        log.debug("supervisor seed not used: %s", e)
        return False
    finally:
        if cwd >= 0:
            os.close(cwd)
        seed.close()


def supervise_handed_over(data: bytes, fds: list[int]) -> None:
    """In a seed of the factory's: take on what the worker handed over (hand_over), as a fork of
    that worker would have it, and supervise its container. Never returns."""
    ready_fd = fds[4] if len(fds) == 5 else -1
    try:
        import pickle
        import resource
        from qvisor import phases
        if ready_fd < 0:
            raise ValueError(f"{len(fds)} fds handed over, not 5")
        os.set_inheritable(ready_fd, False)   # as the pipe the worker made (O_CLOEXEC)
        context = pickle.loads(data)
        for i in range(3):
            os.dup2(fds[i], i)   # inheritable: the container's stdio, which stage 1 takes on
        os.fchdir(fds[3])
        for fd in fds[:4]:
            os.close(fd)
        os.umask(context["umask"])
        os.environ.clear()
        os.environ.update(context["env"])
        for r, limits in context["rlimits"].items():
            resource.setrlimit(r, limits)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(context["oom_score_adj"])
        context["sched"].apply()   # the worker's, which it took on from its caller
        cgroups.join(context["cgroup"])
        try:
            L.set_cmdline(context["cmdline"], context["env"])
        except OSError:   # cosmetic (ps), as in the worker
            pass
        os.setsid()   # detach: a new session
        logfile.root_level(context["log_level"])
        phases.verb_started = context["verb_started"]
        args = context["args"]
    except BaseException as e:   # noqa: BLE001 — tell the waiting create; nothing was made yet
        if ready_fd >= 0:
            msg = {"error": f"the supervisor could not take on the create's context: {e}"}
            try:
                os.write(ready_fd, json.dumps(msg).encode() + b"\n")
            except OSError:
                pass
        os._exit(1)
    try:
        _supervise(ready_fd, 0, args)
    finally:
        os._exit(0)


@dataclasses.dataclass
class SupervisorArgs:
    """What a supervisor is born with, whether a fork of the create's process or a seed of the
    factory's that it is handed over to (pickled: hand_over)."""
    store: StateStore
    state: ContainerState
    spec: Spec
    platform: str
    console_socket: str
    preserve_fds: int
    log_file: str                   # --log, else the state directory's supervisor.log
    log_format: str                 # --log-format, for --log
    cgroup: cgroups.Cgroup | None   # the one the create opened, taken on rather than opened again
    merge_pages: bool               # supervisor.memory_merge


def _supervise(ready_fd: int, launcher: int, a: SupervisorArgs) -> None:
    if a.merge_pages:   # first: every page written from here on is offered (qvisor/page_merge.py)
        from qvisor import page_merge
        page_merge.offer()
    from qvisor.supervisor import Supervisor
    logfile.log_to(a.log_file or a.store.path(a.state.id, "supervisor.log"), a.log_format if a.log_file else "text")
    from qvisor import security
    security.log_report(a.state.annotations)
    a.state.supervisor_pid = os.getpid()
    Supervisor(a.store, a.state, a.spec, a.platform, a.console_socket, ready_fd, launcher, a.preserve_fds,
               caller_may_reap=launcher != 0, cgroup=a.cgroup).main()


def _read_line(fd: int) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    try:
        return json.loads(buf) if buf.strip() else {}
    except json.JSONDecodeError:
        return {}


def _wait_closed(fd: int, timeout: float) -> None:
    """Until every writer of the pipe `fd` has closed it (a failed create's supervisor exits), or
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0] and not os.read(fd, 4096):
            return


def write_pid_file(path: str, pid: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.rename(tmp, path)


def state(root: str, container_id: str) -> ContainerState:
    return StateStore(root).load(container_id)


def start(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != CREATED:
        raise InvalidState(f"cannot start a container in the {st.status} state")
    store = StateStore(root)
    with Connection(store.dir(container_id)) as c:
        c.call({"op": "start"})
    # like runc, the runtime (not the sandbox's supervisor) runs poststart, after start succeeded
    spec = _saved_spec(store, st, only_if_hook="poststart")
    if spec is not None:
        from qvisor import hooks
        hooks.run_hooks("poststart", spec.hooks.poststart, state(root, container_id).oci(), fatal=False)


def wait(root: str, container_id: str, pid: int = 0) -> dict:
    """Block until the init (or the exec'd process `pid`) exits; its exit status and time."""
    ours = None
    if pid and procfs.parent_pid(pid) == os.getpid():   # ours to reap (exec_process with wait_here)
        ours = L.exit_code(os.waitpid(pid, 0)[1])
    store = StateStore(root)
    st = store.load(container_id)
    try:
        with Connection(store.dir(container_id)) as c:
            reply, _ = c.call({"op": "wait", "pid": pid or st.pid})
            # the status we reaped is the exact one: before Linux 6.15 the supervisor learns only
            # that the process ended (supervisor/reaper.py)
            return reply if ours is None else dict(reply, exit_status=ours)
    except SupervisorGone:
        pass
    st = store.load_raw(container_id)  # the supervisor is gone: the state file has the last word
    if pid and pid != st.pid:
        raise NotFound(f"process {pid} is not known: the container's supervisor has exited")
    if st.exit_status is None:
        raise QuarkError("the container's supervisor died before recording an exit status")
    return {"pid": st.pid, "exit_status": st.exit_status, "exited_at": st.exited_at}


def parse_signal(text: str) -> int:
    t = text.upper()
    if t.isdigit():
        n = int(t)
        if 0 < n < signal.NSIG:
            return n
        raise InvalidArgument(f"invalid signal {text!r}")
    name = t if t.startswith("SIG") else "SIG" + t
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise InvalidArgument(f"unknown signal {text!r}") from None


def kill(root: str, container_id: str, sig: int, all_processes: bool = False) -> None:
    st = state(root, container_id)
    if st.status not in (CREATED, RUNNING, PAUSED):
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    if st.status == PAUSED and StateStore(root).hibernation(container_id) is not None:
        # hibernated is asleep, not paused: the signal is sent, then the container woken to take
        # it (a frozen task does not even die of SIGKILL on cgroup v1); nothing is read back ahead
        _signal(st, sig, all_processes)
        try:
            wake(root, container_id, prefetch=False)
        except (InvalidState, SupervisorGone):
            pass   # it woke or stopped meanwhile
        return
    _signal(st, sig, all_processes)


def _signal(st: ContainerState, sig: int, all_processes: bool) -> None:
    if all_processes:
        cgroups.open_cgroup(st.cgroup_path).kill_all(sig)
        return
    # a pidfd taken after the start-time check pins the process: the signal cannot hit a reused pid
    fd = L.pidfd_open(st.pid)
    try:
        if not init_alive(st):
            raise InvalidState(f"container {st.id!r} is not running")
        L.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def kill_exec(root: str, container_id: str, pid: int, sig: int) -> None:
    """Signal the exec'd process `pid`. The supervisor does it, through the pidfd it holds until it
    reaps the process: once reaped, the pid may be another process's, and nothing is signalled."""
    store = StateStore(root)
    store.load(container_id)   # an unknown id says so
    try:
        with Connection(store.dir(container_id)) as c:
            c.call({"op": "signal", "pid": pid, "signal": sig})
    except SupervisorGone:   # it exits once the container and every exec'd process have
        raise NotFound(f"process {pid} has exited: container {container_id!r} has no processes left") from None


def _wait_stopped(store: StateStore, st: ContainerState, timeout: float = 10.0) -> None:
    # woken by the init's and the supervisor's pidfds when either exits (a fixed sleep between
    # checks added its length to every delete: bench/README.md, "Start-up and supervisor memory");
    # the checks themselves decide, so a pidfd of a reused pid only wakes the loop early
    pidfds = []
    for pid in (st.pid, st.supervisor_pid):
        try:
            if pid:
                pidfds.append(L.pidfd_open(pid))
        except OSError:
            pass   # gone already
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sup_alive = st.supervisor_pid and procfs.start_time(st.supervisor_pid) is not None \
                and os.path.exists(store.path(st.id, SOCK_NAME))
            if not init_alive(st) and not sup_alive:
                return
            ready, _, _ = select.select(pidfds, [], [], 0.01)
            for fd in ready:   # an exited process's pidfd stays readable: stop watching it
                pidfds.remove(fd)
                os.close(fd)
    finally:
        for fd in pidfds:
            os.close(fd)
    raise QuarkError(f"container {st.id!r} did not stop within {timeout:.0f}s")


def delete(root: str, container_id: str, force: bool = False) -> None:
    store = StateStore(root)
    st = store.load(container_id)
    if st.status == CREATING and not force:
        raise InvalidState(f"container {container_id!r} is being created (use --force to remove a failed one)")
    if st.status in (RUNNING, PAUSED) and not force:
        raise InvalidState(f"cannot delete container {container_id!r} that is not stopped: {st.status}")
    cg = cgroups.open_cgroup(st.cgroup_path) if st.cgroup_path else None
    if st.status in (CREATED, RUNNING, PAUSED):
        if cg is not None:
            cg.kill_all(signal.SIGKILL)
        try:
            fd = L.pidfd_open(st.pid)
            if init_alive(st):
                L.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
        except OSError:
            pass
        _wait_stopped(store, st)
    if cg is not None:
        cg.kill_all(signal.SIGKILL)
        cg.destroy()
    _run_poststop(store, st)
    store.remove(container_id)


def _saved_spec(store: StateStore, st: ContainerState, only_if_hook: str):
    """The container's saved config, parsed only if it has `only_if_hook` hooks (parsing is the
    slow part and most containers have none); None otherwise or if it cannot be read."""
    from qvisor.spec import parse_spec
    try:
        with open(store.path(st.id, CONFIG_COPY)) as f:
            raw = json.load(f)
        if not (raw.get("hooks") or {}).get(only_if_hook):
            return None
        return parse_spec(raw, store.path(st.id, CONFIG_COPY), st.bundle)
    except (OSError, ValueError, AttributeError, QuarkError):
        return None


def _run_poststop(store: StateStore, st: ContainerState) -> None:
    from qvisor import hooks
    spec = _saved_spec(store, st, only_if_hook="poststop")
    if spec is None:
        return
    st.status = STOPPED
    hooks.run_hooks("poststop", spec.hooks.poststop, st.oci(), fatal=False)


def pause(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != RUNNING:
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    cgroups.open_cgroup(st.cgroup_path).freeze()


def resume(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != PAUSED:
        raise InvalidState(f"container {container_id!r} is not paused (status {st.status})")
    if StateStore(root).hibernation(container_id) is not None:
        wake(root, container_id)   # the supervisor wakes it: its working set, its listeners
        return
    cgroups.open_cgroup(st.cgroup_path).thaw()


# ---- hibernation (quark snapshot; qvisor/supervisor/snapshot.py does the work) -----------------

def hibernate(root: str, container_id: str, reason: str = "request") -> dict:
    """Freeze the container and page its memory out; returns the supervisor's account of it."""
    store = StateStore(root)
    st = store.load(container_id)
    if store.hibernation(container_id) is not None or st.status == RUNNING:
        with Connection(store.dir(container_id)) as c:
            return c.call({"op": "hibernate", "reason": reason})[0]
    raise InvalidState(f"cannot hibernate container {container_id!r}: it is {st.status} (only a running "
                       "container can be)")


def wake(root: str, container_id: str, prefetch: bool = True) -> dict:
    store = StateStore(root)
    store.load(container_id)   # an unknown id says so
    if store.hibernation(container_id) is None:
        raise InvalidState(f"container {container_id!r} is not hibernated")
    with Connection(store.dir(container_id)) as c:
        return c.call({"op": "wake", "prefetch": prefetch})[0]


def snapshot_info(root: str, container_id: str) -> dict:
    store = StateStore(root)
    store.load(container_id)
    with Connection(store.dir(container_id)) as c:
        return c.call({"op": "snapshot"})[0]


def pids(root: str, container_id: str) -> list[int]:
    st = state(root, container_id)
    if st.status == STOPPED:
        return []
    return sorted(cgroups.open_cgroup(st.cgroup_path).pids())


def exec_process(root: str, container_id: str, process: dict, fds: list[int],
                 preserve_fds: int = 0, wait_here: bool = False) -> tuple[int, list[int]]:
    """Start `process` in the container with stdio `fds` and the caller's fds 3..2+preserve_fds;
    returns its host pid and, with a terminal, the pty master. `wait_here`: the caller will wait
    for it (`wait`), so where the caller reaps it is this process's child, as runc's exec's is."""
    preserved = preserved_fds(preserve_fds)
    if len(fds) + len(preserved) > channel.MAX_FDS:
        raise InvalidArgument(f"--preserve-fds {preserve_fds}: exec passes at most {channel.MAX_FDS - len(fds)} fds")
    st = state(root, container_id)
    if st.status == PAUSED and StateStore(root).hibernation(container_id) is not None:
        wake(root, container_id)   # a hibernated container wakes for an exec
        st = state(root, container_id)
    if st.status != RUNNING:
        raise InvalidState(f"cannot exec in container {container_id!r}: it is {st.status}")
    request = {"op": "exec", "process": process, "preserve_fds": len(preserved)}
    if st.caller_reaps:
        return _exec_forked_here(StateStore(root).dir(container_id), request, fds, preserved, wait_here)
    with Connection(StateStore(root).dir(container_id)) as c:
        reply, rfds = c.call(request, fds + preserved)
    return reply["pid"], rfds


def _exec_forked_here(state_dir: str, request: dict, stdio: list[int], preserved: list[int],
                      wait_here: bool) -> tuple[int, list[int]]:
    """An exec where the caller reaps the container's processes (conmon, containerd's runc shim):
    as with runc, the process is a descendant of this `quark exec`, so once it is orphaned it goes
    to the caller's subreaper, which waits for the pid it reads from --pid-file (podman gives each
    exec its own conmon: a process the supervisor forked would go to the container's). Stage 1 is
    forked here; the supervisor drives it as it drives its own (qvisor/supervisor/exec.py)."""
    from qvisor import sandbox
    if wait_here:   # stage 1's orphan comes to us, to be reaped by `wait`
        L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    child = channel.numbered_from(child, 3 + len(preserved))   # the preserved fds stay at 3..
    pid = os.fork()
    if pid == 0:
        parent.close()
        for i, fd in enumerate(stdio):
            os.dup2(fd, i, inheritable=True)
        sandbox.run_child(child, lambda: sandbox.exec_stage1_of_caller(child, preserved))
    child.close()
    pidfd = -1
    try:
        pidfd = L.pidfd_open(pid)
        with Connection(state_dir) as c:
            reply, rfds = c.call(dict(request, forked=True), [parent.fileno(), pidfd])
    finally:
        parent.close()   # (stage 1 waiting for the supervisor's first message ends at its EOF)
        if pidfd >= 0:
            os.close(pidfd)
        os.waitpid(pid, 0)   # stage 1 exits once it has reported the process's pid
    return reply["pid"], rfds


def config_process(root: str, container_id: str) -> dict:
    """The container's own process object, the base of `quark exec ARGS`."""
    state(root, container_id)  # an unknown id says so
    with open(StateStore(root).path(container_id, CONFIG_COPY)) as f:
        return dict(json.load(f).get("process") or {})


def running_cgroup(root: str, container_id: str) -> cgroups.Cgroup:
    """The cgroup of a container that has not stopped."""
    st = state(root, container_id)
    if st.status == STOPPED:
        raise InvalidState(f"container {container_id!r} is stopped")
    return cgroups.open_cgroup(st.cgroup_path)


def stats(root: str, container_id: str) -> dict:
    """The container's cgroup statistics in runc's `events --stats` data layout."""
    return running_cgroup(root, container_id).stats()


def update(root: str, container_id: str, resources: dict, source: str) -> None:
    """Apply new linux.resources (the decoded JSON object; errors name `source`) to a live
    container's cgroup."""
    from qvisor.spec import parse_resources
    st = state(root, container_id)
    if st.status not in (CREATED, RUNNING, PAUSED):
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    res = parse_resources(resources, source)
    cg = cgroups.open_cgroup(st.cgroup_path)
    if not (res.devices and cg.version == "v2"):
        cg.apply(res)
        return
    store = StateStore(root)
    rules, updates = _devices_after_update(store, st, resources["devices"])
    cg.apply(dataclasses.replace(res, devices=rules))
    path = store.path(st.id, DEVICE_UPDATES)   # kept once applied, for the next update
    with open(path + ".tmp", "w") as f:
        json.dump(updates, f)
    os.replace(path + ".tmp", path)


def _devices_after_update(store: StateStore, st: ContainerState, new_rules: list) -> tuple[list, list]:
    """Every device rule of a container after an update adds `new_rules`: on v2 they become one
    eBPF program that replaces the last one, so it must hold the rules of the create (the spec's,
    the defaults, the container's own devices) and of every update so far, in order, the last
    match winning as on v1 (where an update only appends rules to the kernel's list)."""
    from qvisor.devices import cgroup_resources
    from qvisor.spec import parse_resources, parse_spec
    path = store.path(st.id, DEVICE_UPDATES)
    try:
        with open(path) as f:
            updates = json.load(f)
    except FileNotFoundError:
        updates = []
    with open(store.path(st.id, CONFIG_COPY)) as f:
        spec = parse_spec(json.load(f), store.path(st.id, CONFIG_COPY), st.bundle)
    updates += new_rules
    return cgroup_resources(spec).devices + parse_resources({"devices": updates}, path).devices, updates
