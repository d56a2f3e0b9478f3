"""Scheduling attributes, as runc gives them: the caller's nice value, policy and I/O priority
reach the container (through the sandbox factory too, whose own are the kernel's defaults), its CPU
affinity does not (the container runs on what its cpuset allows), and the runtime-spec 1.2 fields
process.scheduler, process.ioPriority and process.execCPUAffinity are applied, not dropped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from qlib import sched
from qvisor.factory import client, wire
from qvisor.spec import IOPRIO_CLASSES
from tests.integration.conftest import edit_config
from tests.integration.test_lifecycle import wait_status

ALL = os.sched_getaffinity(0)   # (pytest runs unpinned: every CPU of this machine)


def two_cpus() -> None:
    if len(ALL) < 2:
        pytest.skip("needs two CPUs: an affinity of one CPU must differ from all of them")


def attrs(pid: int) -> tuple[int, int, int, set[int]]:
    """(policy, nice, I/O priority, CPUs) of a process."""
    s = sched.Scheduling.of(pid)
    return s.policy, s.nice, s.ioprio, set(s.cpus)


def as_caller(nice: int, cpus: set[int], policy: int = os.SCHED_OTHER, ioprio: int = 0):
    def apply() -> None:
        os.sched_setaffinity(0, cpus)
        os.sched_setscheduler(0, policy, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        sched.ioprio_set(ioprio)
    return apply


BE6 = sched.ioprio_value(IOPRIO_CLASSES["IOPRIO_CLASS_BE"], 6)


@pytest.mark.parametrize("factory_on", ["1", "0"], ids=["factory", "cli"])
def test_the_container_gets_the_callers_nice_policy_and_io_priority_not_its_cpus(quark, bundle, factory_on,
                                                                                 tmp_path):
    """`nice -n 5 chrt -b ionice -c2 -n6 taskset -c 0 quark run -d ...`: the container runs at nice
    5, SCHED_BATCH, best-effort 6 (fork passes them on, and runc's container has them), on every
    CPU its cpuset allows (runc resets the affinity after the move into the cgroup)."""
    two_cpus()
    env = dict(os.environ, QUARK_FACTORY=factory_on, QUARK_FACTORY_DIR=str(tmp_path / "factory"))
    try:
        quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "s1", env=env,
              preexec_fn=as_caller(5, {0}, os.SCHED_BATCH, BE6))
        init = wait_status(quark, "s1", "running")["pid"]
        assert attrs(init) == (os.SCHED_BATCH, 5, BE6, ALL)
        with open(os.path.join(quark.root, "s1", "state.json")) as f:
            supervisor = json.load(f)["supervisor_pid"]
        assert attrs(supervisor)[:3] == (os.SCHED_BATCH, 5, BE6)   # the supervisor is the caller's too
    finally:
        quark("delete", "--force", "s1", check=False, env=env)
        if factory_on == "1":
            client.stop(str(tmp_path / "factory"))


def test_a_factory_started_by_a_niced_pinned_caller_serves_the_next_caller_with_its_own(quark, bundle, tmp_path):
    """The factory is started by whichever create comes first: its nice value and CPUs must not
    become every later container's."""
    two_cpus()
    where = str(tmp_path / "factory")
    starter = subprocess.Popen([sys.executable, "-m", "qvisor.factory", "--dir", where, "--idle", "60"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=as_caller(10, {1}, os.SCHED_IDLE))
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(where, wire.SOCK_NAME)) and time.monotonic() < deadline:
            assert starter.poll() is None
            time.sleep(0.05)
        assert attrs(starter.pid) == (os.SCHED_OTHER, 0, 0, ALL)   # the kernel's defaults
        env = dict(os.environ, QUARK_FACTORY="1", QUARK_FACTORY_DIR=where)
        quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "s2", env=env, preexec_fn=as_caller(2, ALL))
        init = wait_status(quark, "s2", "running")["pid"]
        assert attrs(init) == (os.SCHED_OTHER, 2, 0, ALL)
    finally:
        quark("delete", "--force", "s2", check=False)
        client.stop(where)
        starter.wait(timeout=10)


def test_process_scheduler_and_io_priority_are_applied(quark, bundle, tmp_path):
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["process"].update(scheduler={"policy": "SCHED_BATCH", "nice": 7},
                                                 ioPriority={"class": "IOPRIO_CLASS_BE", "priority": 6}))
    quark("run", "-d", "--bundle", b, "s3")
    init = wait_status(quark, "s3", "running")["pid"]
    assert attrs(init)[:3] == (os.SCHED_BATCH, 7, BE6)
    # an exec'd process gets its own process.json's
    proc = {"args": ["sleep", "100"], "cwd": "/", "scheduler": {"policy": "SCHED_IDLE"},
            "ioPriority": {"class": "IOPRIO_CLASS_IDLE", "priority": 0}}
    (tmp_path / "p.json").write_text(json.dumps(proc))
    quark("exec", "-d", "--process", str(tmp_path / "p.json"), "--pid-file", str(tmp_path / "pid"), "s3")
    pid = int((tmp_path / "pid").read_text())
    assert attrs(pid)[:3] == (os.SCHED_IDLE, 0, sched.ioprio_value(IOPRIO_CLASSES["IOPRIO_CLASS_IDLE"], 0))


