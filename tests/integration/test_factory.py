"""The sandbox factory (qvisor/factory/) and the C front end (qvisor/frontend.c): verbs run in a
forked, pre-imported worker that takes on the caller's stdio, cwd, environment, rlimits and (for
create) cgroups; supervisors share the factory's pages; anything the factory must not do for the
caller falls back to the Python CLI, with the same result."""
from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from qlib import cgroupfs
from qlib.procfs import parent_pid, smaps_rollup
from qvisor.factory import client, programs, server, wire
from tests.integration.test_lifecycle import wait_status

REPO = Path(__file__).resolve().parents[2]
FRONT_END = str(REPO / "qvisor" / "_quark")
QUARK_PY = os.path.join(os.path.dirname(sys.executable), "quark")


@pytest.fixture
def served(tmp_path, quark):
    """A factory of this test's own: (directory, its Popen, env for clients)."""
    assert os.access(FRONT_END, os.X_OK), "the front end is built by `make install` (make frontend)"
    where = str(tmp_path / "factory")
    proc = subprocess.Popen([sys.executable, "-m", "qvisor.factory", "--dir", where, "--idle", "120"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "factory.log", "w"))
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(where, wire.SOCK_NAME)) and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "factory.log").read_text()
        time.sleep(0.05)
    env = dict(os.environ, QUARK_FACTORY_DIR=where, QUARK_FACTORY="1")
    yield where, proc, env
    client.stop(where)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _log(tmp_path) -> str:
    return (tmp_path / "factory.log").read_text()


def _run(env, *args, cwd=None, argv0=(FRONT_END,), **kw) -> subprocess.CompletedProcess:
    # files, not pipes: a created container keeps the stdio it was given
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.run([*argv0, *args], env=env, stdout=out, stderr=err, timeout=60, cwd=cwd,
                           stdin=subprocess.DEVNULL, **kw)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())


def _fd_kinds(pid: int) -> list[str]:
    """The targets of a process's fds, with inode numbers and per-container paths left out."""
    kinds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        kinds.append(target.split(":[")[0] if ":[" in target else os.path.basename(target))
    return sorted(kinds)


def _supervisor(root: str, cid: str) -> int:
    with open(os.path.join(root, cid, "state.json")) as f:
        return json.load(f)["supervisor_pid"]


def _own_cgroup(tmp_path) -> str:
    """A cgroup made for this test (v2: unified; v1: the pids hierarchy): its path as
    /proc/PID/cgroup shows it."""
    name = f"quark-test-factory-{uuid.uuid4().hex[:8]}"
    base = "/sys/fs/cgroup" if cgroupfs.unified() else "/sys/fs/cgroup/pids"
    os.mkdir(os.path.join(base, name))
    return os.path.join(base, name)


