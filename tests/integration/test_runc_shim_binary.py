"""containerd's own runc shim (io.containerd.runc.v2) driving quark as a runc-compatible binary
(`BinaryName`, here `ctr --runc-binary`), as a person who replaces runc would run it.

The runc shim is a child subreaper that waits for the init named in --pid-file; quark hands it the
container's processes and its supervisor learns their exit statuses from pidfds (PIDFD_GET_INFO,
qlib/linux.py; before Linux 6.15 it learns only that they ended: tests/integration/test_caller_reaps.py).
"""
from __future__ import annotations

import os
import sys

import pytest

try:
    from tests.integration import containerd_env as ce
    from tests.integration.test_shim_containerd import exercise_a_running_task, remove, tasks, wait_status
except ImportError:  # pytest put tests/integration itself on sys.path
    import containerd_env as ce
    from test_shim_containerd import exercise_a_running_task, remove, tasks, wait_status

from qlib.procfs import parent_pid

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(ce.skip_reason() is not None, reason=ce.skip_reason() or "")]

QUARK = os.path.join(os.path.dirname(sys.executable), "quark")
R = ("--runtime", "io.containerd.runc.v2", "--runc-binary", QUARK)


@pytest.fixture(scope="module")
def cd(tmp_path_factory):
    d = ce.Containerd()
    try:
        d.start()
        d.ctr("images", "import", str(ce.busybox_image_tar(tmp_path_factory.mktemp("img") / "busybox.tar")))
        yield d
    finally:
        d.close()




def test_run_output_and_exit_code(cd):
    p = cd.ctr("run", "--rm", *R, ce.IMAGE, "rs1", "sh", "-c", "echo hello; echo err >&2; exit 3", check=False)
    assert (p.returncode, p.stdout) == (3, b"hello\n"), p.stderr
    assert b"err" in p.stderr
    assert "rs1" not in tasks(cd)


def test_init_is_the_shims_child_and_runs_under_quark(cd):
    cid = "rs2"
    cd.ctr("run", "-d", *R, ce.IMAGE, cid, "sleep", "100")
    try:
        wait_status(cd, cid, "RUNNING")
        pid = tasks(cd)[cid][0]
        ppid = parent_pid(pid)
        assert os.path.basename(os.readlink(f"/proc/{ppid}/exe")).startswith("containerd-shim-runc")
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        # quark's filter (base policy + trapped socket family) is on the init: runc installs none here
        assert "Seccomp:\t2" in status
        out = cd.ctr("tasks", "exec", "--exec-id", "x", cid, "sh", "-c", "unshare -U true; echo $?").stdout
        assert out == b"1\n"   # new user namespaces are denied by quark's base policy
    finally:
        remove(cd, cid)


def test_exec_ps_pause_metrics_kill_and_exit_status(cd):
    exercise_a_running_task(cd, R, "rs3")


def test_terminal_run(cd):
    p = cd.ctr_tty(f"run --rm -t {' '.join(R)} {ce.IMAGE} rs4 sh -c 'tty; exit 4'")
    assert b"/dev/pts/" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 4


def test_tsor_takes_the_local_path_under_the_runc_shim(cd):
    """Here the runc shim, not the supervisor, is the init's parent: tsord accepts the sandbox
    because the init and the supervisor are children of one runc-compatible manager
    (tsor/identity.py), so TCP between two such containers takes TSoR's local path."""
    from tests.support.testbed import SOCKET_ANNOTATION, Testbed, local_connections
    bed = Testbed(prefix="qrs", octet=222)
    try:
        node = bed.node("a")
        node.start_tsord()
        srv, cli = node.pod("srv"), node.pod("cli")
        tsor = ("--annotation", f"{SOCKET_ANNOTATION}={node.socket}")
        cd.ctr("run", "-d", *R, *tsor, "--with-ns", f"network:{srv.netns_path}", ce.IMAGE, "rs-tsor-srv",
               "httpd", "-f", "-p", "8080", "-h", "/etc")
        wait_status(cd, "rs-tsor-srv", "RUNNING")
        srv.wait_listening(8080)
        before = local_connections(node)
        p = cd.ctr("run", "--rm", *R, *tsor, "--with-ns", f"network:{cli.netns_path}", ce.IMAGE, "rs-tsor-cli",
                   "wget", "-q", "-O", "-", f"http://{srv.ip}:8080/passwd")
        assert p.stdout.startswith(b"root:"), p.stdout + p.stderr
        assert local_connections(node) == before + 1
    finally:
        remove(cd, "rs-tsor-srv")
        remove(cd, "rs-tsor-cli")
        bed.close()
