"""docker (Debian's docker.io 20.10) with quark as a `runtimes` entry of daemon.json, side by side
with runc on the same image: what a docker user does, and the answers compared.

dockerd is private to this module (tests/support/managers.py): its own data and exec roots, no
default bridge, `--iptables=false`; so `-p` and user-defined networks (bridges on the host) are
not run here, and every container has `--network none`.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from tests.integration.conftest import QUARK, withheld_capabilities
from tests.support import managers

pytestmark = [pytest.mark.root, pytest.mark.skipif(managers.docker_skip_reason() is not None,
                                                   reason=managers.docker_skip_reason() or "")]
RUNTIMES = ("runc", "quark")
NET = ["--network", "none"]


@pytest.fixture(scope="module")
def docker(tmp_path_factory):
    d = tmp_path_factory.mktemp("docker")
    privileged = managers.runtime_wrapper(d, QUARK[0], "security:\n  privileged_without_host_devices: true\n")
    dockerd = managers.Dockerd({"quark": QUARK[0], "quark-nohostdev": privileged})
    try:
        dockerd.start()
        dockerd(["import", str(managers.image_tar(d / "busybox.tar")), managers.IMAGE])
        yield dockerd
    finally:
        dockerd.close()


def run(docker, rt: str, *args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    return docker(["run", "--rm", "--runtime", rt, *NET, *args], check=check, **kw)


def both(docker, *args: str) -> dict[str, subprocess.CompletedProcess]:
    return {rt: run(docker, rt, *args) for rt in RUNTIMES}


def test_every_docker_run_starts_and_exit_statuses_pass_through(docker):
    # docker writes "blockIO": {"weight": 0} into every spec: each run failed at create before
    for rt, r in both(docker, managers.IMAGE, "sh", "-c", "echo hi; echo err >&2; exit 3").items():
        assert (r.returncode, r.stdout, r.stderr) == (3, "hi\n", "err\n"), (rt, r.stderr)


def test_a_missing_program_is_reported_as_runcs_error(docker):
    r = both(docker, managers.IMAGE, "/no/such/program")
    assert r["quark"].returncode == r["runc"].returncode == 127
    # the runtime's JSON log is read: quark's own words, no "unable to retrieve OCI runtime error"
    assert "OCI runtime create failed" in r["quark"].stderr and "/no/such/program" in r["quark"].stderr
    assert "unable to retrieve" not in r["quark"].stderr, r["quark"].stderr


def test_environment_workdir_user_volumes_and_read_only(docker, tmp_path):
    script = "echo $A $(pwd) $(id -u):$(id -g); echo x > /data/from-$R; touch /x 2>/dev/null || echo ro; " \
             "touch /run/ok && echo tmpfs"
    out = {}
    for rt in RUNTIMES:
        r = run(docker, rt, "-e", "A=1", "-e", f"R={rt}", "-w", "/tmp", "-v", f"{tmp_path}:/data", "--read-only",
                "--tmpfs", "/run", managers.IMAGE, "sh", "-c", script)
        assert r.returncode == 0, (rt, r.stderr)
        out[rt] = r.stdout
        assert (tmp_path / f"from-{rt}").read_text() == "x\n"
    assert out["quark"] == out["runc"] == "1 /tmp 0:0\nro\ntmpfs\n"
    r = both(docker, "--user", "65534:65534", managers.IMAGE, "id")
    assert r["quark"].stdout == r["runc"].stdout and "uid=65534" in r["quark"].stdout


def test_memory_pids_and_cpu_limits_reach_the_cgroup(docker):
    read = ("cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max "
            "/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    r = both(docker, "--memory", "64m", "--pids-limit", "50", "--cpus", "0.5", managers.IMAGE, "sh", "-c", read)
    assert r["quark"].returncode == 0, r["quark"].stderr
    assert r["quark"].stdout == r["runc"].stdout == "67108864\n50\n50000\n"


def test_detached_logs_exec_pause_top_stats_restart_stop_and_kill(docker):
    loop = "echo started; trap 'exit 0' TERM; while :; do sleep 0.1; done"
    seen = {}
    for rt in RUNTIMES:
        name = f"d-{rt}"
        docker(["run", "-d", "--name", name, "--runtime", rt, *NET, managers.IMAGE, "sh", "-c", loop])
        try:
            deadline = time.monotonic() + 10
            while "started" not in docker(["logs", name]).stdout and time.monotonic() < deadline:
                time.sleep(0.1)
            got = [docker(["logs", name]).stdout]
            got.append(docker(["exec", name, "sh", "-c", "echo in; exit 5"], check=False))
            docker(["pause", name])
            got.append(docker(["inspect", "-f", "{{.State.Status}}", name]).stdout)
            docker(["unpause", name])
            got.append("sh -c" in docker(["top", name]).stdout)
            got.append(docker(["stats", "--no-stream", "--format", "{{.Name}}", name]).stdout == name + "\n")
            docker(["restart", "-t", "5", name])
            got.append(docker(["inspect", "-f", "{{.State.Status}} {{.RestartCount}}", name]).stdout)
            docker(["stop", "-t", "5", name])
            got.append(docker(["inspect", "-f", "{{.State.ExitCode}}", name]).stdout)
            docker(["start", name])
            docker(["kill", name])
            docker(["wait", name], timeout=30)
            got.append(docker(["inspect", "-f", "{{.State.ExitCode}}", name]).stdout)
        finally:
            docker(["rm", "-f", name], check=False)
        e = got[1]
        seen[rt] = [got[0], (e.returncode, e.stdout), *got[2:]]
    assert seen["quark"] == seen["runc"], seen
    assert seen["quark"] == ["started\n", (5, "in\n"), "paused\n", True, True, "running 0\n", "0\n", "137\n"]


def test_terminal_run(docker):
    for rt in RUNTIMES:
        cmd = f"{managers.DOCKER} -H unix://{docker.socket} run --rm -it --runtime {rt} --network none " \
              f"{managers.IMAGE} sh -c 'tty; exit 4'"
        r = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 4 and "/dev/pts/" in r.stdout, (rt, r.stdout, r.stderr)


def test_cap_add_and_init(docker):
    r = both(docker, "--cap-add", "NET_ADMIN", "--cap-drop", "CHOWN", managers.IMAGE, "grep", "Cap", "/proc/self/status")
    assert r["quark"].returncode == 0 and r["quark"].stdout == r["runc"].stdout, (r["quark"].stdout, r["runc"].stdout)
    r = both(docker, "--init", managers.IMAGE, "ps", "-o", "pid,comm")
    assert r["quark"].stdout.splitlines()[:2] == r["runc"].stdout.splitlines()[:2] == ["PID   COMMAND", "    1 docker-init"]
    assert r["quark"].stdout.split()[-1] == "ps", r["quark"].stdout


def _withheld_capabilities() -> list[str]:
    # of those docker 20.10's --privileged lists: none after CAP_AUDIT_READ
    return withheld_capabilities("CAP_AUDIT_READ")


@pytest.mark.skipif(not _withheld_capabilities(), reason="this host holds every capability docker's --privileged lists")
def test_privileged_with_capabilities_the_host_withholds_fails_the_create_as_with_runc(docker):
    r = both(docker, "--privileged", managers.IMAGE, "true")
    assert r["runc"].returncode == r["quark"].returncode == 125
    assert "create failed" in r["runc"].stderr and "create failed" in r["quark"].stderr
    missing = _withheld_capabilities()[0]
    assert f"process.capabilities: {missing}" in r["quark"].stderr and "not held" in r["quark"].stderr, r["quark"].stderr


@pytest.mark.skipif(bool(_withheld_capabilities()), reason="this host withholds capabilities docker's --privileged "
                    "lists: runc fails the create too (the test above); podman's --privileged, which lists the "
                    "host's own, is tested in test_podman.py")
def test_privileged_with_and_without_host_devices(docker):
    refused = run(docker, "quark", "--privileged", managers.IMAGE, "true")
    assert refused.returncode != 0 and "privileged_without_host_devices" in refused.stderr, refused.stderr
    script = "grep CapEff /proc/self/status; ls /dev | wc -l"
    runc = run(docker, "runc", "--privileged", managers.IMAGE, "sh", "-c", script)
    quark = run(docker, "quark-nohostdev", "--privileged", managers.IMAGE, "sh", "-c", script)
    assert runc.returncode == 0 and quark.returncode == 0, (runc.stderr, quark.stderr)
    assert quark.stdout.splitlines()[0] == runc.stdout.splitlines()[0]   # every capability runc gives
    # and none of the host's device nodes
    assert int(quark.stdout.splitlines()[1]) < 20 < int(runc.stdout.splitlines()[1]), (quark.stdout, runc.stdout)