def test_a_create_runs_in_a_worker_and_its_supervisor_shares_the_factorys_pages(served, quark, bundle, tmp_path):
    where, proc, env = served
    b = bundle(["sleep", "100"])
    r = _run(env, "--root", quark.root, "create", "--bundle", b, "f1")
    assert r.returncode == 0, r.stderr + _log(tmp_path)
    assert _run(env, "--root", quark.root, "start", "f1").returncode == 0
    sup = _supervisor(quark.root, "f1")
    # its own process and session, named for its container in ps, not the factory's
    assert sup != proc.pid and os.getsid(sup) not in (os.getsid(proc.pid), os.getsid(0))
    with open(f"/proc/{sup}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[:5] == [b"quark", b"--root", quark.root.encode(), b"create", b"--bundle"]
    # and it holds nothing of the factory's: no socket, lock file or pipe of its
    factory_fds = {os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")}
    sup_fds = {os.readlink(f"/proc/{sup}/fd/{fd}") for fd in os.listdir(f"/proc/{sup}/fd")}
    assert not {f for f in sup_fds & factory_fds if not f.startswith("/dev/")}, (sup_fds, factory_fds)
    assert not any(f.startswith(where) for f in sup_fds)
    # forked from the pre-imported factory: its interpreter's pages are the factory's, shared
    shared_with_factory = smaps_rollup(sup)["Shared_Dirty"]
    assert shared_with_factory > 2048, smaps_rollup(sup)

    # without the factory (the Python CLI forks it), nothing of the kind is shared
    nf = dict(env, QUARK_FACTORY="0")
    assert _run(nf, "--root", quark.root, "run", "-d", "--bundle", b, "f2").returncode == 0
    assert smaps_rollup(_supervisor(quark.root, "f2"))["Shared_Dirty"] < shared_with_factory / 4
    # and it holds the same kinds of fds as one the CLI forked: nothing of the worker's either
    assert _fd_kinds(sup) == _fd_kinds(_supervisor(quark.root, "f2"))
    assert "declined" not in _log(tmp_path)


def test_a_supervisor_is_forked_ahead_of_its_create_not_by_the_worker_that_ran_it(served, quark, bundle, tmp_path):
    """Each create's supervisor is a seed the factory had forked ahead of it through its zygote (a
    process that only forks seeds, qvisor/factory/seeds.py), and the worker that parsed the command line and
    loaded the spec hands it the container (birth.start) instead of forking it: the pages
    that worker wrote do not stay in the supervisor for the container's life. Without a zygote the
    factory forks the seeds itself."""
    where, proc, env = served
    b = bundle(["sleep", "100"])

    def create(cid: str) -> int:
        r = _run(env, "--root", quark.root, "create", "--bundle", b, cid)
        assert r.returncode == 0, r.stderr + _log(tmp_path)
        return _supervisor(quark.root, cid)

    try:
        sups = [create("s1"), create("s2")]
        zygote = parent_pid(sups[0])
        assert zygote not in (proc.pid, 1) and parent_pid(sups[1]) == zygote and parent_pid(zygote) == proc.pid
        assert _run(env, "--root", quark.root, "start", "s1").returncode == 0
        assert quark.state("s1")["status"] == "running" and quark.state("s2")["status"] == "created"

        os.kill(zygote, signal.SIGKILL)
        create("s3")   # the seed forked before the zygote died
        deadline = time.monotonic() + 10
        while "zygote is gone" not in _log(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert parent_pid(create("s4")) == proc.pid   # a seed the factory forked
        assert _run(env, "--root", quark.root, "start", "s4").returncode == 0
        assert "declined" not in _log(tmp_path)
    finally:
        for cid in ("s1", "s2", "s3", "s4"):
            quark("delete", "--force", cid, check=False)


def test_the_verbs_answer_as_the_cli_does(served, quark, bundle, tmp_path):
    """Same stdout, stderr and exit status through the factory as from the Python CLI."""
    where, _, env = served
    nf = dict(env, QUARK_FACTORY="0")
    b = bundle(["sleep", "100"])
    for e in (env, nf):
        tag = "f" if e is env else "p"
        assert _run(e, "--root", quark.root, "create", "--bundle", b, f"v{tag}").returncode == 0
    for args in (["state", "nope"], ["start", "nope"], ["kill", "nope", "KILL"], ["delete", "nope"],
                 ["kill", "v{}", "NOSUCHSIGNAL"], ["pause", "v{}"], ["create", "--bundle", "/nonexistent", "x"],
                 ["bogus-verb"], ["--version"]):
        got = {}
        for e, tag in ((env, "f"), (nf, "p")):
            a = [x.replace("{}", tag) for x in args]
            r = _run(e, "--root", quark.root, *a)
            got[tag] = (r.returncode, r.stdout.replace(f"v{tag}", "v*"), r.stderr.replace(f"v{tag}", "v*"))
        assert got["f"] == got["p"], args
    assert json.loads(_run(env, "--root", quark.root, "ps", "--format", "json", "vf").stdout) == \
        [quark.state("vf")["pid"]]
    st = json.loads(_run(env, "--root", quark.root, "state", "vf").stdout)
    assert st["status"] == "created" and st["id"] == "vf"
    listed = _run(env, "--root", quark.root, "list", "--format", "json")
    assert {c["id"] for c in json.loads(listed.stdout)} == {"vf", "vp"}
    for tag in "fp":
        assert _run(env, "--root", quark.root, "delete", "--force", f"v{tag}").returncode == 0
    assert quark.ids() == []
    assert "declined" not in _log(tmp_path)


def test_the_worker_takes_on_the_callers_cwd_env_umask_rlimits_and_cgroup(served, quark, bundle, tmp_path):
    where, proc, env = served
    b = bundle(["sleep", "100"])
    cg = _own_cgroup(tmp_path)
    rel = os.path.relpath(b, tmp_path)   # a relative --bundle resolves against the caller's cwd

    def as_caller():
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (4321, 4321))   # the supervisor keeps it
        os.umask(0o027)

    try:
        r = _run(dict(env, QUARK_TEST_MARK="from-the-caller"), "--root", quark.root,
                 "--log", "rel.log", "create", "--bundle", rel, "--pid-file", "init.pid", "w1",
                 cwd=str(tmp_path), preexec_fn=as_caller)
        assert r.returncode == 0, r.stderr + _log(tmp_path)
        sup = _supervisor(quark.root, "w1")
        init = int((tmp_path / "init.pid").read_text())          # the cwd's, not the factory's /
        assert oct((tmp_path / "init.pid").stat().st_mode & 0o777) == oct(0o640)   # the caller's umask
        with open(f"/proc/{sup}/cgroup") as f:
            assert cg.replace("/sys/fs/cgroup/pids", "").replace("/sys/fs/cgroup", "") in f.read()
        with open(f"/proc/{proc.pid}/cgroup") as f:
            assert os.path.basename(cg) not in f.read()   # the factory stayed where it was
        with open(f"/proc/{sup}/environ", "rb") as f:
            assert b"QUARK_TEST_MARK=from-the-caller" in f.read().split(b"\0")
        with open(f"/proc/{sup}/limits") as f:
            assert any(ln.startswith("Max open files") and ln.split()[3:5] == ["4321", "4321"] for ln in f)
        assert init > 0
    finally:
        quark("delete", "--force", "w1", check=False)
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.05)


def test_a_caller_in_another_mount_namespace_is_declined_and_the_cli_runs_the_verb(served, quark, bundle, tmp_path):
    where, _, env = served
    b = bundle(["true"])
    r = _run(env, "--root", quark.root, "create", "--bundle", b, "ns1",
             argv0=("unshare", "--mount", "--propagation", "unchanged", FRONT_END))
    assert r.returncode == 0, r.stderr
    assert quark.state("ns1")["status"] == "created"
    assert "declined: the caller's namespaces" in _log(tmp_path)
    quark("delete", "--force", "ns1")


def test_a_runc_style_manager_above_the_caller_is_declined_so_it_reaps_the_init(served, quark, bundle, tmp_path):
    """conmon (and containerd's runc shim) wait for the init themselves: the supervisor must be
    re-parented to them, which only a create forked from their own child gives. The other verbs
    fork nothing and are served."""
    where, _, env = served
    conmon = tmp_path / "conmon"
    shutil.copy(os.path.realpath(sys.executable), conmon)
    caller = ("import ctypes, os, subprocess, sys\n"
              "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
              f"subprocess.run([{FRONT_END!r}, '--root', {quark.root!r}, 'create', '--bundle', sys.argv[1],"
              " '--pid-file', sys.argv[2], 'cr'], check=True)\n"
              f"subprocess.run([{FRONT_END!r}, '--root', {quark.root!r}, 'start', 'cr'], check=True)\n"
              "_, status = os.waitpid(int(open(sys.argv[2]).read()), 0)\n"
              "print(os.waitstatus_to_exitcode(status), flush=True)\n"
              f"for verb in ('state', 'delete'):\n"
              f"    subprocess.run([{FRONT_END!r}, '--root', {quark.root!r}, verb, 'cr'], check=True,"
              " stdout=subprocess.DEVNULL)\n")
    r = _run(dict(env, PYTHONHOME=sys.base_prefix), "-c", caller, bundle(["sh", "-c", "exit 7"]),
             str(tmp_path / "pid"), argv0=(str(conmon),))
    assert (r.returncode, r.stdout) == (0, "7\n"), r.stderr
    # the create alone: the verbs that fork nothing (state, delete) are the factory's under conmon too
    assert _log(tmp_path).count("declined: a runc-compatible manager") == 1, _log(tmp_path)
    assert "cr" not in quark.ids()


@pytest.mark.parametrize("manager, starts", [("conmon", False), ("containerd-shim-runc-v2", True)])
def test_a_factory_is_started_under_a_runc_shim_but_not_under_conmon(quark, bundle, tmp_path, manager, starts):
    """A factory started from a create under a runc-compatible manager is the manager's child
    until the manager exits. conmon waits for its children before it exits: it outlived its
    container, so none is started there. containerd's runc shim does not wait: docker's next verbs
    (all but create and run) are served by the factory."""
    where = tmp_path / "factory"
    caller = tmp_path / manager
    shutil.copy(os.path.realpath(sys.executable), caller)
    script = ("import ctypes, subprocess, sys\n"
              "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
              f"subprocess.run([{FRONT_END!r}, '--root', {quark.root!r}, 'create', '--bundle', sys.argv[1], 'nf'],"
              " check=True)\n")
    env = dict(os.environ, QUARK_FACTORY_DIR=str(where), QUARK_FACTORY="1", PYTHONHOME=sys.base_prefix)
    try:
        r = _run(env, "-c", script, bundle(["true"]), argv0=(str(caller),))
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + (30 if starts else 1)   # had one been started, it would serve by now
        while not (where / wire.SOCK_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (where / wire.SOCK_NAME).exists() == starts
        quark("delete", "--force", "nf")
    finally:
        client.stop(str(where))


def test_only_root_may_connect(served):
    where, _, _ = served
    path = os.path.join(where, wire.SOCK_NAME)
    assert os.stat(path).st_mode & 0o777 == 0o600
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(path)
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # and a request from a non-root uid (SO_PEERCRED) is declined, whatever the socket's mode
    f = server.Factory(where, 1)
    assert f.refusal(os.getpid(), 1000, ["state", "x"], {}) == "the caller is not root"
    # and only the programs it knows (quark's, and the "quark.factory" entry points: the shim's)
    programs.load()
    assert set(programs.PROGRAMS) == {"quark", "containerd-shim-quark-v1"}
    assert f.refusal(os.getpid(), 0, ["state", "x"], {}, "sh").startswith("not a program the factory runs")
    assert f.refusal(os.getpid(), 0, ["-id", "x"], {}, "containerd-shim-quark-v1") == \
        "not a verb the factory serves"


def test_a_factory_whose_code_changed_declines_and_exits(served, quark, bundle, tmp_path):
    where, proc, env = served
    module = REPO / "qvisor" / "factory" / "server.py"
    st = module.stat()
    os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        r = _run(env, "--root", quark.root, "create", "--bundle", bundle(["true"]), "s1")
        assert r.returncode == 0, r.stderr
        proc.wait(timeout=10)   # it exits; the create above ran in the CLI, which starts a new one
        assert "quark's code changed" in _log(tmp_path)
    finally:
        os.utime(module, ns=(st.st_atime_ns, st.st_mtime_ns))
    quark("delete", "--force", "s1")
    client.stop(where)


def test_an_idle_factory_exits_and_removes_its_socket(tmp_path):
    where = str(tmp_path / "idle")
    p = subprocess.run([sys.executable, "-m", "qvisor.factory", "--dir", where, "--idle", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "idle for" in p.stderr
    assert not os.path.exists(os.path.join(where, wire.SOCK_NAME))
    assert not os.path.exists(os.path.join(where, wire.PID_NAME))


def test_the_host_configuration_sets_how_long_an_idle_factory_stays(tmp_path):
    """factory.idle_seconds in quark's host configuration (a Kubernetes node's DaemonSet sets 0: a
    factory that exited after a quiet spell left the next pod a fresh interpreter's memory for its
    shim and first supervisor): a number of seconds, or 0 for never; a bad value is refused,
    naming the field, and the factory does not start."""
    env = {k: v for k, v in os.environ.items() if k != "QUARK_FACTORY_IDLE"}
    config = tmp_path / "config.yaml"
    env["QUARK_CONFIG"] = str(config)

    def start(name: str) -> tuple[subprocess.Popen, str]:
        where = str(tmp_path / name)
        proc = subprocess.Popen([sys.executable, "-m", "qvisor.factory", "--dir", where], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return proc, where

    config.write_text("factory: {idle_seconds: 0.5}\n")
    proc, _ = start("short")
    assert proc.wait(60) == 0   # (the default, 300 s, would time this out)
    assert "idle for" in proc.stderr.read()
    config.write_text("factory: {idle_seconds: 0}\n")
    proc, where = start("never")
    try:
        time.sleep(3)
        assert proc.poll() is None and os.path.exists(os.path.join(where, wire.SOCK_NAME))
    finally:
        client.stop(where)
        proc.wait(30)
    config.write_text("factory: {idle_seconds: soon}\n")
    proc, where = start("bad")
    assert proc.wait(60) == 1
    assert "factory.idle_seconds: 'soon': expected seconds" in proc.stderr.read()
    assert not os.path.exists(os.path.join(where, wire.SOCK_NAME))


def test_the_first_create_starts_a_factory_and_the_next_one_uses_it(quark, bundle, tmp_path):
    where = str(tmp_path / "ondemand")
    env = dict(os.environ, QUARK_FACTORY_DIR=where, QUARK_FACTORY="1")
    b = bundle(["true"])
    try:
        assert _run(env, "--root", quark.root, "create", "--bundle", b, "d1").returncode == 0
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(where, wire.SOCK_NAME)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.request(["--root", quark.root, "state", "d1"],
                               stdio=(0, os.open(os.devnull, os.O_WRONLY), 2), env=env, where=where) == 0
        assert _run(env, "--root", quark.root, "create", "--bundle", b, "d2").returncode == 0
        with open(f"/proc/{_supervisor(quark.root, 'd2')}/cmdline", "rb") as f:
            assert b"qvisor.factory" not in f.read()
        assert smaps_rollup(_supervisor(quark.root, "d2"))["Shared_Dirty"] > 2048   # forked from the factory
    finally:
        quark("delete", "--force", "d1", check=False)
        quark("delete", "--force", "d2", check=False)
        assert client.stop(where) > 0


def test_quark_factory_0_never_starts_one(quark, bundle, tmp_path):
    where = str(tmp_path / "off")
    env = dict(os.environ, QUARK_FACTORY_DIR=where, QUARK_FACTORY="0")
    assert _run(env, "--root", quark.root, "run", "-d", "--bundle", bundle(["true"]), "o1").returncode == 0
    time.sleep(0.5)
    assert not os.path.exists(os.path.join(where, wire.SOCK_NAME))
    quark("delete", "--force", "o1")


def test_the_wire_format_round_trips_and_rejects_garbage():
    argv, env = ["--root", "/r", "state", "a=b"], {"A": "1", "EMPTY": "", "EQ": "x=y"}
    data = wire.encode_request(argv, env, 0o027)
    assert wire.decode_request(data) == (argv, env, 0o027, "quark")
    shim = wire.encode_request(["-id", "x", "start"], {}, 0o022, "containerd-shim-quark-v1")
    assert wire.decode_request(shim) == (["-id", "x", "start"], {}, 0o022, "containerd-shim-quark-v1")
    for bad in (b"", b"nope\0" + data, data[:-6], data + b"\0extra", wire.MAGIC + b"\0quark\0999",
                wire.MAGIC + b"\0quark\0-1\0x\00\0022"):
        with pytest.raises(ValueError):
            wire.decode_request(bad)


def test_the_shim_creates_through_the_factory_without_a_cli_process(served, quark, bundle, tmp_path, monkeypatch):
    from shim.runtime import Quark, Stdio
    from shim.ttrpc import Code, RpcError
    from tests.integration.conftest import edit_config
    where, _, env = served
    monkeypatch.setenv("QUARK_FACTORY_DIR", where)
    q = Quark(quark.root, binary="/bin/false")   # a `quark create` process would fail: none runs
    null = os.open(os.devnull, os.O_RDWR)
    try:
        b = bundle(["sleep", "100"])
        q.create("sh1", b, str(tmp_path / "sh1.pid"), Stdio(null, null, null), None)
        assert int((tmp_path / "sh1.pid").read_text()) == quark.state("sh1")["pid"]
        assert smaps_rollup(_supervisor(quark.root, "sh1"))["Shared_Dirty"] > 2048   # forked from the factory
        # an error in the worker reaches containerd as its kind's status code, as from the CLI
        bad = bundle(["true"])
        edit_config(bad, lambda c: c["process"].update(cwd="relative"))
        with pytest.raises(RpcError) as e:
            q.create("sh2", bad, str(tmp_path / "sh2.pid"), Stdio(null, null, null), None)
        assert e.value.code == Code.INVALID_ARGUMENT and "process.cwd" in str(e.value)
        assert "declined" not in _log(tmp_path)
    finally:
        os.close(null)
        quark("delete", "--force", "sh1", check=False)


def test_containerds_shim_start_goes_through_the_factory(served, tmp_path, monkeypatch):
    """containerd runs `containerd-shim-quark-v1 ... start` (the front end, by that name): the
    shim's server is forked from a pre-imported worker, and the container runs as before."""
    from tests.integration import containerd_env as ce
    if ce.skip_reason() is not None:
        pytest.skip(ce.skip_reason())
    assert ce.SHIM.startswith(str(REPO / "build" / "bin")), "make frontend links build/bin"
    where, _, _ = served
    monkeypatch.setenv("QUARK_FACTORY_DIR", where)   # containerd, and the shims it runs, inherit it
    cd = ce.Containerd()
    try:
        cd.start()
        cd.ctr("images", "import", str(ce.busybox_image_tar(tmp_path / "busybox.tar")))
        cd.ctr("run", "-d", "--runtime", ce.RUNTIME, ce.IMAGE, "fshim", "sleep", "100")
        deadline = time.monotonic() + 30
        while not cd.shim_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        [shim] = cd.shim_pids()
        with open(f"/proc/{shim}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"containerd-shim-quark-v1"   # named, as ps shows it
        assert smaps_rollup(shim)["Shared_Dirty"] > 2048   # forked from the factory
        out = cd.ctr("tasks", "exec", "--exec-id", "e1", "fshim", "echo", "through-the-factory").stdout.decode()
        assert out.strip() == "through-the-factory"
        assert "declined" not in _log(tmp_path)
    finally:
        cd.close()


def test_quark_phases_records_when_each_step_of_create_and_start_happened(served, quark, bundle, tmp_path):
    """bench/startup.py's breakdown (qvisor/phases.py): one CLOCK_MONOTONIC time per step, in order."""
    where, _, env = served
    record = tmp_path / "phases"
    record.mkdir()
    b = bundle(["sleep", "100"])
    before = time.monotonic()
    r = _run(dict(env, QUARK_PHASES=str(record)), "--root", quark.root, "run", "-d", "--bundle", b, "ph1")
    assert r.returncode == 0, r.stderr
    times = json.loads((record / "ph1.json").read_text())
    order = ["verb", "supervisor", "namespaces", "rootfs", "created", "start", "filter", "exec"]
    assert list(sorted(times, key=times.get)) == order, times
    assert before < times["verb"] and times["exec"] < time.monotonic()
    assert _run(env, "--root", quark.root, "run", "-d", "--bundle", b, "ph2").returncode == 0   # without: nothing
    assert sorted(os.listdir(record)) == ["ph1.json"]
    for cid in ("ph1", "ph2"):
        quark("delete", "--force", cid)


def test_containerds_shim_delete_runs_in_the_factory(served, tmp_path):
    """containerd 1.6 runs `containerd-shim-quark-v1 ... delete` after every shim exit and waits
    for it: the front end hands it to a factory worker (a new spare replaces the one that served)."""
    from shim.pb import shim_pb2
    where, proc, env = served
    spares_before = _children(proc.pid)
    bundle = tmp_path / "shimbundle"
    (bundle / "rootfs").mkdir(parents=True)
    with tempfile.TemporaryFile() as out:
        r = subprocess.run([str(REPO / "build" / "bin" / "containerd-shim-quark-v1"), "-namespace", "ns1",
                            "-id", "gone1", "delete"], cwd=bundle, env=env, stdout=out, stderr=subprocess.PIPE,
                           timeout=60)
        out.seek(0)
        resp = shim_pb2.DeleteResponse.FromString(out.read())
    assert r.returncode == 0, r.stderr
    assert resp.exit_status == 128 + 9 and resp.exited_at.seconds > 0
    deadline = time.monotonic() + 10
    while _children(proc.pid) in (spares_before, []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children(proc.pid) and _children(proc.pid) != spares_before   # its spare served the call
    assert "declined" not in _log(tmp_path)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(x) for x in f.read().split())


def test_a_detached_run_is_served(served, quark, bundle, tmp_path):
    """`run -d` is create + start in one worker (its supervisor forked from the factory, in the
    caller's place)."""
    where, proc, env = served
    b = bundle(["sleep", "100"])
    r = _run(env, "--root", quark.root, "run", "-d", "--bundle", b, "rd")
    assert r.returncode == 0, r.stderr + _log(tmp_path)
    assert quark.state("rd")["status"] == "running"
    assert smaps_rollup(_supervisor(quark.root, "rd"))["Shared_Dirty"] > 2048   # forked from the factory
    with open(f"/proc/{_supervisor(quark.root, 'rd')}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[:4] == [b"quark", b"--root", quark.root.encode(), b"run"]
    assert "declined" not in _log(tmp_path)


def _front_end_run(env, root: str, b: str, cid: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([FRONT_END, "--root", root, "run", "--bundle", b, cid], env=env, **kw)


def _until(what, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := what()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_a_foreground_run_is_served_with_its_stdio_and_exit_status_and_removed(served, quark, bundle, tmp_path):
    """A foreground `run` through the front end runs in a factory worker (its supervisor forked
    from the factory), with the caller's stdin, stdout and stderr, exits with the container's
    status and deletes the container, as the CLI's run does; --keep leaves it stopped."""
    where, proc, env = served
    b = bundle(["sh", "-c", "read line; echo out:$line; echo err >&2; exit 3"])
    p = _front_end_run(env, quark.root, b, "fg", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    assert wait_status(quark, "fg", "running")["status"] == "running", _log(tmp_path)
    assert smaps_rollup(_supervisor(quark.root, "fg"))["Shared_Dirty"] > 2048   # the factory's, not a CLI's
    assert os.readlink(f"/proc/{p.pid}/exe") == os.path.realpath(FRONT_END)   # no Python in the caller's place
    out, err = p.communicate(b"hello\n", timeout=30)
    assert (p.returncode, out, err) == (3, b"out:hello\n", b"err\n")
    assert "fg" not in quark.ids()
    r = _run(env, "--root", quark.root, "run", "--keep", "--bundle", bundle(["sh", "-c", "exit 4"]), "kept")
    assert r.returncode == 4, r.stderr
    assert quark.state("kept")["status"] == "stopped"
    quark("delete", "kept")
    assert "declined" not in _log(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_a_foreground_run_in_the_factory_forwards_the_callers_signals(served, quark, bundle, tmp_path, sig):
    """The signals `quark run` forwards reach the container's process from the front end (through
    the worker, whose pid the front end learns first), and its exit status comes back."""
    where, proc, env = served
    name = signal.Signals(sig).name[3:]
    b = bundle(["sh", "-c", f"trap 'echo got-{name}; exit 42' {name}; echo ready; while :; do sleep 0.05; done"])
    p = _front_end_run(env, quark.root, b, "sig", stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n", _log(tmp_path)   # its trap is set
    p.send_signal(sig)
    out, _ = p.communicate(timeout=10)
    assert (p.returncode, out) == (42, f"got-{name}\n".encode())
    assert "sig" not in quark.ids()
    assert "declined" not in _log(tmp_path)


def test_a_foreground_run_in_the_factory_proxies_its_terminal(served, quark, bundle, tmp_path):
    """With process.terminal and no console socket, the worker takes the pty master and copies it
    to and from the caller's terminal (here a pty of the test's own), as the CLI's run does."""
    where, proc, env = served
    b = bundle(["sh", "-c", "tty; read line; echo got:$line; exit 5"], terminal=True)
    master, slave = pty.openpty()
    p = _front_end_run(env, quark.root, b, "tty", stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 20
    while b"/dev/pts/" not in seen and time.monotonic() < deadline:
        seen += os.read(master, 4096)
    os.write(master, b"typed\r")
    while b"got:typed" not in seen and time.monotonic() < deadline:
        try:
            seen += os.read(master, 4096)
        except OSError:   # EIO: the caller's side closed
            break
    assert p.wait(timeout=10) == 5
    os.close(master)
    assert b"/dev/pts/0" in seen and b"got:typed" in seen, seen
    assert "tty" not in quark.ids()
    assert "declined" not in _log(tmp_path)


def test_a_signal_before_the_container_runs_does_not_cut_the_run_short(served, quark, bundle, tmp_path):
    """A signal `run` forwards that comes while the container is still being made (as soon as its
    state directory exists) neither kills the front end nor the worker half way through a create:
    it waits and goes to the container's process once it has started, as runc's run does. The init
    is `sleep`, pid 1 of its namespace, which a SIGTERM without a handler leaves running; SIGKILL
    through `quark kill` ends it. (A signal before the front end has run a line kills it, as one
    before runc has set up its handler kills runc.)"""
    where, proc, env = served
    p = _front_end_run(env, quark.root, bundle(["sleep", "100"]), "early", stderr=subprocess.PIPE)
    assert _until(lambda: os.path.isdir(os.path.join(quark.root, "early")), timeout=10)
    p.send_signal(signal.SIGTERM)
    assert wait_status(quark, "early", "running")["status"] == "running", _log(tmp_path)
    time.sleep(0.3)
    assert p.poll() is None   # still running its container
    quark("kill", "early", "KILL")
    _, err = p.communicate(timeout=10)
    assert (p.returncode, err) == (128 + signal.SIGKILL, b"")
    assert "early" not in quark.ids()
