"""Hibernation (`quark snapshot`, qvisor/supervisor/snapshot.py) with real containers: a Python HTTP
server holding warm state (the host's python3, its /usr bound read-only) and busybox. Memory in the
cgroup drops; the container wakes by CLI, by a connection, for exec and resume, and after idling
hibernates by itself; responses prove its memory came back intact. The swap these tests use is a
swap file they make and remove (swap must not outlive them: other tests' memory limits assume none).
"""
from __future__ import annotations

import json
import os
import time

import pytest

from qvisor.state import HIBERNATED_ANNOTATION
from tests.integration.conftest import edit_config
from tests.support.snapshot import (SERVER, connect, http_get, python_bundle, state_digest, swapfile,
                                    wait_listening)

PORT = 8080
MiB = 1 << 20


def _host_swaps() -> list[str]:
    with open("/proc/swaps") as f:
        return [ln.split()[0] for ln in f.readlines()[1:] if ln.strip()]


def _snapshot(quark, cid: str) -> dict:
    return json.loads(quark("snapshot", "create", "-f", "json", cid).stdout)


def _hibernated(quark, cid: str) -> bool:
    st = quark.state(cid)
    return st["status"] == "paused" and HIBERNATED_ANNOTATION in st["annotations"]


def _run_server(quark, tmp_path, cid: str, mib: int = 32, annotations: dict | None = None) -> int:
    b = python_bundle(str(tmp_path / cid), ["python3", SERVER, str(PORT), str(mib)], annotations)
    quark("run", "-d", "--bundle", b, cid)
    pid = quark.state(cid)["pid"]
    wait_listening(pid, PORT)
    return pid


def test_without_swap_it_freezes_only_and_says_so(quark, bundle):
    if _host_swaps():
        pytest.skip(f"the host has swap ({_host_swaps()}): this test needs a host without")
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "noswap")
    out = quark("snapshot", "create", "noswap").stdout
    assert "no swap" in out and "frozen only" in out
    assert _hibernated(quark, "noswap")
    quark("snapshot", "restore", "noswap")
    assert quark.state("noswap")["status"] == "running"


def test_swapfile_from_the_config_file(quark, bundle, tmp_path, monkeypatch):
    if _host_swaps():
        pytest.skip(f"the host has swap ({_host_swaps()}): this test needs a host without")
    from qlib import linux as L
    path = str(tmp_path / "swap" / "quark.swap")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"snapshot:\n  swapfile:\n    path: {path}\n    size: 64M\n")
    monkeypatch.setenv("QUARK_CONFIG", str(cfg))
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "cfg")
    try:
        info = _snapshot(quark, "cfg")
        assert info["swap"] is True
        assert path in _host_swaps() and os.stat(path).st_mode & 0o777 == 0o600
    finally:
        quark("delete", "--force", "cfg", check=False)
        if path in _host_swaps():
            L.swapoff(path)
    cfg.write_text(f"snapshot:\n  swapfile:\n    path: {path}\n    size: lots\n")
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "badcfg")
    r = quark("snapshot", "create", "badcfg", check=False)
    assert r.returncode == 1 and str(cfg) in r.stderr and "snapshot.swapfile.size" in r.stderr
    assert quark.state("badcfg")["status"] == "running"


def test_a_full_swap_pages_out_what_fits_and_says_so(quark, bundle, tmp_path):
    if _host_swaps():
        pytest.skip(f"the host has swap ({_host_swaps()}): this test needs a host without")
    b = bundle(["sh", "-c", "x=$(head -c 60000000 /dev/zero | tr '\\0' a); while :; do sleep 1000; done"])
    quark("run", "-d", "--bundle", b, "full")
    time.sleep(2)   # the shell builds its 60 MB string
    with swapfile(str(tmp_path / "small.swap"), size_mib=16):
        out = quark("snapshot", "create", "full").stdout
        info = json.loads(quark("snapshot", "create", "-f", "json", "full").stdout)   # idempotent: the same
        assert "swap is full" in out and info["swap_full"] is True
        assert info["held_bytes"] > 40 * MiB and info["warm_bytes"] > 55 * MiB, info
        assert f"{info['warm_bytes'] / MiB:.1f} MiB -> {info['held_bytes'] / MiB:.1f} MiB" in out
        quark("snapshot", "restore", "full")
        assert quark("exec", "full", "echo", "fine").stdout.strip() == "fine"
        quark("delete", "--force", "full")   # before swapoff: nothing of it is left to read back


