"""Behaviours quark matches runc 1.1 on, driven through the real CLI: `delete --force` of a missing
id, HOME from the container's passwd, a missing process.cwd, --preserve-fds, and a refused exec
that must leave the caller's stdio to the caller."""
from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import tempfile
import time

import pytest

from tests.integration.conftest import QUARK, edit_config
from tests.integration.test_lifecycle import wait_status

pytestmark = pytest.mark.root

PASSWD_USER = "u:x:1000:1000:a user:/home/u:/bin/sh\n"


def high_pipe() -> tuple[int, int]:
    """A pipe whose ends sit at fd 10 or above, so redirections onto 3..5 cannot clobber them."""
    fds = os.pipe()
    high = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in fds)
    for fd in fds:
        os.close(fd)
    return high


def quark_with_fds(quark, redirections: str, *args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess:
    """`quark ARGS` with the fds a shell's `redirections` (e.g. `3>>F 4<&12 12<&-`) give it; its
    stdout and stderr are files, as a detached container keeps them."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.run(["bash", "-c", f'exec "$@" {redirections}', "bash", *QUARK, "--root", quark.root, *args],
                           stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=pass_fds, timeout=60)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())


def read_to_eof(fd: int, timeout: float) -> bytes:
    """Everything written into the pipe `fd` reads from until EOF; fails if EOF does not come."""
    data, deadline = b"", time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no EOF within {timeout}s: someone still holds the write end (read so far: {data!r})"
        chunk = os.read(fd, 4096)
        if not chunk:
            return data
        data += chunk


# ---- delete --force ---------------------------------------------------------------------------

def test_delete_force_of_a_missing_container_succeeds(quark):
    r = quark("delete", "--force", "nosuch", check=False)
    assert (r.returncode, r.stderr) == (0, "")
    r = quark("delete", "nosuch", check=False)
    assert r.returncode == 1 and "container 'nosuch' does not exist" in r.stderr


# ---- HOME ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("uid, env_home, expected", [
    (0, None, "/root"),            # busybox's passwd: root's home
    (1000, None, "/home/u"),
    (4321, None, "/"),             # no entry for the uid
    (1000, "/custom", "/custom"),  # the spec's own HOME is kept
])
def test_init_home_comes_from_the_containers_passwd(quark, bundle, uid, env_home, expected):
    b = bundle(["sh", "-c", "echo HOME=$HOME"])
    with open(os.path.join(b, "rootfs/etc/passwd"), "a") as f:
        f.write(PASSWD_USER)

    def edit(s):
        s["process"]["user"] = {"uid": uid, "gid": uid}
        if env_home is not None:
            s["process"]["env"].append(f"HOME={env_home}")
    edit_config(b, edit)
    r = quark("run", "--bundle", b, "home")
    assert r.stdout == f"HOME={expected}\n"


def test_exec_home_comes_from_the_containers_passwd(quark, bundle, tmp_path):
    b = bundle(["sleep", "100"])
    with open(os.path.join(b, "rootfs/etc/passwd"), "a") as f:
        f.write(PASSWD_USER)
    quark("run", "-d", "--bundle", b, "eh")
    wait_status(quark, "eh", "running")
    show = ["sh", "-c", "echo HOME=$HOME"]
    assert quark("exec", "eh", *show).stdout == "HOME=/root\n"
    assert quark("exec", "-u", "1000", "eh", *show).stdout == "HOME=/home/u\n"
    assert quark("exec", "-u", "4321:4321", "eh", *show).stdout == "HOME=/\n"
    assert quark("exec", "-u", "1000", "-e", "HOME=/x", "eh", *show).stdout == "HOME=/x\n"
    (tmp_path / "p.json").write_text(json.dumps({"args": show, "cwd": "/", "env": ["PATH=/bin"],
                                                 "user": {"uid": 1000, "gid": 1000}}))
    assert quark("exec", "--process", str(tmp_path / "p.json"), "eh").stdout == "HOME=/home/u\n"


# ---- process.cwd --------------------------------------------------------------------------------

def test_missing_cwd_is_created_for_the_init_on_a_readonly_root(quark, bundle):
    b = bundle(["sh", "-c", "pwd; id -u"], readonly=True)
    edit_config(b, lambda s: s["process"].update(cwd="/work/new/dir", user={"uid": 1000, "gid": 1000}))
    r = quark("run", "--bundle", b, "cwd1")
    assert r.stdout.splitlines() == ["/work/new/dir", "1000"]
    st = os.stat(os.path.join(b, "rootfs/work/new/dir"))
    assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o755), "made by the runtime's root with 0755, as runc"


def test_missing_cwd_under_a_symlink_is_created_inside_the_rootfs(quark, bundle, tmp_path):
    outside = tmp_path / "outside"
    b = bundle(["pwd"])
    os.symlink(str(outside), os.path.join(b, "rootfs/link"))   # absolute: means the rootfs's own path
    edit_config(b, lambda s: s["process"].update(cwd="/link/sub"))
    r = quark("run", "--bundle", b, "cwd2")
    assert r.stdout == f"{outside}/sub\n"   # the symlink resolved in the container's root
    assert os.path.isdir(os.path.join(b, "rootfs", str(outside).lstrip("/"), "sub"))
    assert not outside.exists(), "the cwd was created outside the container's root"


def test_missing_cwd_through_a_proc_magic_link_is_not_created(quark, bundle, tmp_path):
    host_dir = tmp_path / "hostdir"
    host_dir.mkdir()
    b = bundle(["pwd"])
    edit_config(b, lambda s: s["process"].update(cwd="/proc/self/fd/3/sub"))
    r = quark_with_fds(quark, f"3<{host_dir}", "run", "--preserve-fds", "1", "--bundle", b, "cwd4")
    assert r.returncode == 1 and "process.cwd: /proc/self/fd/3/sub" in r.stderr
    assert list(host_dir.iterdir()) == []
    made = [d for d, _, _ in os.walk(os.path.join(b, "rootfs")) if d.endswith("/sub")]
    assert made == [], "the magic link's target was created inside the rootfs"


def test_exec_cwd_must_exist_as_with_runc(quark, bundle):
    b = bundle(["sleep", "100"])
    quark("run", "-d", "--bundle", b, "cwd3")
    wait_status(quark, "cwd3", "running")
    r = quark("exec", "--cwd", "/no/such/dir", "cwd3", "true", check=False)
    assert r.returncode == 1 and "process.cwd: /no/such/dir" in r.stderr
    assert not os.path.exists(os.path.join(b, "rootfs/no"))


# ---- --preserve-fds -----------------------------------------------------------------------------

FD_REPORT = "echo to-fd3 >&3; cat <&4; test -e /proc/self/fd/5 && echo fd5-open || echo fd5-closed"


def test_run_preserve_fds_passes_exactly_those_fds(quark, bundle, tmp_path):
    out, other = tmp_path / "fd3", tmp_path / "fd5"
    other.write_text("not for the container\n")
    r_end, w_end = high_pipe()
    os.write(w_end, b"from-caller\n")
    os.close(w_end)
    try:
        r = quark_with_fds(quark, f'3>>{out} 4<&{r_end} {r_end}<&- 5<{other}',
                           "run", "--preserve-fds", "2", "--bundle", bundle(["sh", "-c", FD_REPORT]), "pf1",
                           pass_fds=(r_end,))
    finally:
        os.close(r_end)
    assert (r.returncode, r.stdout) == (0, "from-caller\nfd5-closed\n"), r.stderr
    assert out.read_text() == "to-fd3\n"


def test_preserved_fds_are_held_by_the_container_only(quark, bundle):
    r_end, w_end = high_pipe()
    try:
        b = bundle(["sh", "-c", "echo hi >&3; exec 3>&-; exec sleep 100"])
        r = quark_with_fds(quark, f"3>&{w_end} {w_end}>&-", "run", "-d", "--preserve-fds", "1", "--bundle", b, "pf2",
                           pass_fds=(w_end,))
        assert r.returncode == 0, r.stderr
        os.close(w_end)
        w_end = -1
        # the container closed its copy: neither quark, the supervisor nor stage 1 may hold one
        assert read_to_eof(r_end, timeout=10) == b"hi\n"
        assert quark.state("pf2")["status"] == "running"
    finally:
        os.close(r_end)
        if w_end >= 0:
            os.close(w_end)


def test_create_preserve_fds_needs_them_open(quark, bundle):
    b = bundle(["true"])
    r = quark_with_fds(quark, "3</dev/null 4<&-", "create", "--preserve-fds", "2", "--bundle", b, "pf3")
    assert r.returncode == 1 and "--preserve-fds 2: fd 4 is not open" in r.stderr
    r = quark("create", "--preserve-fds", "-1", "--bundle", b, "pf3", check=False)
    assert r.returncode == 1 and "must not be negative" in r.stderr
    assert quark.ids() == []


def test_exec_preserve_fds(quark, bundle, tmp_path):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "pf4")
    wait_status(quark, "pf4", "running")
    out, other = tmp_path / "fd3", tmp_path / "fd5"
    other.write_text("not for the container\n")
    r_end, w_end = high_pipe()
    os.write(w_end, b"from-caller\n")
    os.close(w_end)
    try:
        r = quark_with_fds(quark, f'3>>{out} 4<&{r_end} {r_end}<&- 5<{other}',
                           "exec", "--preserve-fds", "2", "pf4", "sh", "-c", FD_REPORT, pass_fds=(r_end,))
    finally:
        os.close(r_end)
    assert (r.returncode, r.stdout) == (0, "from-caller\nfd5-closed\n"), r.stderr
    assert out.read_text() == "to-fd3\n"


# ---- a refused exec -----------------------------------------------------------------------------

def _refused_exec(quark, *args: str) -> tuple[int, str]:
    """`quark exec ARGS` with stdout and stderr pipes read to EOF: they must close when quark exits."""
    p = subprocess.Popen(QUARK + ["--root", quark.root, "exec", *args], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"exec {args}: its stdout/stderr never reached EOF (quark exited: {p.returncode is not None})")
    return p.returncode, err


def test_refused_exec_leaves_the_callers_stdio(quark, bundle, tmp_path):
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), "rx")
    wait_status(quark, "rx", "running")
    (tmp_path / "bad.json").write_text(json.dumps({"args": ["true"], "cwd": "relative"}))
    for args, says in ((["-c", "CAP_NOPE"], "CAP_NOPE"),                       # refused by the supervisor
                       (["--process", str(tmp_path / "bad.json")], "process.cwd"),
                       (["-c", "CAP_SYS_MODULE"], "process.capabilities"),     # refused in the container
                       (["-u", "nobody"], "--user nobody: must be UID[:GID]"),  # refused by the CLI
                       (["--cwd", "/no/such/dir"], "process.cwd")):
        rc, err = _refused_exec(quark, *args, "rx", "true")
        assert rc == 1 and says in err and "Traceback" not in err, (args, err)
    quark("kill", "rx", "KILL")
    wait_status(quark, "rx", "stopped")
    rc, err = _refused_exec(quark, "rx", "true")
    assert rc == 1 and "stopped" in err


def test_state_during_create_errors_until_created_as_runc(quark, bundle, tmp_path):
    # a tool that starts `create` and polls `state` until it answers must read "created" (runc's
    # state errors until its create is done); quark answered "creating" and the tool gave up
    hook = tmp_path / "slow.sh"
    hook.write_text("#!/bin/sh\ncat > /dev/null\nsleep 1\n")
    hook.chmod(0o755)
    b = bundle(["sleep", "30"])
    edit_config(b, lambda s: s.__setitem__("hooks", {"createRuntime": [{"path": str(hook)}]}))
    create = subprocess.Popen(QUARK + ["--root", quark.root, "create", "--bundle", b, "polled"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    answers = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = quark("state", "polled", check=False)
            if r.returncode == 0:
                answers.append(json.loads(r.stdout)["status"])
                break
            assert "does not exist" in r.stderr, r.stderr
            answers.append("error")
        assert create.wait(30) == 0
    finally:
        if create.poll() is None:
            create.kill()
            create.wait()
    assert answers[-1] == "created" and "creating" not in answers, answers
    assert "error" in answers   # it was polled while the create ran
    quark("delete", "--force", "polled")
