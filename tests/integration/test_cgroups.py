"""qvisor.cgroups against the host's real cgroups (root), plus the pure v2 conversions."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from qlib.errors import SetupError, Unsupported
from qvisor import cgroups
from qvisor.cgroups import v2
from qvisor.cgroups.v1 import V1Cgroup
from qvisor.cgroups.v2 import V2Cgroup
from qvisor.spec import THROTTLES, Resources, parse_resources
from tests.integration.conftest import cgroup_dirs, edit_config

HOST = cgroups.detect()
MiB = 1 << 20


def needs_root(fn):
    return pytest.mark.root(pytest.mark.skipif(os.geteuid() != 0, reason="real cgroups need root")(fn))


v1_only = pytest.mark.skipif(HOST != "v1", reason="host uses cgroup v2")
v2_only = pytest.mark.skipif(HOST != "v2", reason="host uses cgroup v1")

# Waits on stdin so the test can move it into the cgroup before it acts, then runs `code`.
WAIT_THEN = "import os, sys\nsys.stdin.readline()\n"


def resources(**oci) -> Resources:
    """A linux.resources object, given as in config.json, validated as quark validates it."""
    return parse_resources(oci, "test")


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
    cg.apply(resources(memory={"limit": 256 * MiB, "reservation": 128 * MiB},
                       cpu={"shares": 512, "quota": 50000, "period": 100000}, pids={"limit": 20}))

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
    assert cg.stats()["memory"]["usage"]["limit"] == 256 * MiB


@needs_root
def test_rejected_value_names_file(sandbox) -> None:
    cg = sandbox.cgroup()
    with pytest.raises(SetupError, match="cpu.cfs_quota_us" if HOST == "v1" else "cpu.max"):
        cg.apply(resources(cpu={"quota": 1}))


@needs_root
def test_kill_steps_never_sleep(sandbox, monkeypatch) -> None:
    """The supervisor kills what its init leaves behind on its event loop: each step returns at
    once and says how long to wait, so a freeze that takes seconds never holds the loop."""
    cg = sandbox.cgroup()
    a = sandbox.spawn(["sleep", "30"], cg)

    def no_sleep(_):
        raise AssertionError("a kill step slept")
    monkeypatch.setattr(cgroups.base.time, "sleep", no_sleep)   # the module's: kill_all's run_steps would call it
    for pause in cg.kill_steps(signal.SIGKILL):
        assert 0 < pause <= 0.1   # the caller's loop waits this long on a timer
    monkeypatch.undo()
    assert a.wait(timeout=5) == -signal.SIGKILL
    assert not cg.frozen()


@needs_root
def test_pids_freeze_kill_destroy(sandbox) -> None:
    cg = sandbox.cgroup()
    a = sandbox.spawn(["sleep", "30"], cg)
    b = sandbox.spawn(["sleep", "30"], cg)
    assert cg.pids() == sorted([a.pid, b.pid])
    assert cg.stats()["pids"]["current"] == 2
    cg.freeze()
    assert cg.frozen()
    if HOST == "v1":   # v1's freezer shows its tasks stopped-ish; v2's sleep in the freezer (S)
        assert open(f"/proc/{a.pid}/stat").read().split()[2] in "DTt"
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
    cg.apply(resources(pids={"limit": 4}))
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
    cg.apply(resources(devices=[{"allow": False}, {"allow": True, "type": "c", "major": 1, "minor": 3}]))
    code = WAIT_THEN + (
        "for dev in ('/dev/null', '/dev/zero'):\n"
        "    try: os.close(os.open(dev, os.O_RDONLY)); print(dev, 'ok')\n"
        "    except PermissionError: print(dev, 'denied')\n")
    p = sandbox.spawn([sys.executable, "-c", code], cg)
    out, _ = p.communicate("go\n", timeout=10)
    assert out.split("\n")[:2] == ["/dev/null ok", "/dev/zero denied"]


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
    assert isinstance(cg.stats()["cpu"]["usage"]["total"], int)
    cg.kill_all(signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL
    cg.destroy()
    assert not cg.exists()


@needs_root
@pytest.mark.skipif(_cgroup2_mount() is None, reason="no cgroup2 mount on this host")
def test_v2_kill_all_with_sigkill_uses_cgroup_kill(sandbox, monkeypatch) -> None:
    """SIGKILL goes through cgroup.kill: no freeze, and processes forked meanwhile die too."""
    cg = sandbox.cgroup(root=_cgroup2_mount())
    p = sandbox.spawn(["sh", "-c", "while :; do sleep 30 & sleep 0.01; done"], cg)
    time.sleep(0.2)
    assert len(cg.pids()) > 2

    def no_freeze() -> bool:
        raise AssertionError("cgroup.kill needs no freeze")
    monkeypatch.setattr(cg, "try_freeze", no_freeze)
    cg.kill_all(signal.SIGKILL)
    assert p.wait(timeout=5) == -signal.SIGKILL
    poll_until = time.monotonic() + 5
    while cg.pids() and time.monotonic() < poll_until:
        time.sleep(0.02)
    assert cg.pids() == []


# ---- every linux.resources field is applied on the host's cgroup version, or refused naming it ----

def _v2_dir(tmp_path, controllers: str, **files: str) -> V2Cgroup:
    """A V2Cgroup over a directory laid out like a v2 cgroup (plain files, `name=content`), to
    check the v2 file mapping on a host without a v2 kernel (`__` in a name stands for a dot)."""
    d = tmp_path / "v2" / "c"
    d.mkdir(parents=True)
    (d / "cgroup.controllers").write_text(controllers)
    for name, content in files.items():
        (d / name.replace("__", ".")).write_text(content)
    return V2Cgroup("/c", str(tmp_path / "v2"))


V2_FILES = dict(memory__max="max", memory__low="0", memory__swap__max="max", memory__current="4096",
                cpu__weight="100", cpu__max="max 100000", cpu__max__burst="0", cpu__idle="0", cpuset__cpus="",
                pids__max="max",
                io__weight="default 100", io__max="", hugetlb__2MB__max="max", hugetlb__2MB__rsvd__max="max",
                rdma__max="", memory__high="max")
V2_ALL = "cpuset cpu io memory hugetlb pids rdma"


def test_v2_file_mapping(tmp_path) -> None:
    cg = _v2_dir(tmp_path, V2_ALL, **V2_FILES)
    cg.apply(resources(
        memory={"limit": 256 * MiB, "swap": 512 * MiB, "reservation": MiB, "checkBeforeUpdate": True,
                "useHierarchy": True, "disableOOMKiller": False},
        cpu={"shares": 1024, "quota": 50000, "burst": 20000, "idle": 1, "cpus": "0"}, pids={"limit": 9},
        blockIO={"weight": 500, "throttleWriteIOPSDevice": [{"major": 8, "minor": 0, "rate": 30}]},
        hugepageLimits=[{"pageSize": "2MB", "limit": 4 * MiB}],
        rdma={"mlx5_0": {"hcaHandles": 3, "hcaObjects": 100}}, unified={"memory.high": "300M"}))
    want = {"memory.max": str(256 * MiB), "memory.swap.max": str(256 * MiB), "memory.low": str(MiB),
            "cpu.weight": "39", "cpu.max": "50000 100000", "cpu.max.burst": "20000", "cpu.idle": "1",
            "cpuset.cpus": "0", "pids.max": "9",
            "io.weight": "4950", "io.max": "8:0 wiops=30", "hugetlb.2MB.max": str(4 * MiB),
            "hugetlb.2MB.rsvd.max": str(4 * MiB), "rdma.max": "mlx5_0 hca_handle=3 hca_object=100",
            "memory.high": "300M"}
    assert {name: cgroups.read(cg.dir, name) for name in want} == want
    assert v2.blkio_to_io_weight(10) == 1 and v2.blkio_to_io_weight(1000) == 10000


def test_v2_bfq_weights(tmp_path) -> None:
    # BFQ's io.bfq.weight, where the host has it, takes the blkio weight as is (runc's choice)
    cg = _v2_dir(tmp_path, V2_ALL, io__bfq__weight="default 100", io__weight="default 100")
    cg.apply(resources(blockIO={"weight": 500}))
    assert cgroups.read(cg.dir, "io.bfq.weight") == "500" and cgroups.read(cg.dir, "io.weight") == "default 100"
    (tmp_path / "v2/c/io.bfq.weight").write_text("default 100")
    cg.apply(resources(blockIO={"weightDevice": [{"major": 8, "minor": 16, "weight": 300}]}))
    assert cgroups.read(cg.dir, "io.bfq.weight") == "8:16 300"
    (tmp_path / "v2/c/io.bfq.weight").write_text("100")  # an older kernel: no per-device weights
    with pytest.raises(Unsupported, match=r"^linux.resources.blockIO.weightDevice\[0\].weight: "):
        cg.apply(resources(blockIO={"weightDevice": [{"major": 8, "minor": 16, "weight": 300}]}))


# (id, linux.resources, cgroup.controllers, the field the refusal names)
V2_REFUSED = [
    ("swappiness", {"memory": {"swappiness": 10}}, V2_ALL, "memory.swappiness"),
    ("oom-killer", {"memory": {"disableOOMKiller": True}}, V2_ALL, "memory.disableOOMKiller"),
    ("non-hierarchical", {"memory": {"useHierarchy": False}}, V2_ALL, "memory.useHierarchy"),
    ("below-usage", {"memory": {"limit": 4096, "checkBeforeUpdate": True}}, V2_ALL, "memory.limit"),
    ("swap-without-limit", {"memory": {"swap": MiB}}, V2_ALL, "memory.swap"),
    ("leaf-weight", {"blockIO": {"leafWeight": 100}}, V2_ALL, "blockIO.leafWeight"),
    ("device-weight-no-bfq", {"blockIO": {"weightDevice": [{"major": 8, "minor": 0, "weight": 100}]}}, V2_ALL,
     "blockIO.weightDevice[0].weight"),
    ("realtime", {"cpu": {"realtimeRuntime": 1000}}, V2_ALL, "cpu.realtimeRuntime"),
    ("net-cls", {"network": {"classID": 1}}, V2_ALL, "network"),
    ("net-prio", {"network": {"priorities": [{"name": "lo", "priority": 1}]}}, V2_ALL, "network"),
    ("no-hugetlb", {"hugepageLimits": [{"pageSize": "2MB", "limit": MiB}]}, "cpu memory pids",
     "hugepageLimits[0]"),
    ("no-rdma", {"rdma": {"mlx5_0": {"hcaHandles": 1}}}, "cpu memory pids", "rdma.mlx5_0"),
    ("no-io", {"blockIO": {"weight": 100}}, "cpu memory pids", "blockIO.weight"),
    ("unified-no-controller", {"unified": {"misc.max": "x 1"}}, "cpu memory pids", "unified.misc.max"),
    ("unified-no-file", {"unified": {"memory.nonsense": "1"}}, V2_ALL, "unified.memory.nonsense"),
]


@pytest.mark.parametrize("oci,controllers,field", [r[1:] for r in V2_REFUSED], ids=[r[0] for r in V2_REFUSED])
def test_v2_refusals_name_the_field_and_write_nothing(tmp_path, oci, controllers, field) -> None:
    cg = _v2_dir(tmp_path, controllers, **V2_FILES)
    with pytest.raises((Unsupported, SetupError), match=f"^linux.resources.{re.escape(field)}: "):
        cg.apply(resources(pids={"limit": 9}, **oci))
    if field != "unified.memory.nonsense":  # a missing file shows only when written, as in runc
        assert cgroups.read(cg.dir, "pids.max") == "max", "refused before the first write"


def test_v2_kernel_memory_is_ignored_with_a_warning(tmp_path, caplog) -> None:
    cg = _v2_dir(tmp_path, V2_ALL, **V2_FILES)
    with caplog.at_level(logging.WARNING, logger="quark"):
        cg.apply(resources(memory={"kernel": 64 * MiB, "kernelTCP": MiB}))
    assert "linux.resources.memory.kernel is ignored" in caplog.text
    assert "linux.resources.memory.kernelTCP is ignored" in caplog.text


def _v1_dirs(tmp_path, **controllers: dict[str, str]) -> V1Cgroup:
    """A V1Cgroup whose hierarchies are plain directories holding the given files."""
    mounts = {}
    for controller, files in controllers.items():
        (tmp_path / controller / "c").mkdir(parents=True)
        for name, content in files.items():
            (tmp_path / controller / "c" / name).write_text(content)
        mounts[controller] = str(tmp_path / controller)
    return V1Cgroup("/c", mounts)


def test_v1_network_file_mapping(tmp_path) -> None:
    # Not on the real kernel: writing net_cls/net_prio disables cgroup2 socket matching host-wide.
    cg = _v1_dirs(tmp_path, net_cls={"net_cls.classid": "0"}, net_prio={"net_prio.ifpriomap": ""})
    cg.apply(resources(network={"classID": 0x100001, "priorities": [{"name": "lo", "priority": 7}]}))
    assert cgroups.read(cg.mounts["net_cls"] + "/c", "net_cls.classid") == str(0x100001)
    assert cgroups.read(cg.mounts["net_prio"] + "/c", "net_prio.ifpriomap") == "lo 7"


def test_v1_setting_the_kernel_lacks_is_refused(tmp_path) -> None:
    # e.g. CONFIG_RT_GROUP_SCHED off: no cpu.rt_* files
    cg = _v1_dirs(tmp_path, cpu={"cpu.shares": "1024"})
    with pytest.raises(Unsupported, match=r"^linux.resources.cpu.realtimeRuntime: not supported on this host: "
                                          r"the kernel has no .*/cpu.rt_runtime_us$"):
        cg.apply(resources(cpu={"realtimeRuntime": 1000}))
    cg = _v1_dirs(tmp_path / "noswap", memory={"memory.limit_in_bytes": "0"})
    with pytest.raises(Unsupported, match=r"^linux.resources.memory.swap: this host does not account swap"):
        cg.apply(resources(memory={"limit": MiB, "swap": 2 * MiB}))
    cg.apply(resources(memory={"limit": MiB, "swap": -1}))  # unlimited is what an unaccounted swap is


def _v1_file(cg: cgroups.Cgroup, controller: str, name: str) -> str:
    return cgroups.read(cg.mounts[controller] + cg.path, name)


@needs_root
@v1_only
def test_v1_memory_settings(sandbox, caplog) -> None:
    cg = sandbox.cgroup()
    with caplog.at_level(logging.WARNING, logger="quark"):
        cg.apply(resources(memory={"limit": 64 * MiB, "swappiness": 17, "disableOOMKiller": True,
                                   "useHierarchy": True, "kernelTCP": 8 * MiB, "kernel": 64 * MiB,
                                   "checkBeforeUpdate": True}))
    assert _v1_file(cg, "memory", "memory.swappiness") == "17"
    assert cgroups.read_kv(cg.mounts["memory"] + cg.path, "memory.oom_control")["oom_kill_disable"] == 1
    assert _v1_file(cg, "memory", "memory.use_hierarchy") == "1"
    assert _v1_file(cg, "memory", "memory.kmem.tcp.limit_in_bytes") == str(8 * MiB)
    assert "linux.resources.memory.kernel is ignored" in caplog.text


@needs_root
@v1_only
def test_v1_non_hierarchical_memory(sandbox) -> None:
    cg = sandbox.cgroup()
    try:
        cg.apply(resources(memory={"useHierarchy": False}))
    except SetupError as e:  # Linux 5.11+ is always hierarchical and says EINVAL
        assert str(e).startswith("linux.resources.memory.useHierarchy: writing 0 to ")
    else:
        assert _v1_file(cg, "memory", "memory.use_hierarchy") == "0"


@needs_root
@v1_only
def test_v1_cpu_settings(sandbox) -> None:
    cg = sandbox.cgroup()
    if not os.path.exists(cg.mounts["cpu"] + cg.path + "/cpu.rt_runtime_us"):
        pytest.skip("this kernel has no real-time group scheduling (CONFIG_RT_GROUP_SCHED)")
    # a top-level test cgroup: the root has the real-time budget to share out
    cg.apply(resources(cpu={"idle": 1, "realtimePeriod": 500000, "realtimeRuntime": 10000}))
    assert _v1_file(cg, "cpu", "cpu.idle") == "1"
    assert _v1_file(cg, "cpu", "cpu.rt_period_us") == "500000"
    assert _v1_file(cg, "cpu", "cpu.rt_runtime_us") == "10000"


def _block_device() -> str:
    """MAJOR:MINOR of a whole disk of this host (throttles take no partitions)."""
    for name in sorted(os.listdir("/sys/block")):
        if not name.startswith(("loop", "ram")):
            return cgroups.read(f"/sys/block/{name}", "dev")
    pytest.skip("no block device")


@needs_root
@v1_only
def test_v1_blkio_throttles(sandbox) -> None:
    dev = _block_device()
    major, minor = map(int, dev.split(":"))
    cg = sandbox.cgroup()
    throttles = {key: [{"major": major, "minor": minor, "rate": rate}]
                 for rate, key in enumerate(THROTTLES, start=1000)}
    cg.apply(resources(blockIO=throttles))
    for rate, name in enumerate(("read_bps", "write_bps", "read_iops", "write_iops"), start=1000):
        assert _v1_file(cg, "blkio", f"blkio.throttle.{name}_device") == f"{dev} {rate}"


@needs_root
@v1_only
def test_v1_blkio_weight(sandbox) -> None:
    cg = sandbox.cgroup()
    d = cg.mounts["blkio"] + cg.path
    name = next((n for n in ("blkio.weight", "blkio.bfq.weight") if os.path.exists(f"{d}/{n}")), None)
    if name is None:  # neither CFQ nor BFQ weights on this host: refused, naming the field
        with pytest.raises(Unsupported, match=r"^linux.resources.blockIO.weight: not supported on this host"):
            cg.apply(resources(blockIO={"weight": 500}))
    else:
        cg.apply(resources(blockIO={"weight": 500}))
        assert cgroups.read(d, name).split()[-1] == "500"
    if not os.path.exists(f"{d}/blkio.leaf_weight"):  # CFQ's, gone since Linux 5.0
        with pytest.raises(Unsupported, match=r"^linux.resources.blockIO.leafWeight: not supported"):
            cg.apply(resources(blockIO={"leafWeight": 500}))


# (controller, linux.resources that need it, the field the refusal names)
V1_NEEDS = [
    ("rdma", {"rdma": {"mlx5_0": {"hcaHandles": 1}}}, "rdma.mlx5_0"),
    ("net_cls", {"network": {"classID": 1}}, "network.classID"),
    ("net_prio", {"network": {"priorities": [{"name": "lo", "priority": 1}]}}, "network.priorities[0]"),
    ("hugetlb", {"hugepageLimits": [{"pageSize": "2MB", "limit": MiB}]}, "hugepageLimits"),
]


@needs_root
@v1_only
@pytest.mark.parametrize("controller,oci,field", V1_NEEDS, ids=[n[0] for n in V1_NEEDS])
def test_v1_absent_controller_is_refused_before_any_write(sandbox, controller, oci, field) -> None:
    cg = sandbox.cgroup()
    if controller in cg.mounts:
        pytest.skip(f"the {controller} controller is mounted on this host")
    with pytest.raises(Unsupported, match=f"^linux.resources.{re.escape(field)}: the {controller} cgroup "
                                          "controller is not available on this host"):
        cg.apply(resources(pids={"limit": 7}, **oci))
    assert _v1_file(cg, "pids", "pids.max") == "max"


@needs_root
@v1_only
def test_v1_refuses_unified(sandbox) -> None:
    cg = sandbox.cgroup()
    with pytest.raises(Unsupported, match="^linux.resources.unified: cannot use unified on cgroup v1$"):
        cg.apply(resources(pids={"limit": 7}, unified={"memory.high": "max"}))
    assert _v1_file(cg, "pids", "pids.max") == "max"
    cg.apply(resources(pids={"limit": 7}, unified={}))  # empty is no setting, as in runc
    assert _v1_file(cg, "pids", "pids.max") == "7"


# Mounts a hugetlb hierarchy of its own in a private mount namespace (unseen by the rest of the
# host), applies hugepageLimits there and prints what the kernel reports.
# ---- through the CLI: config.json at create, and `quark update` ----

def _cid() -> str:
    return f"cg-{uuid.uuid4().hex[:10]}"  # the default cgroup path is /quark/<id>: unique across runs


def _container_file(cid: str, controller: str, name: str) -> str:
    cg = cgroups.open_cgroup(cgroups.default_path(cid))
    return cgroups.read(cg.mounts[controller] + cg.path if HOST == "v1" else cg.dirs()[0], name)


@needs_root
@v1_only
def test_v1_hugetlb_limits(quark, bundle) -> None:
    from qvisor.cgroups.v1 import hierarchies
    if "hugetlb" not in hierarchies():
        # mounting a hierarchy of the test's own would leave it registered in the kernel until
        # reboot, unmounted, which breaks containerd's cgroup lookup for every process after it
        pytest.skip("hugetlb is not mounted on this host (its refusal is tested instead)")
    if not os.path.isdir("/sys/kernel/mm/hugepages/hugepages-2048kB"):
        pytest.skip("this kernel has no 2MB huge pages")
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"]["resources"].update(
        {"hugepageLimits": [{"pageSize": "2MB", "limit": 4 * MiB}]}))
    cid = _cid()
    quark("run", "-d", "--bundle", b, cid)
    assert _container_file(cid, "hugetlb", "hugetlb.2MB.limit_in_bytes") == str(4 * MiB)
    d = cgroups.open_cgroup(cgroups.default_path(cid)).mounts["hugetlb"] + cgroups.default_path(cid)
    if os.path.exists(os.path.join(d, "hugetlb.2MB.rsvd.limit_in_bytes")):   # Linux 5.7+
        assert _container_file(cid, "hugetlb", "hugetlb.2MB.rsvd.limit_in_bytes") == str(4 * MiB)
    quark("delete", "--force", cid)


@needs_root
@v1_only
def test_create_applies_every_field(quark, bundle, tmp_path) -> None:
    dev = _block_device()
    major, minor = map(int, dev.split(":"))
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"]["resources"].update({
        "memory": {"limit": 64 * MiB, "swappiness": 11, "disableOOMKiller": True, "kernel": 64 * MiB},
        "cpu": {"idle": 1, "quota": 50000, "burst": 30000},
        "blockIO": {"throttleReadBpsDevice": [{"major": major, "minor": minor, "rate": 4096}]}}))
    cid, log = _cid(), tmp_path / "quark.log"
    quark("--log", str(log), "run", "-d", "--bundle", b, cid)
    assert _container_file(cid, "memory", "memory.swappiness") == "11"
    assert "oom_kill_disable 1" in _container_file(cid, "memory", "memory.oom_control")
    assert _container_file(cid, "cpu", "cpu.idle") == "1"
    assert _container_file(cid, "cpu", "cpu.cfs_burst_us") == "30000"   # (it was read and dropped)
    assert _container_file(cid, "blkio", "blkio.throttle.read_bps_device") == f"{dev} 4096"
    assert "linux.resources.memory.kernel is ignored" in log.read_text()
    quark("delete", "--force", cid)


# (id, linux.resources that create must refuse, what the error says); the memory limit is written
# before the refusal in the second case, so "nothing left" covers a half-applied cgroup
CREATE_REFUSED = [
    ("absent-controller", {"pids": {"limit": 7}, "rdma": {"mlx5_0": {"hcaHandles": 1}}},
     "linux.resources.rdma.mlx5_0: the rdma cgroup controller is not available on this host"),
    ("kernel-rejects", {"memory": {"limit": 64 * MiB},
                        "blockIO": {"throttleReadBpsDevice": [{"major": 4095, "minor": 4095, "rate": 1}]}},
     "linux.resources.blockIO.throttleReadBpsDevice[0]: writing '4095:4095 1' to "),
]


@needs_root
@v1_only
@pytest.mark.parametrize("oci,error", [c[1:] for c in CREATE_REFUSED], ids=[c[0] for c in CREATE_REFUSED])
def test_create_refusal_leaves_nothing(quark, bundle, oci, error) -> None:
    if "rdma" in oci and "rdma" in cgroups.open_cgroup("/x").mounts:
        pytest.skip("this host has the rdma controller")
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"]["resources"].update(oci))
    cid = _cid()
    r = quark("create", "--bundle", b, cid, check=False)
    assert r.returncode == 1 and f"quark: {error}" in r.stderr
    assert quark.ids() == [] and cgroup_dirs(cgroups.default_path(cid)) == []


@pytest.fixture
def running(quark, bundle):
    """A running container's id."""
    cid = _cid()
    quark("run", "-d", "--bundle", bundle(["sleep", "100"]), cid)
    yield cid
    quark("delete", "--force", cid)


