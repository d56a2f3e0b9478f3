"""The container's own /proc view (qvisor/procview.py) in real containers (root): busybox `free` and
`nproc`, /proc/meminfo, cpuinfo, stat, uptime, loadavg, swaps and /sys/devices/system/cpu/online,
and glibc's sysconf in the host's python3, all as the container's cgroup makes them, agreeing with
sysinfo(2) (which QKernel answers), and current at every read."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest

from qvisor import procview
from tests.integration.conftest import edit_config

MiB = 1 << 20
LIMIT_KB = 262144
PROBE = ("import os; print(os.sysconf('SC_NPROCESSORS_ONLN'), os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'),"
         " os.cpu_count())")
REPORT = ("for f in /proc/meminfo /proc/cpuinfo /proc/uptime /proc/loadavg /proc/swaps /proc/stat "
          "/sys/devices/system/cpu/online; do echo \"== $f\"; cat $f; done; "
          "echo '== free'; free -m; echo '== nproc'; nproc; "
          f"echo '== python'; /usr/bin/python3 -c \"{PROBE}\"; echo '== mountinfo'; cat /proc/self/mountinfo")


def cid(name: str) -> str:
    return f"pv-{name}-{uuid.uuid4().hex[:8]}"


def sections(out: str) -> dict[str, str]:
    parts = re.split(r"^== (\S+)\n", out, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def kb(meminfo: str, key: str) -> int:
    m = re.search(rf"^{re.escape(key)}:\s+(\d+) kB$", meminfo, re.MULTILINE)
    assert m, f"{key} missing from:\n{meminfo}"
    return int(m[1])


def free_rows(text: str) -> dict[str, list[int]]:
    return {line.split()[0].rstrip(":"): [int(x) for x in line.split()[1:]]
            for line in text.splitlines() if line.startswith(("Mem:", "Swap:"))}


@pytest.fixture
def pv_bundle(bundle):
    """make(args, memory=256 MiB, cpu={...}) -> a busybox bundle that also sees the host's /usr
    (read-only; python3 inside), with the memory limit and linux.resources.cpu given."""
    def make(args: list[str], memory: int | None = 256 * MiB, cpu: dict | None = None,
             annotations: dict | None = None) -> str:
        b = bundle(args)
        rootfs = os.path.join(b, "rootfs")
        for link in ("lib", "lib64"):
            if os.path.islink(f"/{link}"):
                os.symlink(os.readlink(f"/{link}"), os.path.join(rootfs, link))

        def edit(spec: dict) -> None:
            spec["mounts"].append({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]})
            res = spec["linux"].setdefault("resources", {})
            if memory is not None:
                res["memory"] = {"limit": memory}
            if cpu is not None:
                res["cpu"] = cpu
            if annotations:
                spec.setdefault("annotations", {}).update(annotations)
        edit_config(b, edit)
        return b
    return make


def run(quark, b: str, name: str) -> str:
    r = quark("run", "--bundle", b, cid(name), check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_limited_container_sees_its_cgroup(quark, pv_bundle):
    out = sections(run(quark, pv_bundle(["sh", "-c", REPORT], cpu={"cpus": "0"}), "limited"))
    meminfo = out["/proc/meminfo"]
    assert kb(meminfo, "MemTotal") == LIMIT_KB
    assert 0 < kb(meminfo, "MemFree") < LIMIT_KB and kb(meminfo, "MemAvailable") <= LIMIT_KB
    assert all(int(v) <= LIMIT_KB for k, v in re.findall(r"^(\S+):\s+(\d+) kB$", meminfo, re.MULTILINE)
               if k not in ("SwapTotal", "SwapFree", "Hugepagesize"))
    # busybox free: total/free/shared/buffers from sysinfo(2) (QKernel), cached/available from meminfo
    mem = free_rows(out["free"])["Mem"]
    total, used, free, _, cache, available = mem
    assert total == 256 and 0 <= used < total and used + free + cache <= total + 1
    assert abs(free - kb(meminfo, "MemFree") // 1024) <= 8        # two reads a moment apart
    assert available == kb(meminfo, "MemAvailable") // 1024 or abs(available - free - cache) <= 8
    swap = free_rows(out["free"])["Swap"]
    assert swap[0] == kb(meminfo, "SwapTotal") // 1024
    swaps = out["/proc/swaps"].splitlines()
    assert swaps[0].startswith("Filename")
    if kb(meminfo, "SwapTotal"):
        assert int(swaps[1].split()[2]) == kb(meminfo, "SwapTotal")
    else:
        assert swaps[1:] == []
    # one CPU: the cpuset's
    assert out["nproc"].strip() == "1"
    assert len(re.findall(r"^processor\s*:", out["/proc/cpuinfo"], re.MULTILINE)) == 1
    assert re.findall(r"^cpu\d+ ", out["/proc/stat"], re.MULTILINE) == ["cpu0 "]
    assert out["/sys/devices/system/cpu/online"] == "0\n"
    nprocs, phys, cpu_count = out["python"].split()
    assert (int(nprocs), int(phys), int(cpu_count)) == (1, 256 * MiB, 1)   # glibc: /sys ... online, sysinfo(2)
    # the container's clock and load
    up, idle = map(float, out["/proc/uptime"].split())
    assert 0 <= up < 10 and idle >= 0
    m = re.fullmatch(r"(\d+\.\d\d) (\d+\.\d\d) (\d+\.\d\d) (\d+)/(\d+) (\d+)\n", out["/proc/loadavg"])
    assert m, out["/proc/loadavg"]
    assert 1 <= int(m[4]) <= int(m[5]) <= 5 and 0 < int(m[6]) < 100   # its threads, its pid numbers
    assert "quark-procview" in out["mountinfo"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a host with 2 or more CPUs to tell a quota of 1 apart")
def test_a_cpu_quota_shows_as_that_many_cpus(quark, pv_bundle):
    out = sections(run(quark, pv_bundle(["sh", "-c", REPORT], memory=None, cpu={"quota": 100000, "period": 100000}),
                       "quota"))
    assert len(re.findall(r"^processor\s*:", out["/proc/cpuinfo"], re.MULTILINE)) == 1
    assert re.findall(r"^cpu\d+ ", out["/proc/stat"], re.MULTILINE) == ["cpu0 "]
    assert out["/sys/devices/system/cpu/online"] == "0\n"
    assert out["python"].split()[0] == "1"
    with open("/proc/meminfo") as f:   # no memory limit: the host's RAM
        assert kb(out["/proc/meminfo"], "MemTotal") == kb(f.read(), "MemTotal")


def test_an_update_is_seen_at_the_next_read(quark, pv_bundle):
    name = cid("update")
    quark("run", "-d", "--bundle", pv_bundle(["sleep", "600"]), name)
    try:
        assert kb(quark("exec", name, "cat", "/proc/meminfo").stdout, "MemTotal") == LIMIT_KB
        quark("update", "--memory", "128M", name)
        assert kb(quark("exec", name, "cat", "/proc/meminfo").stdout, "MemTotal") == LIMIT_KB // 2
        assert free_rows(quark("exec", name, "free", "-m").stdout)["Mem"][0] == 128
        assert quark("exec", name, "/usr/bin/python3", "-c", PROBE).stdout.split()[1] == str(128 * MiB)
    finally:
        quark("delete", "--force", name, check=False)


def test_load_average_is_each_containers_own(quark, pv_bundle):
    """A container with a task that never sleeps and an idle one, side by side: after two of the
    supervisor's 5 s samples the busy one's 1-minute load is about 1 - (1884/2048)^2 = 0.15, the
    idle one's 0.00 (the host's, which both would show without the view, is the same for both)."""
    busy, idle = cid("busy"), cid("idle")
    wait = math.ceil(procview.LOAD_FREQ * 2 + 1.5)
    quark("run", "-d", "--bundle", pv_bundle(["sh", "-c", "while :; do :; done"], cpu={"cpus": "0"}), busy)
    # The idle container reads its own load with the shell's `read` builtin: a `quark exec cat` is a
    # task of that container for as long as its start takes (long under the VM lane's emulation), and
    # a sample landing meanwhile counts it, as Linux counts a reader of /proc/loadavg
    quark("run", "-d", "--bundle", pv_bundle(["sh", "-c", f"sleep {wait}; read l < /proc/loadavg; "
                                                          "echo \"$l\" > /dev/shm/load; sleep 600"]), idle)
    try:
        time.sleep(wait)
        busy_load = quark("exec", busy, "cat", "/proc/loadavg").stdout.split()
        deadline = time.monotonic() + 30
        while not (idle_load := quark("exec", idle, "cat", "/dev/shm/load", check=False).stdout.split()):
            assert time.monotonic() < deadline, "the idle container never read its load"
            time.sleep(0.2)
    finally:
        quark("delete", "--force", busy, check=False)
        quark("delete", "--force", idle, check=False)
    # two samples or more (a slow machine takes longer to exec the reads): one runnable task's load
    # climbs from 0.15 towards 1 and never beyond
    assert 0.1 <= float(busy_load[0]) <= 1.0 and float(busy_load[1]) > 0, busy_load
    assert idle_load[:3] == ["0.00", "0.00", "0.00"], idle_load


def test_masked_paths_still_win_and_writes_are_refused(quark, pv_bundle):
    b = pv_bundle(["sh", "-c", ("echo \"[$(cat /proc/swaps)]\"; grep MemTotal /proc/meminfo; "
                                "echo x > /proc/meminfo && echo WROTE; true")])
    edit_config(b, lambda s: s["linux"]["maskedPaths"].append("/proc/swaps"))
    out = run(quark, b, "masked")
    assert out.splitlines()[0] == "[]"   # /dev/null over the view's file
    assert kb(out, "MemTotal") == LIMIT_KB and "WROTE" not in out


def test_the_annotation_turns_the_view_off_and_the_container_still_runs(quark, pv_bundle):
    """With io.quark.procview=false the container runs without the view (as it does when FUSE is
    unavailable: a warning, no failure) and sees the host's files; without it, its own."""
    args = ["sh", "-c", "grep MemTotal /proc/meminfo; grep -c quark-procview /proc/self/mountinfo; true"]
    off = run(quark, pv_bundle(args, annotations={"io.quark.procview": "false"}), "off").split()
    on = run(quark, pv_bundle(args), "on").split()
    with open("/proc/meminfo") as f:
        host = kb(f.read(), "MemTotal")
    assert off == ["MemTotal:", str(host), "kB", "0"]
    assert on == ["MemTotal:", str(LIMIT_KB), "kB", "7"]


def test_in_a_user_namespace_as_an_unprivileged_user(quark):
    from tests.support.busybox import make_bundle
    # the mapped root (host uid 100000) must be able to reach the rootfs
    top = tempfile.mkdtemp(prefix="quark-procview-")
    os.chmod(top, 0o755)
    b = os.path.join(top, "bundle")
    try:
        make_bundle(b, ["sh", "-c", "id -u; grep MemTotal /proc/meminfo; nproc"], readonly=False)

        def edit(s):
            s["linux"]["namespaces"].append({"type": "user"})
            s["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            s["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            s["mounts"] = [m for m in s["mounts"] if m["type"] not in ("sysfs", "cgroup")]
            s["process"]["user"] = {"uid": 1000, "gid": 1000}
            s["linux"]["resources"]["memory"] = {"limit": 256 * MiB}
            s["linux"]["resources"]["cpu"] = {"cpus": "0"}
        edit_config(b, edit)
        subprocess.run(["chown", "-R", "100000:100000", os.path.join(b, "rootfs")], check=True)
        out = run(quark, b, "userns").split()
    finally:
        shutil.rmtree(top)
    assert out == ["1000", "MemTotal:", str(LIMIT_KB), "kB", "1"]