def test_a_scheduler_the_kernel_refuses_fails_the_create_naming_the_field(quark, bundle):
    """SCHED_DEADLINE with a runtime longer than its period: sched_setattr says EINVAL."""
    b = bundle(["true"])
    edit_config(b, lambda s: s["process"].update(scheduler={"policy": "SCHED_DEADLINE", "runtime": 2000000,
                                                            "deadline": 1000000, "period": 1000000}))
    quark("create", "--bundle", b, "s4")
    r = quark("start", "s4", check=False)
    assert r.returncode != 0 and "process.scheduler: SCHED_DEADLINE" in r.stderr, r.stderr


def test_exec_cpu_affinity_initial_and_final(quark, bundle, tmp_path):
    two_cpus()
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "s5", preexec_fn=as_caller(0, {0}))
    assert attrs(wait_status(quark, "s5", "running")["pid"])[3] == ALL   # the init: reset, never pinned

    def exec_with(affinity: dict | None) -> subprocess.CompletedProcess:
        proc = {"args": ["sleep", "100"], "cwd": "/"} | ({"execCPUAffinity": affinity} if affinity else {})
        (tmp_path / "p.json").write_text(json.dumps(proc))
        return quark("exec", "-d", "--process", str(tmp_path / "p.json"), "--pid-file", str(tmp_path / "pid"), "s5",
                     check=False, preexec_fn=as_caller(0, {0}))

    def pinned() -> set[int]:
        return attrs(int((tmp_path / "pid").read_text()))[3]

    assert exec_with({"initial": "0", "final": "1"}).returncode == 0 and pinned() == {1}
    assert exec_with({"initial": "1"}).returncode == 0 and pinned() == {1}   # no final: stays on initial
    assert exec_with(None).returncode == 0 and pinned() == ALL             # none: not the caller's {0}
    r = exec_with({"final": str(max(ALL) + 1)})   # a CPU this machine does not have
    assert r.returncode != 0 and "process.execCPUAffinity.final" in r.stderr, r.stderr


def test_linux_personality_linux32_makes_uname_say_32_bit(quark, bundle):
    if os.uname().machine != "x86_64":
        pytest.skip("LINUX32 on x86_64 reports i686; this host is not x86_64")
    b = bundle(["uname", "-m"])
    edit_config(b, lambda s: s["linux"].update(personality={"domain": "LINUX32"}))
    r = quark("run", "--bundle", b, "p1")
    assert r.stdout.strip() == "i686"
    # and an exec'd process gets it too (runc applies it in both)
    quark("run", "-d", "--bundle", _sleeping(bundle, {"domain": "LINUX32"}), "p2")
    wait_status(quark, "p2", "running")
    assert quark("exec", "p2", "uname", "-m").stdout.strip() == "i686"


def _sleeping(bundle, personality: dict) -> str:
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"].update(personality=personality))
    return b


def test_linux_time_offsets_are_the_new_time_namespaces(quark, bundle):
    """Written before the init enters the time namespace: the container's clocks are offset."""
    b = bundle(["cat", "/proc/self/timens_offsets"])
    edit_config(b, lambda s: (s["linux"]["namespaces"].append({"type": "time"}),
                              s["linux"].update(timeOffsets={"monotonic": {"secs": 86400, "nanosecs": 5},
                                                             "boottime": {"secs": -60}})))
    out = quark("run", "--bundle", b, "t1").stdout.split("\n")
    assert "monotonic      86400          5" in out or any(ln.split() == ["monotonic", "86400", "5"] for ln in out), out
    assert any(ln.split() == ["boottime", "-60", "0"] for ln in out), out


def _policy_of(numa_maps: str) -> set[str]:
    """The policies /proc/PID/numa_maps shows for a process's mappings (its task policy, here)."""
    return {line.split()[1] for line in numa_maps.splitlines() if len(line.split()) > 1}


def test_linux_memory_policy_is_the_containers_processes(quark, bundle):
    """set_mempolicy(2) before exec, for the init and exec'd processes (as runc): numa_maps shows
    it. This machine has one NUMA node (0); a node it lacks fails the start, naming the field."""
    b = bundle(["sh", "-c", "cat /proc/self/numa_maps; exec sleep 100"])
    edit_config(b, lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_BIND", "nodes": "0"}))
    quark("run", "-d", "--bundle", b, "m1")
    wait_status(quark, "m1", "running")
    assert _policy_of(quark("exec", "m1", "cat", "/proc/self/numa_maps").stdout) == {"bind:0"}
    b = bundle(["cat", "/proc/self/numa_maps"])
    edit_config(b, lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_INTERLEAVE", "nodes": "0"}))
    assert _policy_of(quark("run", "--bundle", b, "m2").stdout) == {"interleave:0"}
    b = bundle(["true"])
    edit_config(b, lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_BIND", "nodes": "1000"}))
    quark("create", "--bundle", b, "m3")
    r = quark("start", "m3", check=False)
    assert r.returncode != 0 and "linux.memoryPolicy: MPOL_BIND 1000: Invalid argument" in r.stderr, r.stderr