def test_a_wake_racing_a_delete_one_wins_cleanly(quark, bundle):
    import subprocess
    b = bundle(["sleep", "1000"])
    for i in range(5):
        cid = f"race{i}"
        quark("run", "-d", "--bundle", b, cid)
        quark("snapshot", "create", cid)
        argv = quark.argv0 + ["--root", quark.root]
        wake = subprocess.Popen(argv + ["snapshot", "restore", cid], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        gone = subprocess.run(argv + ["delete", "--force", cid], capture_output=True, text=True, timeout=60)
        out, err = wake.communicate(timeout=60)
        assert gone.returncode == 0, gone.stderr
        assert wake.returncode == 0 or (err.startswith("quark: ") and "Traceback" not in err), err
        assert cid not in quark.ids()


@pytest.fixture(scope="module")
def swap(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: swapon")
    with swapfile(str(tmp_path_factory.mktemp("swap") / "swapfile")) as path:
        yield path


def test_hibernate_pages_out_and_wakes_with_its_memory_intact(quark, tmp_path, swap):
    pid = _run_server(quark, tmp_path, "py")
    before = state_digest(pid, PORT)
    assert before["digest"] == before["expected"]
    info = _snapshot(quark, "py")
    assert info["swap"] is True and info["hibernations"] == 1
    assert info["warm_bytes"] > 32 * MiB
    assert info["held_bytes"] <= 0.15 * info["warm_bytes"], info   # the goal: <= 15 % of warm
    st = quark.state("py")
    assert st["status"] == "paused" and HIBERNATED_ANNOTATION in st["annotations"]
    listed = json.loads(quark("snapshot", "list", "-f", "json").stdout)
    assert [r["id"] for r in listed] == ["py"] and listed[0]["warm_bytes"] == info["warm_bytes"]
    assert listed[0]["held_now_bytes"] < 0.15 * info["warm_bytes"] and listed[0]["wakes"] == 0
    quark("snapshot", "restore", "py")
    st = quark.state("py")
    assert st["status"] == "running" and HIBERNATED_ANNOTATION not in st["annotations"]
    after = state_digest(pid, PORT)
    assert after["digest"] == before["expected"] and after["requests"] == before["requests"] + 1
    assert json.loads(quark("snapshot", "list", "-f", "json").stdout) == []


def test_a_connection_wakes_it_and_is_held_not_refused(quark, tmp_path, swap):
    pid = _run_server(quark, tmp_path, "conn", mib=8)
    expected = state_digest(pid, PORT)["expected"]
    _snapshot(quark, "conn")
    assert _hibernated(quark, "conn")
    got = state_digest(pid, PORT)   # connects to the frozen container: it wakes and answers
    assert got["digest"] == expected
    assert quark.state("conn")["status"] == "running"
    info = json.loads(quark("snapshot", "create", "-f", "json", "conn").stdout)
    assert info["wakes"] == 1 and info["hibernations"] == 2
    # the second hibernation recorded what the container touched after the first wake
    assert info["prefetch_pages"] > 0
    assert state_digest(pid, PORT)["digest"] == expected   # woken again, with the working set read back


def test_busybox_httpd_wakes_on_connect(quark, bundle, swap):
    b = bundle(["httpd", "-f", "-p", str(PORT), "-h", "/etc"])
    quark("run", "-d", "--bundle", b, "bb")
    pid = quark.state("bb")["pid"]
    wait_listening(pid, PORT)
    _snapshot(quark, "bb")
    assert http_get(pid, PORT, "/group").startswith(b"root:x:0:")
    assert quark.state("bb")["status"] == "running"


def test_hibernating_twice_is_idempotent_and_bad_states_are_refused(quark, bundle, swap):
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "twice")
    first = _snapshot(quark, "twice")
    again = _snapshot(quark, "twice")
    assert again["since"] == first["since"] and again["hibernations"] == 1
    r = quark("snapshot", "create", "nosuch", check=False)
    assert r.returncode == 1 and "nosuch" in r.stderr and "Traceback" not in r.stderr
    quark("create", "--bundle", bundle(["sleep", "1000"]), "created")
    r = quark("snapshot", "create", "created", check=False)
    assert r.returncode == 1 and "it is created" in r.stderr
    quark("run", "--bundle", bundle(["true"]), "--keep", "stopped")
    r = quark("snapshot", "create", "stopped", check=False)
    assert r.returncode == 1 and "stopped" in r.stderr
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "paused")
    quark("pause", "paused")
    r = quark("snapshot", "create", "paused", check=False)
    assert r.returncode == 1 and "paused" in r.stderr
    r = quark("snapshot", "restore", "paused", check=False)
    assert r.returncode == 1 and "not hibernated" in r.stderr


def test_resume_and_exec_wake_it(quark, bundle, swap):
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "rx")
    _snapshot(quark, "rx")
    quark("resume", "rx")   # the shim's Resume goes the same way (container.resume)
    assert quark.state("rx")["status"] == "running"
    assert json.loads(quark("snapshot", "list", "-f", "json").stdout) == []
    _snapshot(quark, "rx")
    r = quark("exec", "rx", "echo", "awake")
    assert r.stdout.strip() == "awake"
    assert quark.state("rx")["status"] == "running"


