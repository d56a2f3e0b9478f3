"""qvisor.cgroups against the host's real cgroups (root), plus the pure v2 conversions."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from types import SimpleNamespace as NS

import pytest

from qvisor import cgroups
from qvisor.cgroups import v2
from qvisor.cgroups.v2 import V2Cgroup
from qvisor.errors import SetupError, Unsupported

HOST = cgroups.detect()
MiB = 1 << 20


def needs_root(fn):
    return pytest.mark.root(pytest.mark.skipif(os.geteuid() != 0, reason="real cgroups need root")(fn))


v1_only = pytest.mark.skipif(HOST != "v1", reason="host uses cgroup v2")
v2_only = pytest.mark.skipif(HOST != "v2", reason="host uses cgroup v1")

# Waits on stdin so the test can move it into the cgroup before it acts, then runs `code`.
WAIT_THEN = "import os, sys\nsys.stdin.readline()\n"


def resources(memory=None, cpu=None, pids_limit=None, devices=None) -> NS:
    return NS(memory=memory, cpu=cpu, pids_limit=pids_limit, devices=devices or [])


@pytest.fixture
def sandbox():
    """Makes cgroups and processes; the finalizer removes them all, even after a failure."""
    made: list[cgroups.Cgroup] = []
    procs: list[subprocess.Popen] = []

    class Sandbox:
        def cgroup(self, root: str | None = None) -> cgroups.Cgroup:
            path = f"/quark-test-{uuid.uuid4().hex[:12]}"  # one level, so destroy() leaves nothing
            cg = V2Cgroup(path, root) if root else cgroups.open_cgroup(path)
            made.append(cg)
            cg.create()
            return cg

        def spawn(self, argv: list[str], cg: cgroups.Cgroup) -> subprocess.Popen:
            p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            cg.add_pid(p.pid)
            return p

    yield Sandbox()
    for cg in made:
        with contextlib.suppress(Exception):
            cg.thaw()  # a frozen process would never see the kill
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)
        for pipe in (p.stdin, p.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
    for cg in made:
        if cg.exists():
            cg.kill_all(signal.SIGKILL)  # grandchildren our helpers forked
            cg.destroy()


# Pure conversions: no root needed.

def test_v2_conversions() -> None:
    assert [v2.shares_to_weight(s) for s in (0, 2, 1024, 262144)] == [0, 1, 39, 10000]
    assert v2.cpu_max(None, None) is None and v2.cpu_max(25000, None) == "25000 100000"
    assert v2.cpu_max(50000, 100000) == "50000 100000" and v2.cpu_max(-1, 20000) == "max 20000"
    assert [v2.swap_max(s, 256) for s in (None, -1, 512)] == [None, "max", "256"]
    with pytest.raises(SetupError):
        v2.swap_max(100, 256)  # memory+swap below memory


def test_paths() -> None:
    assert cgroups.default_path("abc") == "/quark/abc"
    assert cgroups.open_cgroup("abc", "v1").path == "/quark/abc"
    assert cgroups.open_cgroup("/x/y/", "v2").path == "/x/y"
    with pytest.raises(SetupError):
        cgroups.open_cgroup("../escape", "v1")


# Real cgroups.

@needs_root
def test_apply_reads_back(sandbox) -> None:
    cg = sandbox.cgroup()
    cg.apply(resources(memory=NS(limit=256 * MiB, reservation=128 * MiB, swap=None),
                       cpu=NS(shares=512, quota=50000, period=100000, cpus="", mems=""),
                       pids_limit=20))

    def read(controller: str, name: str) -> str:
        return cgroups.read(cg.dirs()[0] if HOST == "v2" else cg.mounts[controller] + cg.path, name)

    if HOST == "v1":
        assert read("memory", "memory.limit_in_bytes") == str(256 * MiB)
        assert read("memory", "memory.soft_limit_in_bytes") == str(128 * MiB)
        assert read("cpu", "cpu.shares") == "512"
        assert read("cpu", "cpu.cfs_quota_us") == "50000"
        assert read("cpu", "cpu.cfs_period_us") == "100000"
        assert read("cpuset", "cpuset.cpus") != ""  # inherited so processes can join
    else:
        assert read("", "memory.max") == str(256 * MiB)
        assert read("", "cpu.weight") == str(v2.shares_to_weight(512))
        assert read("", "cpu.max") == "50000 100000"
    assert read("pids", "pids.max") == "20"
    assert cg.memory_limit() == 256 * MiB
    assert cg.stats()["memory_limit"] == 256 * MiB


@needs_root
def test_rejected_value_names_file(sandbox) -> None:
    cg = sandbox.cgroup()
    with pytest.raises(SetupError, match="cpu.cfs_quota_us" if HOST == "v1" else "cpu.max"):
        cg.apply(resources(cpu=NS(shares=None, quota=1, period=None, cpus="", mems="")))


@needs_root
def test_pids_freeze_kill_destroy(sandbox) -> None:
    cg = sandbox.cgroup()
    a = sandbox.spawn(["sleep", "30"], cg)
    b = sandbox.spawn(["sleep", "30"], cg)
    assert cg.pids() == sorted([a.pid, b.pid])
    assert cg.stats()["pids_current"] in (2, None)
    cg.freeze()
    assert cg.frozen()
    assert open(f"/proc/{a.pid}/stat").read().split()[2] in "DTt"  # stopped-ish, not S
    cg.thaw()
    assert not cg.frozen()
    cg.kill_all(signal.SIGKILL)
    assert a.wait(timeout=5) == -signal.SIGKILL and b.wait(timeout=5) == -signal.SIGKILL
    assert cg.pids() == []
    cg.destroy()
    assert not cg.exists() and not any(os.path.exists(d) for d in cg.dirs())
    cg.destroy()  # idempotent


@needs_root
def test_pids_limit_enforced(sandbox) -> None:
    cg = sandbox.cgroup()
    cg.apply(resources(pids_limit=4))
    # Forks until refused, reports how many it got, then reaps them once stdin closes.
    code = WAIT_THEN + (
        "kids = []\n"
        "while len(kids) < 10:\n"
        "    try: pid = os.fork()\n"
        "    except BlockingIOError: break\n"
        "    if pid == 0: sys.stdin.read(); os._exit(0)\n"
        "    kids.append(pid)\n"
        "print(len(kids), flush=True)\n"
        "sys.stdin.read()\n"
        "for k in kids: os.waitpid(k, 0)\n")
    p = sandbox.spawn([sys.executable, "-c", code], cg)
    p.stdin.write("go\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "3"  # the helper itself is the 4th
    p.stdin.close()
    assert p.wait(timeout=10) == 0


@needs_root
@v1_only
def test_v1_devices(sandbox) -> None:
    cg = sandbox.cgroup()
    cg.apply(resources(devices=[NS(allow=False, type="a", major=None, minor=None, access="rwm"),
                                NS(allow=True, type="c", major=1, minor=3, access="rwm")]))
    code = WAIT_THEN + (
        "for dev in ('/dev/null', '/dev/zero'):\n"
        "    try: os.close(os.open(dev, os.O_RDONLY)); print(dev, 'ok')\n"
        "    except PermissionError: print(dev, 'denied')\n")
    p = sandbox.spawn([sys.executable, "-c", code], cg)
    out, _ = p.communicate("go\n", timeout=10)
    assert out.split("\n")[:2] == ["/dev/null ok", "/dev/zero denied"]


@needs_root
@v2_only
def test_v2_devices_unsupported(sandbox) -> None:
    cg = sandbox.cgroup()
    with pytest.raises(Unsupported):
        cg.apply(resources(devices=[NS(allow=False, type="a", major=None, minor=None, access="rwm")]))


def _cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return left.split()[4]
    return None


@needs_root
@pytest.mark.skipif(_cgroup2_mount() is None, reason="no cgroup2 mount on this host")
def test_v2_core_on_unified_mount(sandbox) -> None:
    """The v2 code paths that need no controllers (procs, freeze, cpu.stat) run on any
    cgroup2 mount, including a hybrid host's /sys/fs/cgroup/unified."""
    cg = sandbox.cgroup(root=_cgroup2_mount())
    p = sandbox.spawn(["sleep", "30"], cg)
    assert cg.pids() == [p.pid]
    cg.freeze()
    assert cg.frozen()
    cg.thaw()
    assert isinstance(cg.stats()["cpu_usage_ns"], int)
    cg.kill_all(signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL
    cg.destroy()
    assert not cg.exists()
