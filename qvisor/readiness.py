"""When is a container ready to be hibernated (`quark run --snapshot-when COND`)?

    tcp:PORT    a TCP socket of the container listens on PORT (read from its network namespace's
                /proc/net/tcp{,6}: nothing connects, so the application sees no stray connection)
    file:PATH   PATH exists in the container (resolved inside its root: a symlink cannot lead out)
    exec:CMD    CMD, run in the container like `quark exec` (words split as a shell would, no
                shell), exits 0

A platform prepares a pool of warm, hibernated containers with one command each.
"""
from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass

from qlib import linux as L
from qlib import procfs
from qlib.errors import InvalidArgument, QuarkError

POLL_S = 0.05


@dataclass(frozen=True)
class Condition:
    kind: str      # tcp | file | exec
    value: str
    port: int = 0
    argv: tuple[str, ...] = ()


def parse(text: str) -> Condition:
    kind, sep, value = text.partition(":")
    if not sep or not value:
        raise InvalidArgument(f"--snapshot-when {text!r}: expected tcp:PORT, file:PATH or exec:CMD")
    if kind == "tcp":
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise InvalidArgument(f"--snapshot-when {text!r}: PORT must be 1-65535")
        return Condition("tcp", value, port=int(value))
    if kind == "file":
        return Condition("file", value)
    if kind == "exec":
        try:
            argv = tuple(shlex.split(value))
        except ValueError as e:
            raise InvalidArgument(f"--snapshot-when {text!r}: {e}") from None
        if not argv:
            raise InvalidArgument(f"--snapshot-when {text!r}: no command")
        return Condition("exec", value, argv=argv)
    raise InvalidArgument(f"--snapshot-when {text!r}: unknown condition {kind!r} (tcp, file or exec)")


def listening_on(pid: int, port: int) -> bool:
    return any(p == port for p, _ in procfs.tcp_listeners(pid))


def file_exists(pid: int, path: str) -> bool:
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = L.openat2(root, path.lstrip("/") or ".", os.O_PATH, 0, L.RESOLVE_IN_ROOT)
        os.close(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(root)


def _exec_succeeds(root: str, cid: str, argv: tuple[str, ...]) -> bool:
    from qvisor.container.common import config_process
    from qvisor.container.exec import exec_process
    from qvisor.container.wait import wait
    process = config_process(root, cid) | {"args": list(argv), "terminal": False}
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        pid, _ = exec_process(root, cid, process, [null, null, null], wait_here=True)
    finally:
        os.close(null)
    return wait(root, cid, pid).get("exit_status") == 0


def wait_ready(root: str, cid: str, cond: Condition, timeout: float) -> float:
    """Poll until `cond` holds; returns the seconds it took. QuarkError when the container stops
    first or `timeout` passes."""
    from qvisor.container.common import state
    from qvisor.state import RUNNING
    t0 = time.monotonic()
    while True:
        st = state(root, cid)
        if st.status != RUNNING:
            raise QuarkError(f"--snapshot-when {cond.kind}:{cond.value}: the container is {st.status}")
        if cond.kind == "tcp":
            ready = listening_on(st.pid, cond.port)
        elif cond.kind == "file":
            ready = file_exists(st.pid, cond.value)
        else:
            ready = _exec_succeeds(root, cid, cond.argv)
        if ready:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise QuarkError(f"--snapshot-when {cond.kind}:{cond.value}: not ready after {timeout:g}s")
        time.sleep(POLL_S if cond.kind != "exec" else 4 * POLL_S)
