"""Signals and ptrace: the container cannot reach the supervisor, tsord or other host processes.

Targets (host pids handed to a probe in the container): quark's supervisor of that container,
a tsord, and a root daemon on the host (standing in for containerd or a shim). The probe tries
kill(pid, 0), PTRACE_SEIZE, pidfd_send_signal(0), pidfd_getfd and /proc/PID/{mem,environ,exe}
(pidfd_open itself needs no permission: a visible pid always gives a handle).

* own pid namespace (runc's default spec): none of those pids exists in the container.
* host pid namespace, an unprivileged user without CAP_KILL: every pid is visible; nothing works.
* host pid namespace, root with runc's default capabilities (CAP_KILL among them): Linux lets it
  signal any process (same uid, and CAP_KILL anyway) — so it can kill the supervisor, as under runc
  it can kill containerd. ptrace and /proc/PID/mem stay shut (no CAP_SYS_PTRACE, fewer capabilities
  than the target). Recorded, and asserted to be no worse than runc.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.security.conftest import edit_config, init_pid, record, runtime_name, uid

pytestmark = pytest.mark.root

REFUSED = {"ESRCH", "EPERM", "EACCES", "ENOENT"}


@pytest.fixture
def daemon():
    p = subprocess.Popen(["sleep", "600"])
    yield p.pid
    p.kill()
    p.wait()


def supervisor_of(c, cid: str) -> int:
    from qlib.procfs import parent_pid
    return parent_pid(init_pid(c, cid))


def run_probe(c, host_bundle, targets: dict, edit=None) -> dict:
    """A long-lived container (so quark's supervisor exists to be targeted), probed by exec."""
    b, _ = host_bundle(["sleep", "100"])
    if edit:
        edit_config(b, edit)
    cid = uid("sig")
    c("run", "-d", "--bundle", b, cid)
    if runtime_name(c) == "quark":
        targets = dict(targets, supervisor=supervisor_of(c, cid))
    r = c("exec", cid, "python3", "/progs/signal_probe.py", json.dumps(targets), check=False)
    c("delete", "--force", cid)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def host_pid_ns(s: dict) -> None:
    s["linux"]["namespaces"] = [n for n in s["linux"]["namespaces"] if n["type"] != "pid"]


def unprivileged(s: dict) -> None:
    host_pid_ns(s)
    s["process"]["user"] = {"uid": 1000, "gid": 1000}
    s["process"]["capabilities"] = {k: ["CAP_AUDIT_WRITE", "CAP_NET_BIND_SERVICE"]
                                    for k in ("bounding", "effective", "permitted")}


def summary(got: dict) -> str:
    return "; ".join(f"{who}: " + ", ".join(f"{k} {v}" for k, v in checks.items()) for who, checks in sorted(got.items()))


@pytest.mark.parametrize("case", ["own-pidns", "host-pidns-unprivileged"])
def test_container_cannot_signal_or_trace_host_processes(cli, host_bundle, tsord, daemon, case):
    rt = runtime_name(cli)
    got = run_probe(cli, host_bundle, {"tsord": tsord.pid, "daemon": daemon},
                    None if case == "own-pidns" else unprivileged)
    if rt == "quark":
        assert "supervisor" in got
    bad = {who: {k: v for k, v in checks.items() if v not in REFUSED and k != "pidfd_open"}
           for who, checks in got.items()}
    assert {who: v for who, v in bad.items() if v} == {}, got
    if case == "own-pidns":
        assert all(checks["kill0"] == "ESRCH" for checks in got.values()), got
    record(f"signal/ptrace host processes ({case})", rt, summary(got))


def test_host_pidns_root_can_signal_but_not_trace(cli, host_bundle, tsord, daemon):
    rt = runtime_name(cli)
    got = run_probe(cli, host_bundle, {"tsord": tsord.pid, "daemon": daemon}, host_pid_ns)
    for who, checks in got.items():
        for k in ("ptrace", "pidfd_getfd", "mem", "environ", "exe"):
            assert checks[k] in REFUSED, (who, checks)
    record("signal/ptrace host processes (host-pidns, root, CAP_KILL)", rt, summary(got))
