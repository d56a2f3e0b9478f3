"""The runc-compatible life cycle, driven through the real `quark` CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest


from qlib import procfs
from tests.integration.conftest import QUARK, cgroup_dirs, edit_config

pytestmark = pytest.mark.root


def wait_status(quark, cid: str, status: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = quark("state", cid, check=False)  # a `run` in the background may not have created it yet
        st = json.loads(r.stdout) if r.returncode == 0 else {"status": None}
        if st["status"] == status or time.monotonic() > deadline:
            return st
        time.sleep(0.02)


def test_create_start_state_delete(quark, bundle, tmp_path):
    b = bundle(["sh", "-c", "echo started > /tmp/x; exec sleep 30"], readonly=False)
    pid_file = tmp_path / "pid"
    quark("create", "--bundle", b, "--pid-file", str(pid_file), "c1")
    st = quark.state("c1")
    assert st["status"] == "created" and st["id"] == "c1" and st["bundle"] == b
    assert st["ociVersion"].startswith("1.0")
    pid = int(pid_file.read_text())
    assert st["pid"] == pid and os.path.exists(f"/proc/{pid}")
    assert not os.path.exists(os.path.join(b, "rootfs/tmp/x")), "the process must not run before start"
    quark("start", "c1")
    assert wait_status(quark, "c1", "running")["status"] == "running"
    deadline = time.monotonic() + 5
    while not os.path.exists(os.path.join(b, "rootfs/tmp/x")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open(os.path.join(b, "rootfs/tmp/x")).read() == "started\n"
    r = quark("start", "c1", check=False)
    assert r.returncode == 1 and "running" in r.stderr
    r = quark("delete", "c1", check=False)
    assert r.returncode == 1 and "not stopped" in r.stderr
    cg = json.load(open(os.path.join(quark.root, "c1", "state.json")))["cgroup_path"]
    quark("kill", "c1", "KILL")
    assert wait_status(quark, "c1", "stopped")["status"] == "stopped"
    quark("delete", "c1")
    assert quark.ids() == []
    assert cgroup_dirs(cg) == []
    assert not os.path.exists(f"/proc/{pid}")


def test_run_returns_exit_code_and_cleans_up(quark, bundle):
    r = quark("run", "--bundle", bundle(["sh", "-c", "echo out; echo err >&2; exit 7"]), "r1", check=False)
    assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert quark.ids() == []


def test_run_exit_by_signal_is_128_plus_signal(quark, bundle, tmp_path):
    b = bundle(["sleep", "30"])
    p = subprocess.Popen(QUARK + ["--root", quark.root, "run", "--bundle", b, "r2"])
    st = wait_status(quark, "r2", "running")
    assert st["status"] == "running"
    quark("kill", "r2", "9")
    assert p.wait(timeout=10) == 128 + signal.SIGKILL


def test_run_forwards_signals_to_the_container(quark, bundle):
    b = bundle(["sh", "-c", "trap 'exit 42' TERM; while :; do sleep 0.05; done"])
    p = subprocess.Popen(QUARK + ["--root", quark.root, "run", "--bundle", b, "r3"])
    wait_status(quark, "r3", "running")
    time.sleep(0.3)  # let the shell install its trap
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 42


def test_detached_run_and_exit_status_recorded(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sh", "-c", "exit 5"]), "d1")
    st = wait_status(quark, "d1", "stopped")
    assert st["status"] == "stopped" and st["pid"] == 0
    r = quark("wait", "d1")
    assert json.loads(r.stdout)["exit_status"] == 5
    quark("delete", "d1")


def test_kill_signal_names_numbers_and_all(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sh", "-c", "trap 'exit 3' USR1; sleep 100 & sleep 100 & wait"]), "k1")
    wait_status(quark, "k1", "running")
    time.sleep(0.3)
    pids = json.loads(quark("ps", "--format", "json", "k1").stdout)
    assert len(pids) == 3
    r = quark("kill", "k1", "NOPE", check=False)
    assert r.returncode == 1 and "unknown signal" in r.stderr
    quark("kill", "--all", "k1", "SIGKILL")
    assert wait_status(quark, "k1", "stopped")["status"] == "stopped"
    assert json.loads(quark("wait", "k1").stdout)["exit_status"] == 137
    r = quark("kill", "k1", "TERM", check=False)
    assert r.returncode == 1 and "not running" in r.stderr
    quark("delete", "k1")


def test_kill_by_name_reaches_the_init(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sh", "-c", "trap 'exit 3' USR1; while :; do sleep 0.05; done"]), "k2")
    wait_status(quark, "k2", "running")
    time.sleep(0.3)
    quark("kill", "k2", "USR1")
    wait_status(quark, "k2", "stopped")
    assert json.loads(quark("wait", "k2").stdout)["exit_status"] == 3
    quark("delete", "k2")


def test_delete_force_running_and_after_supervisor_killed(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "f1")
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "f2")
    st2 = json.load(open(os.path.join(quark.root, "f2", "state.json")))
    quark("delete", "--force", "f1")
    os.kill(st2["supervisor_pid"], signal.SIGKILL)
    time.sleep(0.1)
    assert quark.state("f2")["status"] == "running"  # the container outlives its supervisor
    quark("delete", "--force", "f2")
    assert quark.ids() == []
    assert procfs.start_time(st2["pid"]) is None  # gone, or a zombie of whoever adopted it
    assert cgroup_dirs(st2["cgroup_path"]) == []


def test_delete_force_after_the_cgroup_is_gone(quark, bundle):
    from tests.integration.conftest import cgroup_dirs
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "cg")
    wait_status(quark, "cg", "running")
    cg = json.loads(open(os.path.join(quark.root, "cg", "state.json")).read())["cgroup_path"]
    quark("kill", "cg", "KILL")
    assert wait_status(quark, "cg", "stopped")["status"] == "stopped"
    for d in sorted(cgroup_dirs(cg), reverse=True):   # someone (an admin, systemd) removed it
        os.rmdir(d)
    quark("delete", "--force", "cg")
    assert quark.ids() == []


def test_delete_of_created_container_needs_no_force(quark, bundle):
    quark("create", "--bundle", bundle(["true"]), "cr")
    pid = quark.state("cr")["pid"]
    quark("delete", "cr")
    assert quark.ids() == [] and not os.path.exists(f"/proc/{pid}")


def test_exec_output_exit_code_env_cwd(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "e1")
    wait_status(quark, "e1", "running")
    r = quark("exec", "--env", "FOO=bar", "--cwd", "/tmp", "e1", "sh", "-c", "echo $FOO $(pwd); exit 4", check=False)
    assert (r.returncode, r.stdout) == (4, "bar /tmp\n")
    r = quark("exec", "e1", "cat", "/proc/1/cmdline")
    assert r.stdout == "sleep\x00100\x00", "exec joins the container's pid namespace"
    r = quark("exec", "e1", "no-such-binary", check=False)
    assert r.returncode == 1 and "no-such-binary" in r.stderr


def test_exec_detached_pid_file_and_process_json(quark, bundle, tmp_path):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "e2")
    wait_status(quark, "e2", "running")
    proc = {"args": ["sh", "-c", "sleep 2; exit 9"], "cwd": "/", "env": ["PATH=/bin"], "user": {"uid": 65534, "gid": 65534}}
    (tmp_path / "p.json").write_text(json.dumps(proc))
    quark("exec", "-d", "--process", str(tmp_path / "p.json"), "--pid-file", str(tmp_path / "pid"), "e2")
    pid = int((tmp_path / "pid").read_text())
    assert pid in json.loads(quark("ps", "--format", "json", "e2").stdout)
    st = open(f"/proc/{pid}/status").read()
    assert "Uid:\t65534" in st
    assert json.loads(quark("wait", "--pid", str(pid), "e2").stdout)["exit_status"] == 9


def test_ps_and_list_formats(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "p1")
    wait_status(quark, "p1", "running")
    pid = quark.state("p1")["pid"]
    table = quark("ps", "p1").stdout.splitlines()
    assert table[0].split()[:2] == ["UID", "PID"] and str(pid) in table[1].split()
    rows = json.loads(quark("list", "--format", "json").stdout)
    assert [(r["id"], r["status"], r["pid"]) for r in rows] == [("p1", "running", pid)]
    assert quark("list", "-q").stdout.split() == ["p1"]
    assert "p1" in quark("list").stdout.splitlines()[1]


def test_pause_resume(quark, bundle):
    quark("run", "-d", "--bundle", bundle(["sh", "-c", "while :; do sleep 0.05; done"]), "pz")
    wait_status(quark, "pz", "running")
    quark("pause", "pz")
    assert quark.state("pz")["status"] == "paused"
    r = quark("pause", "pz", check=False)
    assert r.returncode == 1
    quark("resume", "pz")
    assert quark.state("pz")["status"] == "running"


def test_features_and_spec(quark, tmp_path):
    f = json.loads(quark("features").stdout)
    assert "pid" in f["linux"]["namespaces"] and "poststop" in f["hooks"] and "rbind" in f["mountOptions"]
    quark("spec", "--bundle", str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["process"]["args"] == ["sh"]


def test_terminal_through_console_socket(quark, bundle, tmp_path):
    import socket
    path = str(tmp_path / "console.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    b = bundle(["sh", "-c", "tty; stty size; read line; echo got:$line"], terminal=True)
    edit_config(b, lambda s: s["process"].__setitem__("consoleSize", {"height": 33, "width": 99}))
    quark("create", "--bundle", b, "--console-socket", path, "t1")
    conn, _ = srv.accept()
    _, fds, _, _ = socket.recv_fds(conn, 1024, 1)
    master = fds[0]
    quark("start", "t1")
    os.write(master, b"hello\n")
    out = b""
    deadline = time.monotonic() + 10
    while b"got:hello" not in out and time.monotonic() < deadline:
        try:
            out += os.read(master, 4096)
        except OSError:
            break
    text = out.decode()
    assert "/dev/pts/0" in text and "33 99" in text and "got:hello" in text
    os.close(master)


def test_concurrent_create_of_one_id_exactly_one_wins(quark, bundle):
    b = bundle(["sleep", "100"])
    results = []

    def create():
        results.append(quark("create", "--bundle", b, "same", check=False))
    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 1, 1, 1]
    assert all("already exists" in r.stderr for r in results if r.returncode)
    assert quark.state("same")["status"] == "created"