@needs_root
@v1_only
def test_update_takes_runc_flags(quark, running) -> None:
    quark("update", "--memory", "100M", "--memory-swap", "200m", "--memory-reservation", "50MiB",
          "--cpu-shares", "300", "--cpu-period", "50000", "--cpu-quota", "20000", "--cpuset-cpus", "0",
          "--cpuset-mems", "0", "--pids-limit", "50", running)
    want = {("memory", "memory.limit_in_bytes"): str(100 * MiB), ("memory", "memory.memsw.limit_in_bytes"):
            str(200 * MiB), ("memory", "memory.soft_limit_in_bytes"): str(50 * MiB), ("cpu", "cpu.shares"): "300",
            ("cpu", "cpu.cfs_period_us"): "50000", ("cpu", "cpu.cfs_quota_us"): "20000",
            ("cpuset", "cpuset.cpus"): "0", ("cpuset", "cpuset.mems"): "0", ("pids", "pids.max"): "50"}
    assert {k: _container_file(running, *k) for k in want} == want
    # runc's spelling --cpu-share; -1 is unlimited; 0 leaves a setting as it is
    quark("update", "--cpu-share", "400", "--memory-swap", "-1", "--memory", "-1", "--pids-limit", "0", running)
    assert _container_file(running, "cpu", "cpu.shares") == "400"
    assert int(_container_file(running, "memory", "memory.limit_in_bytes")) >= cgroups.base.UNLIMITED
    assert _container_file(running, "pids", "pids.max") == "50"
    r = quark("update", "--kernel-memory", "64M", running)
    assert "linux.resources.memory.kernel is ignored" in r.stderr
    # --cpu-burst and --cpu-idle: 0 is a value there (no burst; not SCHED_IDLE), as runc takes it
    quark("update", "--cpu-burst", "10000", "--cpu-idle", "1", running)
    assert (_container_file(running, "cpu", "cpu.cfs_burst_us"), _container_file(running, "cpu", "cpu.idle")) == \
        ("10000", "1")
    quark("update", "--cpu-burst", "0", "--cpu-idle", "0", running)
    assert (_container_file(running, "cpu", "cpu.cfs_burst_us"), _container_file(running, "cpu", "cpu.idle")) == \
        ("0", "0")


