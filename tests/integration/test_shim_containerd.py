"""containerd 1.6 (Debian's, private config and paths) driving quark through containerd-shim-quark-v1.

`ctr` as a person would use it: --rootfs and image runs, output and exit codes, stdin, kill,
exec with and without a terminal, ps, pause/resume, metrics, detached run and delete, events in
order; then the faults: containerd restarted under running containers, the shim killed -9.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

try:
    from tests.integration import containerd_env as ce
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce

pytestmark = [pytest.mark.root, pytest.mark.skipif(ce.skip_reason() is not None, reason=ce.skip_reason() or "")]

R = ("--runtime", ce.RUNTIME)


@pytest.fixture(scope="module")
def cd(tmp_path_factory):
    d = ce.Containerd()
    try:
        d.start()
        tar = ce.busybox_image_tar(tmp_path_factory.mktemp("img") / "busybox.tar")
        d.ctr("images", "import", str(tar))
        d.rootfs = ce.busybox_rootfs(d.base / "rootfs")
        yield d
    finally:
        d.close()


def tasks(cd) -> dict[str, tuple[int, str]]:
    """`ctr task ls` as {id: (pid, status)}."""
    out = cd.ctr("tasks", "ls").stdout.decode().splitlines()[1:]
    return {f[0]: (int(f[1]), f[2]) for f in (line.split() for line in out) if len(f) >= 3}


def wait_status(cd, cid, status, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tasks(cd).get(cid, (0, "GONE"))[1] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"{cid} not {status}: {tasks(cd)}\n{cd.log_tail()}")


def remove(cd, cid):
    cd.ctr("tasks", "delete", "-f", cid, check=False)
    cd.ctr("containers", "delete", cid, check=False)


def test_run_rootfs_output_and_exit_code(cd):
    p = cd.ctr("run", "--rm", *R, "--rootfs", str(cd.rootfs), "rootfs1",
               "sh", "-c", "echo out; echo err >&2; exit 3", check=False)
    assert p.returncode == 3, p.stderr
    assert p.stdout == b"out\n" and b"err" in p.stderr


def test_run_image_output(cd):
    p = cd.ctr("run", "--rm", *R, ce.IMAGE, "image1", "echo", "hello from quark")
    assert p.stdout == b"hello from quark\n"
    assert "image1" not in tasks(cd)


def test_same_id_reused_at_once(cd):
    # the previous shim of this id lingers briefly after Shutdown; it must not remove the socket
    # of the next shim (containerd would fail with "dial unix ...: no such file or directory")
    for i in range(6):
        p = cd.ctr("run", "--rm", *R, ce.IMAGE, "reused", "sh", "-c", f"echo {i}", check=False)
        assert (p.returncode, p.stdout) == (0, f"{i}\n".encode()), p.stderr


def test_stdin_reaches_container_and_eof_ends_it(cd):
    p = cd.ctr("run", "--rm", *R, ce.IMAGE, "stdin1", "sh", "-c", "cat; echo done", input=b"abc\n")
    assert p.stdout == b"abc\ndone\n"


def test_terminal_run(cd):
    p = cd.ctr_tty(f"run --rm -t --runtime {ce.RUNTIME} {ce.IMAGE} tty1 sh -c 'tty; exit 4'")
    assert b"/dev/pts/" in p.stdout or b"/dev/console" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 4


def test_log_uri_file_and_binary(cd, tmp_path):
    log = tmp_path / "file.log"
    cd.ctr("run", "--rm", *R, "--log-uri", f"file://{log}", ce.IMAGE, "logfile1", "sh", "-c", "echo to-file")
    assert log.read_text() == "to-file\n"
    out = tmp_path / "binary.log"
    logger = tmp_path / "logger.sh"
    # containerd's binary logging protocol: stdout on fd 3, stderr on fd 4, close fd 5 when ready
    logger.write_text('#!/bin/sh\nexec 5>&-\necho "$CONTAINER_NAMESPACE/$CONTAINER_ID $1" > "$2"\ncat <&3 >> "$2"\n')
    logger.chmod(0o755)
    cd.ctr("run", "--rm", *R, "--log-uri", f"binary://{logger}?tag&{out}", ce.IMAGE, "logbin1",
           "sh", "-c", "echo to-binary")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "to-binary" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.1)
    assert out.read_text() == f"{cd.namespace}/logbin1 tag\nto-binary\n"


def test_events_in_order_with_exit_status(cd):
    ev = subprocess.Popen(["ctr", "--address", cd.address, "events"], stdout=subprocess.PIPE, env=cd.env)
    try:
        time.sleep(0.5)
        cd.ctr("run", "--rm", *R, ce.IMAGE, "events1", "sh", "-c", "exit 9", check=False)
        time.sleep(0.5)
    finally:
        ev.send_signal(signal.SIGTERM)
        out = ev.communicate(timeout=10)[0].decode()
    mine = [line for line in out.splitlines() if "events1" in line and "/tasks/" in line]
    topics = [next(w for w in line.split() if w.startswith("/tasks/")) for line in mine]
    assert topics == ["/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"], out
    exit_event = json.loads(mine[2][mine[2].index("{"):])
    assert exit_event.get("exit_status") == 9 and exit_event.get("exited_at")


def test_oom_event_and_exit(cd):
    ev = subprocess.Popen(["ctr", "--address", cd.address, "events"], stdout=subprocess.PIPE, env=cd.env)
    try:
        time.sleep(0.5)
        # a shell variable of 64 MiB in a 16 MiB cgroup: the kernel's OOM killer ends it
        p = cd.ctr("run", "--rm", *R, "--memory-limit", str(16 << 20), ce.IMAGE, "oom1",
                   "sh", "-c", "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived", check=False)
        time.sleep(1.0)
    finally:
        ev.send_signal(signal.SIGTERM)
        out = ev.communicate(timeout=10)[0].decode()
    assert b"survived" not in p.stdout and p.returncode != 0
    topics = [next(w for w in line.split() if w.startswith("/tasks/"))
              for line in out.splitlines() if "oom1" in line and "/tasks/" in line]
    assert "/tasks/oom" in topics, out
    assert topics.index("/tasks/start") < topics.index("/tasks/oom") and topics[-1] == "/tasks/delete", topics


def exercise_a_running_task(cd, runtime: tuple[str, ...], cid: str) -> None:
    """Detached run, exec (plain, failing, with a terminal), ps, pause/resume, metrics, kill (SIGTERM,
    trapped: exit 7), delete: what a user does with a task, through the given runtime flags."""
    cd.ctr("run", "-d", *runtime, ce.IMAGE, cid, "sh", "-c", "trap 'exit 7' TERM; while true; do sleep 0.1; done")
    try:
        wait_status(cd, cid, "RUNNING")
        assert cd.ctr("tasks", "exec", "--exec-id", "e1", cid, "echo", "exec-out").stdout == b"exec-out\n"
        assert cd.ctr("tasks", "exec", "--exec-id", "e2", cid, "sh", "-c", "exit 5", check=False).returncode == 5
        p = cd.ctr_tty(f"tasks exec -t --exec-id e3 {cid} sh -c 'tty; exit 6'")
        assert p.returncode == 6 and b"/dev/pts/" in p.stdout, p.stdout + p.stderr
        assert str(tasks(cd)[cid][0]) in cd.ctr("tasks", "ps", cid).stdout.decode().split()
        cd.ctr("tasks", "pause", cid)
        wait_status(cd, cid, "PAUSED")
        cd.ctr("tasks", "resume", cid)
        wait_status(cd, cid, "RUNNING")
        metrics = cd.ctr("tasks", "metrics", cid).stdout.decode()   # `quark events --stats`
        assert "memory" in metrics.lower() or "pids" in metrics.lower(), metrics
        cd.ctr("tasks", "kill", cid)
        wait_status(cd, cid, "STOPPED")
        out = cd.ctr("tasks", "delete", cid).stdout.decode()
        assert "7" in out or out == ""
        assert cid not in tasks(cd)
    finally:
        remove(cd, cid)


def test_detached_exec_ps_pause_metrics_kill_delete(cd):
    exercise_a_running_task(cd, R, "detached1")


def test_idle_hibernation_through_the_shim(cd):
    """The idle annotation travels from `ctr run --annotation` (a pod's annotations, through CRI) to
    quark; a task that hibernated itself wakes for `ctr task exec` and `ctr task resume`, and a
    `ctr task pause` of it is refused as runc refuses pausing a paused container."""
    cid = "idle1"
    root = str(cd.state / "quark" / cd.namespace)   # shim/paths.py: a private containerd's quark root

    def hibernated() -> bool:
        p = subprocess.run(["quark", "--root", root, "state", cid], capture_output=True)
        return p.returncode == 0 and "io.quark.hibernated" in (json.loads(p.stdout).get("annotations") or {})

    def wait_hibernated() -> None:
        deadline = time.monotonic() + 20
        while not hibernated():
            assert time.monotonic() < deadline, f"{cid} did not hibernate itself\n{cd.log_tail()}"
            time.sleep(0.1)

    def wakes() -> int:
        out = subprocess.run(["quark", "--root", root, "snapshot", "list", "-f", "json"],
                             capture_output=True, check=True).stdout
        return sum(r["wakes"] for r in json.loads(out) if r["id"] == cid)

    cd.ctr("run", "-d", *R, "--annotation", "io.quark.hibernate.idle-after=1s", ce.IMAGE, cid, "sleep", "1000")
    try:
        wait_status(cd, cid, "RUNNING")
        wait_hibernated()
        assert cd.ctr("tasks", "exec", "--exec-id", "w1", cid, "echo", "awake").stdout == b"awake\n"
        wait_hibernated()
        p = cd.ctr("tasks", "pause", cid, check=False)
        assert p.returncode != 0 and b"not running" in p.stderr, p.stderr
        before = wakes()   # `snapshot list` lists hibernated containers: count again once it sleeps again
        cd.ctr("tasks", "resume", cid)
        wait_status(cd, cid, "RUNNING")
        wait_hibernated()
        assert wakes() == before + 1
        cd.ctr("tasks", "kill", "-s", "SIGKILL", cid)
        wait_status(cd, cid, "STOPPED")
    finally:
        remove(cd, cid)


def _quark_has(verb: str) -> bool:
    quark = os.path.join(os.path.dirname(ce.SHIM), "quark")
    return subprocess.run([quark, verb, "--help"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _quark_has("events"), reason="quark has no `events --stats` verb yet")
def test_metrics(cd):
    cid = "metrics1"
    cd.ctr("run", "-d", *R, ce.IMAGE, cid, "sleep", "1000")
    try:
        wait_status(cd, cid, "RUNNING")
        metrics = cd.ctr("tasks", "metrics", cid).stdout.decode()
        assert cid in metrics and ("memory" in metrics or "pids" in metrics), metrics
    finally:
        cd.ctr("tasks", "kill", "-s", "SIGKILL", cid, check=False)
        remove(cd, cid)


def test_kill_all_and_unknown_task(cd):
    cid = "killall1"
    cd.ctr("run", "-d", *R, ce.IMAGE, cid, "sleep", "1000")
    try:
        wait_status(cd, cid, "RUNNING")
        cd.ctr("tasks", "kill", "-a", "-s", "SIGKILL", cid)
        wait_status(cd, cid, "STOPPED")
    finally:
        remove(cd, cid)
    p = cd.ctr("tasks", "kill", "no-such-task", check=False)
    assert p.returncode != 0 and b"not found" in p.stderr.lower()


def test_containerd_restart_keeps_containers_and_reports_exits(cd):
    keep, dies = "restart-keep", "restart-dies"
    cd.ctr("run", "-d", *R, ce.IMAGE, keep, "sleep", "1000")
    cd.ctr("run", "-d", *R, ce.IMAGE, dies, "sleep", "1000")
    try:
        wait_status(cd, keep, "RUNNING")
        wait_status(cd, dies, "RUNNING")
        dies_pid = tasks(cd)[dies][0]
        cd.stop()
        os.kill(dies_pid, signal.SIGKILL)  # exits while containerd is away
        time.sleep(1)
        cd.start()
        wait_status(cd, keep, "RUNNING")
        wait_status(cd, dies, "STOPPED")
        assert cd.ctr("tasks", "exec", "--exec-id", "after", keep, "echo", "still here").stdout == b"still here\n"
        cd.ctr("tasks", "kill", "-s", "SIGKILL", keep)
        wait_status(cd, keep, "STOPPED")
    finally:
        remove(cd, keep)
        remove(cd, dies)


def test_the_shims_server_is_a_seed_the_factory_forked_ahead(cd):
    """Through the sandbox factory the shim's server is not forked by the worker that ran `start`
    (whose pages it would keep for the pod's life) but is a seed forked ahead by the factory's
    zygote and handed the start (qvisor/factory/seeds.py), as a create's supervisor is; it serves
    as before (the container runs, its task answers)."""
    from qlib.procfs import parent_pid
    from qvisor.factory.wire import PID_NAME, directory
    cid = "seeded"
    cd.ctr("run", "--rm", *R, ce.IMAGE, "seeded0", "true")   # a create starts the factory if none runs
    deadline = time.monotonic() + 20
    while not Path(directory(), PID_NAME).exists():
        assert time.monotonic() < deadline, "no sandbox factory started"
        time.sleep(0.1)
    cd.ctr("run", "-d", *R, ce.IMAGE, cid, "sleep", "1000")
    try:
        wait_status(cd, cid, "RUNNING")
        shim = int((cd.state / "io.containerd.runtime.v2.task" / cd.namespace / cid / "shim.pid").read_text())
        factory = int(Path(directory(), PID_NAME).read_text())
        zygote = parent_pid(shim)
        assert zygote not in (factory, 1) and parent_pid(zygote) == factory, (shim, zygote, factory)
        assert cd.ctr("tasks", "exec", "--exec-id", "e1", cid, "echo", "served").stdout == b"served\n"
    finally:
        remove(cd, cid)


def test_shim_killed_leaves_nothing_behind(cd):
    cid = "kill9"
    cd.ctr("run", "-d", *R, ce.IMAGE, cid, "sleep", "1000")
    bundle = cd.state / "io.containerd.runtime.v2.task" / cd.namespace / cid
    try:
        wait_status(cd, cid, "RUNNING")
        init_pid = tasks(cd)[cid][0]
        address = (bundle / "address").read_text()
        shims = [p for p in cd.shim_pids() if str(bundle).encode() in _environ_cwd(p)]
        assert len(shims) == 1
        os.kill(shims[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (cid in tasks(cd) or bundle.exists()):
            time.sleep(0.1)
        assert cid not in tasks(cd), tasks(cd)
        assert _gone(init_pid), f"container init {init_pid} survived its shim"
        assert not bundle.exists(), list(bundle.iterdir())
        assert not os.path.exists(address.removeprefix("unix://"))
        quark_state = cd.state / "quark" / cd.namespace / cid
        assert not quark_state.exists()
        with open("/proc/self/mountinfo") as f:
            assert str(bundle) not in f.read()
    finally:
        remove(cd, cid)


def _environ_cwd(pid: int) -> bytes:
    try:
        return os.readlink(f"/proc/{pid}/cwd").encode()
    except OSError:
        return b""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False
