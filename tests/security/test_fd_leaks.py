"""CVE-2024-21626 class: no fd of the runtime reaches the container.

runc < 1.1.12 leaked an fd of the host's /sys/fs/cgroup into `runc init`; a config with
process.cwd = /proc/self/fd/7 (or a program path through /proc/self/fd/7/..) then ran the
container's process in the host's filesystem. Here:

* the fd table of each runtime's process that waits in a created container, and of the init and an
  exec'd process once running, is read from the host (/proc/PID/fd) and from inside;
* process.cwd and the program path go through /proc/self/fd/N for every N a runtime could hold,
  for the init (`run`) and for exec'd processes (`exec --cwd`).
"""
from __future__ import annotations

import os
import stat

import pytest

from tests.security.conftest import edit_config, init_pid, record, runtime_name, uid

pytestmark = pytest.mark.root

FDS = range(3, 13)   # runc's leaked cgroup fd was 7 or 8; quark's processes hold fewer than 10
ESCAPE_MARK = "escaped-to-host"


def fd_table(pid: int) -> dict[int, tuple[str, int]]:
    """fd -> (link target, st_mode) as the host sees it."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        p = f"/proc/{pid}/fd/{name}"
        try:
            out[int(name)] = (os.readlink(p), os.stat(p).st_mode)
        except FileNotFoundError:
            continue
    return out


def test_created_container_process_holds_no_runtime_fd(cli, bundle):
    """The runtime's process parked in a created container (quark: the init before its execve)."""
    rt = runtime_name(cli)
    b = bundle(["sleep", "100"])
    cid = uid("fdcreated")
    cli("create", "--bundle", b, cid)
    fds = {fd: v for fd, v in fd_table(init_pid(cli, cid)).items() if fd > 2}
    dirs = {fd: t for fd, (t, mode) in fds.items() if stat.S_ISDIR(mode)}
    assert dirs == {}, f"directory fds are the CVE-2024-21626 primitive: {dirs}"
    if rt == "quark":
        # only its channel to the supervisor (a socketpair), which execve closes
        assert [t for t, _ in fds.values() if not t.startswith("socket:")] == [], fds
        assert len(fds) <= 1, fds
    record("CVE-2024-21626 fds of the created process", rt,
           "no directory fd; beyond stdio: " + (", ".join(sorted(t for t, _ in fds.values())) or "nothing"))
    cli("delete", "--force", cid)


def test_running_processes_hold_only_stdio(cli, bundle, tmp_path):
    rt = runtime_name(cli)
    b = bundle(["sleep", "100"])
    cid = uid("fdrun")
    cli("run", "-d", "--bundle", b, cid)
    pidfile = str(tmp_path / "exec.pid")
    cli("exec", "-d", "--pid-file", pidfile, cid, "sleep", "100")
    with open(pidfile) as f:
        exec_pid = int(f.read())
    for pid in (init_pid(cli, cid), exec_pid):
        assert sorted(fd_table(pid)) == [0, 1, 2], (pid, fd_table(pid))
    # and from inside: the init and the exec'd process, as the container's root sees them
    with open(f"/proc/{exec_pid}/status") as f:
        inner = next(ln for ln in f if ln.startswith("NSpid:")).split()[-1]
    r = cli("exec", cid, "sh", "-c", f"ls /proc/1/fd; echo -; ls /proc/{inner}/fd")
    assert r.stdout.split() == ["0", "1", "2", "-", "0", "1", "2"], r.stdout
    record("CVE-2024-21626 fds of init and exec'd process", rt, "0, 1, 2 only (host and inside)")
    cli("delete", "--force", cid)


def _escaped_cwd_script() -> list[str]:
    # inside the container's root, '..' of '/' is '/': after climbing, '.' is still '/'. A cwd in
    # the host's tree climbs to the host's '/', a different directory.
    return ["sh", "-c", f"cd ../../../../../../../../..; [ \"$(stat -c %d:%i .)\" = \"$(stat -c %d:%i /)\" ] "
                        f"|| echo {ESCAPE_MARK}"]


def test_cwd_through_proc_self_fd_stays_in_the_container(cli, bundle):
    rt = runtime_name(cli)
    refused = started = 0
    for n in FDS:
        b = bundle(_escaped_cwd_script())
        edit_config(b, lambda s: s["process"].__setitem__("cwd", f"/proc/self/fd/{n}"))
        r = cli("run", "--bundle", b, uid("cwd"), check=False)
        assert ESCAPE_MARK not in r.stdout, f"process.cwd=/proc/self/fd/{n} reached the host: {r.stdout}"
        assert "Traceback" not in r.stderr
        if r.returncode == 0:
            started += 1
        else:
            refused += 1
            if rt == "quark":
                assert "process.cwd" in r.stderr, r.stderr
    # exec'd processes: --cwd on a running container
    cid = uid("cwdexec")
    cli("run", "-d", "--bundle", bundle(["sleep", "100"]), cid)
    for n in FDS:
        r = cli("exec", "--cwd", f"/proc/self/fd/{n}", cid, *_escaped_cwd_script(), check=False)
        assert ESCAPE_MARK not in r.stdout, f"exec --cwd /proc/self/fd/{n} reached the host: {r.stdout}"
        assert "Traceback" not in r.stderr
        started, refused = (started + 1, refused) if r.returncode == 0 else (started, refused + 1)
    cli("delete", "--force", cid)
    record("CVE-2024-21626 process.cwd=/proc/self/fd/N", rt,
           f"N={FDS.start}..{FDS.stop - 1}, run and exec: {refused} refused, {started} started inside the root, 0 escaped")


def _dir_fd_at_execve(r) -> bool:
    """execve("/proc/self/fd/N/.") fails EACCES only if fd N is a directory (ENOENT: not open,
    ENOTDIR: not a directory): a directory fd at execve time is what lets a program path such as
    /proc/self/fd/N/../../bin/sh run a host binary."""
    return "permission denied" in r.stderr.lower()


def test_program_path_through_proc_self_fd_stays_in_the_container(cli, bundle):
    """args[0] is resolved by execve while the runtime's fds are still open (close-on-exec acts
    after the lookup): no fd may be a directory then, for the init or an exec'd process."""
    rt = runtime_name(cli)
    errors = set()
    for n in FDS:
        r = cli("run", "--bundle", bundle([f"/proc/self/fd/{n}/."]), uid("args"), check=False)
        assert r.returncode != 0 and not _dir_fd_at_execve(r), (n, r.stderr)
        assert "Traceback" not in r.stderr
        errors.add(r.stderr.strip().rsplit(":", 1)[-1].strip().strip('"').lower())
    cid = uid("argsexec")
    cli("run", "-d", "--bundle", bundle(["sleep", "100"]), cid)
    for n in FDS:
        r = cli("exec", cid, f"/proc/self/fd/{n}/.", check=False)
        assert r.returncode != 0 and not _dir_fd_at_execve(r), (n, r.stderr)
        assert "Traceback" not in r.stderr
    cli("delete", "--force", cid)
    record("CVE-2024-21626 args[0]=/proc/self/fd/N/.", rt,
           f"N={FDS.start}..{FDS.stop - 1}, run and exec: no directory fd at execve ({'; '.join(sorted(errors))})")
