"""quark create: the sandbox built by its supervisor (started by qvisor/birth.py); its init waits
for start."""
from __future__ import annotations

import json
import os
import select
import shutil
import time

from qlib.errors import QuarkError, from_kind
from qlib.version import VERSION
from qvisor import birth, cgroups
from qvisor.container.common import CONFIG_COPY, preserved_fds
from qvisor.factory import wire
from qvisor.state import ContainerState, StateStore, now_rfc3339


def create(root: str, container_id: str, bundle: str, *, pid_file: str = "", console_socket: str = "",
           platform: str = "seccomp", log_file: str = "", log_format: str = "text", preserve_fds: int = 0,
           in_factory: bool = False) -> ContainerState:
    """Build the sandbox; its init waits for start. The caller's fds 3..2+preserve_fds are the
    init's too (the supervisor inherits them at those numbers and hands them on). `in_factory`:
    run in a sandbox factory's worker (birth.start says what that changes)."""
    from qvisor import page_merge, pods, security, validate
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
    pod_scope = pods.scope() == "pod"          # supervisor.scope
    wire.idle_seconds()   # factory.idle_seconds: a host setting quark cannot take fails here too, named
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
        args = birth.SupervisorArgs(store, st, spec, platform, console_socket, preserve_fds, log_file, log_format,
                                    cgroup, merge_pages, pod_scope)
        # (a fork while the grace period's thread writes would give the supervisor its open cgroup.procs)
        r = birth.start(args, in_factory=in_factory, before_fork=grace.join)
        try:
            reply = _read_line(r)
            if "ok" not in reply:
                _wait_closed(r, 10.0)   # the supervisor, having removed everything, exits: wait for it
        finally:
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
