"""podman (Debian's 4.3, conmon 2.1) with `--runtime` naming quark, side by side with runc on the
same image: what a podman user does, and the answers compared.

podman is private to this module (tests/support/managers.py): its own storage, run root and tmp
dir, the cgroupfs manager; every container has `--network none`.
"""
from __future__ import annotations

import shlex
import subprocess
import time

import pytest

from tests.integration.conftest import QUARK
from tests.support import managers

pytestmark = [pytest.mark.root, pytest.mark.skipif(managers.podman_skip_reason() is not None,
                                                   reason=managers.podman_skip_reason() or "")]
NET = ["--network", "none", "--cgroup-parent", managers.PODMAN_CGROUP_PARENT]


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    d = tmp_path_factory.mktemp("podman")
    nohostdev = managers.runtime_wrapper(d, QUARK[0], "security:\n  privileged_without_host_devices: true\n")
    p = managers.Podman({"runc": managers.RUNC, "quark": QUARK[0], "quark-nohostdev": nohostdev})
    try:
        p(["import", str(managers.image_tar(d / "busybox.tar")), managers.IMAGE])
        yield p
    finally:
        p.close()


def run(podman, rt: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return podman(["run", "--rm", *NET, *args], runtime=podman.runtimes[rt], check=False, **kw)


def both(podman, *args: str) -> dict[str, subprocess.CompletedProcess]:
    return {rt: run(podman, rt, *args) for rt in ("runc", "quark")}


def in_a_terminal(argv: list[str], env: dict, typed: str = "") -> subprocess.CompletedProcess:
    """`argv` with a pty as its terminal (script(1)); `typed` is written to it a second after start."""
    p = subprocess.Popen(["script", "-qec", shlex.join(argv), "/dev/null"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(1)
    p.stdin.write(typed)
    p.stdin.flush()
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_run_statuses_and_a_missing_program(podman):
    for rt, r in both(podman, managers.IMAGE, "sh", "-c", "echo hi; echo err >&2; exit 3").items():
        assert (r.returncode, r.stdout, r.stderr) == (3, "hi\n", "err\n"), (rt, r.stderr)
    r = both(podman, managers.IMAGE, "/no/such/program")
    # runc fails the create, which podman reports as 127 (command not found); a failed start is 126
    assert r["quark"].returncode == r["runc"].returncode == 127, (r["quark"].stderr, r["runc"].stderr)


def test_exec_statuses_output_detach_and_signals(podman):
    seen = {}
    for rt in ("runc", "quark"):
        name = f"x-{rt}"
        podman(["run", "-d", "--name", name, *NET, managers.IMAGE, "sleep", "300"], runtime=podman.runtimes[rt])
        try:
            got = []
            for cmd in (["sh", "-c", "exit 6"], ["sh", "-c", "echo out; echo err >&2"], ["sh", "-c", "kill -9 $$"]):
                e = podman(["exec", name, *cmd], runtime=podman.runtimes[rt], check=False)
                got.append((e.returncode, e.stdout, e.stderr))
            d = podman(["exec", "-d", name, "sh", "-c", "echo detached > /tmp/d"], runtime=podman.runtimes[rt],
                       check=False)
            got.append(d.returncode)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                cat = podman(["exec", name, "cat", "/tmp/d"], runtime=podman.runtimes[rt], check=False)
                if cat.stdout:
                    break
                time.sleep(0.1)
            got.append(cat.stdout)
            # the exec'd processes are gone and reaped: only the container's own remains
            got.append(podman(["exec", name, "ps", "-o", "comm"], runtime=podman.runtimes[rt]).stdout.split()[1:])
        finally:
            podman(["rm", "-f", "-t", "0", name], runtime=podman.runtimes[rt], check=False)
        seen[rt] = got
    assert seen["quark"] == seen["runc"], seen
    assert seen["quark"][:3] == [(6, "", ""), (0, "out\n", "err\n"), (137, "", "")]


def test_interactive_exec_and_run(podman):
    typed = "echo typed-$((40+2)); tty; exit 3\n"
    for rt in ("runc", "quark"):
        name = f"t-{rt}"
        podman(["run", "-d", "--name", name, *NET, managers.IMAGE, "sleep", "300"], runtime=podman.runtimes[rt])
        try:
            r = in_a_terminal(podman.argv(["exec", "-it", name, "sh"], podman.runtimes[rt]), podman.env, typed)
        finally:
            podman(["rm", "-f", "-t", "0", name], runtime=podman.runtimes[rt], check=False)
        # it reads what is typed (it ended at once, before any input) and says where it runs
        assert r.returncode == 3 and "typed-42" in r.stdout and "/dev/pts/" in r.stdout, (rt, r.stdout, r.stderr)
        r = in_a_terminal(podman.argv(["run", "--rm", "-it", *NET, managers.IMAGE, "sh", "-c", "tty; exit 4"],
                                      podman.runtimes[rt]), podman.env)
        assert r.returncode == 4 and "/dev/pts/" in r.stdout, (rt, r.stdout, r.stderr)


def test_read_only_and_tmpfs_copy_up(podman):
    script = "touch /x 2>/dev/null || echo ro; touch /tmp/ok /run/ok /var/tmp/ok && echo tmpfs"
    r = both(podman, "--read-only", managers.IMAGE, "sh", "-c", script)
    assert r["quark"].stdout == r["runc"].stdout == "ro\ntmpfs\n", r["quark"].stderr
    # --tmpfs asks for tmpcopyup: the image's /etc is in the new tmpfs; notmpcopyup leaves it empty
    r = both(podman, "--tmpfs", "/etc", managers.IMAGE, "cat", "/etc/passwd")
    assert r["quark"].returncode == 0 and r["quark"].stdout == r["runc"].stdout and "root:" in r["quark"].stdout
    r = both(podman, "--mount", "type=tmpfs,destination=/etc,notmpcopyup", managers.IMAGE, "ls", "/etc")
    assert r["quark"].stdout == r["runc"].stdout and "passwd" not in r["quark"].stdout, r["quark"].stderr


def test_environment_workdir_user_and_limits(podman):
    r = both(podman, "-e", "A=1", "-w", "/tmp", "--user", "65534:65534", "--memory", "64m", "--pids-limit", "50",
             managers.IMAGE, "sh", "-c", "echo $A $(pwd) $(id -u):$(id -g); "
             "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max")
    assert r["quark"].stdout == r["runc"].stdout == "1 /tmp 65534:65534\n67108864\n50\n", r["quark"].stderr


def test_detached_logs_pause_stop(podman):
    loop = "echo started; trap 'exit 0' TERM; while :; do sleep 0.1; done"
    seen = {}
    for rt in ("runc", "quark"):
        name, runtime = f"d-{rt}", podman.runtimes[rt]
        podman(["run", "-d", "--name", name, *NET, managers.IMAGE, "sh", "-c", loop], runtime=runtime)
        try:
            deadline = time.monotonic() + 10
            while "started" not in podman(["logs", name], runtime=runtime).stdout and time.monotonic() < deadline:
                time.sleep(0.1)
            got = [podman(["logs", name], runtime=runtime).stdout]
            podman(["pause", name], runtime=runtime)
            got.append(podman(["inspect", "-f", "{{.State.Status}}", name], runtime=runtime).stdout)
            podman(["unpause", name], runtime=runtime)
            podman(["stop", "-t", "5", name], runtime=runtime)
            got.append(podman(["inspect", "-f", "{{.State.ExitCode}} {{.State.Status}}", name], runtime=runtime).stdout)
        finally:
            podman(["rm", "-f", "-t", "0", name], runtime=runtime, check=False)
        seen[rt] = got
    assert seen["quark"] == seen["runc"] == ["started\n", "paused\n", "0 exited\n"], seen


def test_privileged_without_host_devices(podman):
    refused = run(podman, "quark", "--privileged", managers.IMAGE, "true")
    assert refused.returncode != 0 and "privileged_without_host_devices" in refused.stderr, refused.stderr
    assert "containerd's CRI" in refused.stderr and "quark's host config" in refused.stderr
    script = "grep CapEff /proc/self/status; ls /dev | wc -l"
    runc = run(podman, "runc", "--privileged", managers.IMAGE, "sh", "-c", script)
    quark = run(podman, "quark-nohostdev", "--privileged", managers.IMAGE, "sh", "-c", script)
    assert runc.returncode == 0 and quark.returncode == 0, (runc.stderr, quark.stderr)
    # podman lists the host's own capabilities: the same ones reach the container under both
    assert quark.stdout.splitlines()[0] == runc.stdout.splitlines()[0]
    assert int(quark.stdout.splitlines()[1]) < 20 < int(runc.stdout.splitlines()[1]), (quark.stdout, runc.stdout)