def test_kill_and_delete_while_hibernated_leave_nothing(quark, bundle, swap):
    from tests.integration.conftest import cgroup_dirs
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "k")
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), "d")
    for cid in ("k", "d"):
        _snapshot(quark, cid)
    cg = quark.state("d")
    quark("kill", "k", "KILL")
    deadline = time.monotonic() + 10
    while quark.state("k")["status"] != "stopped":
        assert time.monotonic() < deadline, "a hibernated container did not die of SIGKILL"
        time.sleep(0.05)
    assert HIBERNATED_ANNOTATION not in quark.state("k")["annotations"]
    assert json.loads(quark("wait", "k").stdout)["exit_status"] == 137   # the exit is reported
    assert json.loads(quark("snapshot", "list", "-f", "json").stdout)[0]["id"] == "d"
    from qvisor.state import StateStore
    cgroup_path = StateStore(quark.root).load_raw("d").cgroup_path
    quark("delete", "--force", "d")
    assert "d" not in quark.ids() and not cgroup_dirs(cgroup_path) and cg["pid"]
    assert not os.path.exists(f"/proc/{cg['pid']}")


def test_twenty_hibernated_at_once(quark, bundle, swap):
    b = bundle(["sh", "-c", "x=$(head -c 4000000 /dev/zero | tr '\\0' a); while :; do sleep 1000; done"])
    ids = [f"many{i}" for i in range(20)]
    for cid in ids:
        quark("run", "-d", "--bundle", b, cid)
    time.sleep(1)   # each shell builds its 4 MB string
    infos = [_snapshot(quark, cid) for cid in ids]
    assert all(i["warm_bytes"] > 4 * MiB and i["held_bytes"] < 0.5 * i["warm_bytes"] for i in infos), infos
    listed = json.loads(quark("snapshot", "list", "-f", "json").stdout)
    assert sorted(r["id"] for r in listed) == sorted(ids)
    for cid in ids:
        quark("snapshot", "restore", cid)
        assert quark.state(cid)["status"] == "running"


def test_idle_hibernation_then_wake_on_connect(quark, tmp_path, swap):
    pid = _run_server(quark, tmp_path, "idle", mib=8, annotations={"io.quark.hibernate.idle-after": "1s"})
    deadline = time.monotonic() + 20
    while not _hibernated(quark, "idle"):
        assert time.monotonic() < deadline, "an idle container did not hibernate itself"
        time.sleep(0.1)
    assert json.loads(quark("snapshot", "list", "-f", "json").stdout)[0]["reason"] == "idle"
    got = state_digest(pid, PORT)
    assert got["digest"] == got["expected"]
    # a connection that stays open but quiet does not keep it awake; it hibernates again
    with connect(pid, PORT):
        deadline = time.monotonic() + 20
        while not _hibernated(quark, "idle"):
            assert time.monotonic() < deadline, "it did not hibernate again after the wake"
            time.sleep(0.1)


def test_bad_idle_annotation_is_refused_naming_the_field(quark, bundle):
    b = bundle(["sleep", "1000"])
    edit_config(b, lambda s: s.setdefault("annotations", {}).update({"io.quark.hibernate.idle-after": "soon"}))
    r = quark("run", "-d", "--bundle", b, "badidle", check=False)
    assert r.returncode == 1 and "io.quark.hibernate.idle-after" in r.stderr and "config.json" in r.stderr
    assert quark.ids() == []


def test_run_snapshot_when_ready(quark, tmp_path, bundle, swap):
    b = python_bundle(str(tmp_path / "ready"), ["python3", SERVER, str(PORT), "8"])
    r = quark("run", "-d", "--snapshot-when", f"tcp:{PORT}", "--bundle", b, "ready")
    assert "hibernated" in r.stderr
    assert _hibernated(quark, "ready")
    got = state_digest(quark.state("ready")["pid"], PORT)
    assert got["digest"] == got["expected"]
    fb = bundle(["sh", "-c", "sleep 0.3; touch /tmp/ready; while :; do sleep 1000; done"], readonly=False)
    quark("run", "-d", "--snapshot-when", "file:/tmp/ready", "--bundle", fb, "file")
    assert _hibernated(quark, "file")
    eb = bundle(["sh", "-c", "sleep 0.3; touch /tmp/ok; while :; do sleep 1000; done"], readonly=False)
    quark("run", "-d", "--snapshot-when", "exec:test -e /tmp/ok", "--bundle", eb, "exec")
    assert _hibernated(quark, "exec")


def test_run_snapshot_when_errors_leave_nothing(quark, bundle, swap):
    b = bundle(["sleep", "1000"])
    for cond, words in (("tcp:0", "1-65535"), ("udp:53", "unknown condition"), ("exec:", "expected")):
        r = quark("run", "-d", "--snapshot-when", cond, "--bundle", b, "bad", check=False)
        assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert quark.ids() == []
    r = quark("run", "-d", "--snapshot-when", "tcp:9", "--snapshot-timeout", "0.5", "--bundle", b, "late",
              check=False)
    assert r.returncode == 1 and "not ready after 0.5s" in r.stderr
    assert quark.ids() == []