@needs_root
@v1_only
def test_update_flags_override_the_resources_file(quark, running, tmp_path) -> None:
    f = tmp_path / "resources.json"
    f.write_text(json.dumps({"memory": {"limit": 64 * MiB}, "pids": {"limit": 40}}))
    quark("update", "--resources", str(f), "--pids-limit", "30", running)
    assert _container_file(running, "memory", "memory.limit_in_bytes") == str(64 * MiB)
    assert _container_file(running, "pids", "pids.max") == "30"
    with open(f) as stdin:
        quark("update", "-r", "-", running, stdin=stdin)
    assert _container_file(running, "pids", "pids.max") == "40"


@needs_root
@v1_only
def test_update_errors(quark, running, tmp_path) -> None:
    def error(*args: str) -> str:
        r = quark("update", *args, running, check=False)
        assert r.returncode == 1, r
        return r.stderr.strip()
    assert error() == "quark: update: nothing to change: give --resources FILE or a flag such as --memory"
    assert error("--memory", "10X").startswith("quark: --memory: invalid size '10X'")
    assert error("--cpu-quota", "lots") == "quark: --cpu-quota: invalid integer 'lots'"
    assert error("--blkio-weight", "5") == \
        "quark: --blkio-weight: resources.blockIO.weight: must be between 10 and 1000, got 5"
    assert error("--resources", str(tmp_path / "nope.json")) == \
        f"quark: --resources {tmp_path / 'nope.json'}: No such file or directory"
    (tmp_path / "bad.json").write_text('{"memory": {"swappiness": 200}}')
    assert error("--resources", str(tmp_path / "bad.json")) == (
        f"quark: --resources {tmp_path / 'bad.json'}: resources.memory.swappiness: must be between 0 and 100, got 200")
    (tmp_path / "rdma.json").write_text('{"rdma": {"mlx5_0": {"hcaHandles": 1}}}')
    if "rdma" not in cgroups.open_cgroup("/x").mounts:
        assert error("--resources", str(tmp_path / "rdma.json")) == \
            "quark: linux.resources.rdma.mlx5_0: the rdma cgroup controller is not available on this host " \
            "(no cgroup v1 hierarchy has it mounted)"
