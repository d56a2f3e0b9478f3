"""Containers on a real cgroup v2 host (the qemu lane, `make test-cgroup2`): life cycle, every
linux.resources field in its v2 form and enforced by the kernel, device rules as an eBPF program,
freeze, kill --all through cgroup.kill, OOM, update."""
from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from qvisor.cgroups import v2
from tests.integration.conftest import edit_config

ROOT = "/sys/fs/cgroup"
MiB = 1 << 20


def _cid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _dir(cid: str) -> str:
    return f"{ROOT}/quark/{cid}"


def _read(cid: str, name: str) -> str:
    with open(os.path.join(_dir(cid), name)) as f:
        return f.read().strip()


def _events(cid: str, name: str = "cgroup.events") -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in _read(cid, name).splitlines())}


def _resources(**oci):
    def edit(spec: dict) -> None:
        spec["linux"].setdefault("resources", {}).update(oci)
    return edit


def _wait_stopped(quark, cid: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while quark.state(cid)["status"] != "stopped":
        assert time.monotonic() < deadline, f"{cid} did not stop"
        time.sleep(0.1)


def _block_device() -> tuple[int, int]:
    """major:minor of a whole disk in the guest (the lane gives it a scratch virtio disk)."""
    for name in sorted(os.listdir("/sys/block")):
        if name.startswith(("vd", "sd", "loop")) and os.path.exists(f"/sys/block/{name}/dev"):
            with open(f"/sys/block/{name}/dev") as f:
                major, minor = f.read().split(":")
            return int(major), int(minor)
    pytest.fail("the guest has no block device: the lane must attach its scratch disk")


def test_life_cycle_freeze_and_kill_all(quark, bundle) -> None:
    cid = _cid("life")
    quark("run", "-d", "--bundle", bundle(["sh", "-c", "sleep 100 & sleep 100 & wait"]), cid)
    pid = quark.state(cid)["pid"]
    assert str(pid) in _read(cid, "cgroup.procs").split()
    quark("pause", cid)
    assert quark.state(cid)["status"] == "paused" and _events(cid)["frozen"] == 1
    quark("resume", cid)
    assert quark.state(cid)["status"] == "running" and _events(cid)["frozen"] == 0
    quark("kill", "--all", cid, "KILL")   # cgroup.kill: every process, forked ones included
    _wait_stopped(quark, cid)
    assert _read(cid, "cgroup.procs") == ""
    quark("delete", cid)
    assert not os.path.exists(_dir(cid))


def test_every_resource_in_its_v2_file(quark, bundle) -> None:
    major, minor = _block_device()
    cid = _cid("res")
    b = bundle(["sleep", "100"])
    edit_config(b, _resources(
        memory={"limit": 64 * MiB, "swap": 96 * MiB, "reservation": 32 * MiB}, pids={"limit": 40},
        cpu={"shares": 512, "quota": 50000, "period": 100000, "cpus": "0", "mems": "0"},
        hugepageLimits=[{"pageSize": "2MB", "limit": 4 * MiB}], unified={"memory.high": str(48 * MiB)},
        blockIO={"weight": 500, "throttleReadBpsDevice": [{"major": major, "minor": minor, "rate": MiB}],
                 "throttleWriteIOPSDevice": [{"major": major, "minor": minor, "rate": 30}]}))
    quark("run", "-d", "--bundle", b, cid)
    want = {"memory.max": str(64 * MiB), "memory.swap.max": str(32 * MiB), "memory.low": str(32 * MiB),
            "memory.high": str(48 * MiB), "pids.max": "40", "cpu.weight": str(v2.shares_to_weight(512)),
            "cpu.max": "50000 100000", "cpuset.cpus": "0", "cpuset.mems": "0", "hugetlb.2MB.max": str(4 * MiB)}
    assert {name: _read(cid, name) for name in want} == want
    assert _read(cid, "io.max") == f"{major}:{minor} rbps={MiB} wbps=max riops=max wiops=30"
    weight = "io.bfq.weight" if os.path.exists(f"{_dir(cid)}/io.bfq.weight") else "io.weight"
    expected = "500" if weight == "io.bfq.weight" else str(v2.blkio_to_io_weight(500))
    assert _read(cid, weight).splitlines()[0] == f"default {expected}"


def test_pids_limit_is_enforced(quark, bundle) -> None:
    b = bundle(["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 5 & done 2>&1; echo forked"])
    edit_config(b, _resources(pids={"limit": 4}))
    r = quark("run", "--bundle", b, _cid("pids"), check=False)
    assert "can't fork" in r.stdout + r.stderr


def test_cpu_quota_throttles(quark, bundle) -> None:
    cid = _cid("cpu")
    b = bundle(["sh", "-c", "while :; do :; done"])
    edit_config(b, _resources(cpu={"quota": 10000, "period": 100000}))
    quark("run", "-d", "--bundle", b, cid)
    before = _events(cid, "cpu.stat")   # the set-up's own CPU time (slow under emulation) is not the loop's
    time.sleep(1.5)
    stat = _events(cid, "cpu.stat")
    assert stat["nr_throttled"] > 0
    # 10 % of one CPU over 1.5 s is 0.15 s; unthrottled, the loop would take the whole 1.5 s
    assert stat["usage_usec"] - before["usage_usec"] < 500_000


def test_out_of_memory_kills_the_init(quark, bundle) -> None:
    b = bundle(["tail", "/dev/zero"])   # buffers an endless line until the OOM killer strikes
    edit_config(b, _resources(memory={"limit": 32 * MiB, "swap": 32 * MiB}))
    r = quark("run", "--bundle", b, _cid("oom"), check=False, timeout=120)
    assert r.returncode == 137, r.stderr   # 128 + SIGKILL


DEVICE = {"path": "/dev/zero2", "type": "c", "major": 1, "minor": 5, "fileMode": 0o666}
PROBE = ("head -c 4 /dev/zero2 | wc -c; echo x > /dev/zero2 && echo wrote; "
         "echo y > /dev/null && echo null-ok; head -c 2 /dev/urandom | wc -c")


def test_device_rules_allow_and_deny(quark, bundle) -> None:
    # linux.devices makes the node; the eBPF program allows exactly the rules, last match winning
    b = bundle(["sh", "-c", PROBE])
    edit_config(b, lambda s: s["linux"].__setitem__("devices", [DEVICE]))
    edit_config(b, _resources(devices=[{"allow": False, "access": "rwm"},
                                       {"allow": False, "type": "c", "major": 1, "minor": 5, "access": "w"}]))
    r = quark("run", "--bundle", b, _cid("dev"), check=False)
    # the container's own devices and the defaults get rwm after the spec's rules (as runc appends
    # them), so /dev/zero2 stays readable and writable and null/urandom work after a deny-all
    assert r.stdout.split() == ["4", "wrote", "null-ok", "2"], r.stdout + r.stderr


def test_device_not_allowed_is_denied(quark, bundle) -> None:
    # a node made inside the container for a device no rule allows: mknod passes (m is allowed for
    # every node), opening it does not
    b2 = bundle(["sh", "-c", "mknod /dev/xmem c 1 1 && echo made; head -c 1 /dev/xmem && echo opened"])
    for k in ("bounding", "effective", "permitted"):
        edit_config(b2, lambda s, k=k: s["process"]["capabilities"][k].append("CAP_MKNOD"))
    r = quark("run", "--bundle", b2, _cid("mknod"), check=False)
    assert "made" in r.stdout and "opened" not in r.stdout
    assert "Operation not permitted" in r.stderr + r.stdout


def test_update_rewrites_limits_and_device_program(quark, bundle, tmp_path) -> None:
    cid = _cid("upd")
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"].__setitem__("devices", [DEVICE]))
    edit_config(b, _resources(memory={"limit": 64 * MiB}, pids={"limit": 40}))
    quark("run", "-d", "--bundle", b, cid)
    quark("update", "--memory", "128M", "--pids-limit", "50", "--cpu-quota", "30000", "--cpu-period", "100000", cid)
    assert (_read(cid, "memory.max"), _read(cid, "pids.max"), _read(cid, "cpu.max")) == \
        (str(128 * MiB), "50", "30000 100000")
    # a device rule given to update comes after the container's own (it wins); the defaults stay
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"devices": [{"allow": False, "type": "c", "major": 1, "minor": 5, "access": "rw"}]}))
    quark("update", "--resources", str(f), cid)
    r = quark("exec", cid, "sh", "-c", "head -c 4 /dev/zero2 | wc -c; echo y > /dev/null && echo null-ok",
              check=False)
    assert "null-ok" in r.stdout and "Operation not permitted" in r.stderr
    assert r.stdout.split()[0] == "0"


def test_hibernate_freezes_through_cgroup_freeze_and_a_connection_wakes_it(quark, bundle) -> None:
    """Hibernation on v2 (qvisor/supervisor/snapshot.py): cgroup.freeze, memory.reclaim, a wake on
    connect, SIGKILL while hibernated. The guest has no swap: the memory stays and it says so."""
    from tests.support.snapshot import http_get, wait_listening
    cid = _cid("hib")
    quark("run", "-d", "--bundle", bundle(["httpd", "-f", "-p", "8080", "-h", "/etc"]), cid)
    pid = quark.state(cid)["pid"]
    wait_listening(pid, 8080)
    out = quark("snapshot", "create", cid).stdout
    assert "frozen only" in out or "MiB ->" in out
    assert _read(cid, "cgroup.freeze") == "1" and _events(cid)["frozen"] == 1
    assert http_get(pid, 8080, "/group").startswith(b"root:x:0:")
    assert _read(cid, "cgroup.freeze") == "0" and quark.state(cid)["status"] == "running"
    quark("snapshot", "create", cid)
    quark("kill", cid, "KILL")
    _wait_stopped(quark, cid)
    quark("delete", cid)
    assert not os.path.exists(_dir(cid))
