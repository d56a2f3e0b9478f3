"""What config.json asks for is what the container gets: each test runs a real container that
reports on itself, and checks the report."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from qvisor import cgroups
from qvisor.cgroups import v2
from qvisor.spec import CAPABILITIES
from tests.integration.conftest import cgroup_dirs, edit_config

pytestmark = pytest.mark.root


def run_report(quark, bundle_dir: str, cid: str = "cfg") -> str:
    r = quark("run", "--bundle", bundle_dir, cid, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def cap_mask(names) -> int:
    return sum(1 << CAPABILITIES[n] for n in names)


def test_process_user_env_cwd_hostname(quark, bundle):
    b = bundle(["sh", "-c", "id -u; id -g; id -G; echo $GREETING; pwd; hostname; cat /proc/self/status"])

    def edit(s):
        s["process"]["user"] = {"uid": 1000, "gid": 1001, "additionalGids": [1002, 1003]}
        s["process"]["env"].append("GREETING=hi there")
        s["process"]["cwd"] = "/work/dir"  # created if missing, as runc does
        s["hostname"] = "box1"
    edit_config(b, edit)
    os.makedirs(os.path.join(b, "rootfs/work/dir"))
    lines = run_report(quark, b).splitlines()
    assert lines[:6] == ["1000", "1001", "1001 1002 1003", "hi there", "/work/dir", "box1"]


def test_capabilities_and_no_new_privileges(quark, bundle):
    b = bundle(["cat", "/proc/self/status"])
    caps = ["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_CHOWN"]

    def edit(s):
        s["process"]["capabilities"] = {"bounding": caps, "effective": caps[:2], "permitted": caps,
                                        "inheritable": [], "ambient": []}
        s["process"]["noNewPrivileges"] = True
    edit_config(b, edit)
    status = dict(line.split(":\t", 1) for line in run_report(quark, b).splitlines() if ":\t" in line)
    assert int(status["CapBnd"], 16) == cap_mask(caps)
    # uid 0 execs with effective = permitted (the kernel's root semantics, the same under runc)
    assert int(status["CapEff"], 16) == cap_mask(caps)
    assert int(status["CapPrm"], 16) == cap_mask(caps)
    assert int(status["CapInh"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"


def test_rlimits(quark, bundle):
    b = bundle(["sh", "-c", "ulimit -n; ulimit -Hn; ulimit -s"])
    edit_config(b, lambda s: s["process"].__setitem__("rlimits", [
        {"type": "RLIMIT_NOFILE", "soft": 321, "hard": 654}, {"type": "RLIMIT_STACK", "soft": 4194304, "hard": 4194304}]))
    assert run_report(quark, b).split() == ["321", "654", "4096"]


def test_readonly_root_and_mounts(quark, bundle, tmp_path):
    host_dir = tmp_path / "shared"
    host_dir.mkdir()
    (host_dir / "f").write_text("from host\n")
    b = bundle(["sh", "-c", "touch /x 2>/dev/null && echo root-rw || echo root-ro; "
                            "cat /data/f; touch /data/g 2>/dev/null && echo data-rw || echo data-ro; "
                            "touch /scratch/y && echo scratch-rw; grep ' /scratch ' /proc/mounts"])

    def edit(s):
        s["mounts"].append({"destination": "/data", "type": "bind", "source": str(host_dir), "options": ["rbind", "ro"]})
        s["mounts"].append({"destination": "/scratch", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "size=1m"]})
    edit_config(b, edit)
    out = run_report(quark, b).splitlines()
    assert out[:4] == ["root-ro", "from host", "data-ro", "scratch-rw"]
    assert out[4].split()[2] == "tmpfs" and "size=1024k" in out[4]
    assert not (host_dir / "g").exists()


def test_mount_type_bind_without_bind_option_is_a_bind(quark, bundle, tmp_path):
    host_dir = tmp_path / "typed"
    host_dir.mkdir()
    (host_dir / "f").write_text("bound\n")
    b = bundle(["cat", "/typed/f"])
    edit_config(b, lambda s: s["mounts"].append({"destination": "/typed", "type": "bind",
                                                  "source": str(host_dir), "options": ["ro"]}))
    assert run_report(quark, b) == "bound\n"


def test_pid_network_ipc_uts_namespaces(quark, bundle):
    b = bundle(["sh", "-c", "echo $$; ls /sys/class/net; for n in ipc uts net; do readlink /proc/self/ns/$n; done"])
    out = run_report(quark, b).split()
    assert out[0] == "1" and out[1:2] == ["lo"]
    for ns, link in zip(("ipc", "uts", "net"), out[2:]):
        assert link != os.readlink(f"/proc/self/ns/{ns}")


def test_join_existing_network_namespace_by_path(quark, bundle):
    name = f"quark-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "qv0", "type", "veth", "peer", "name", "qv1"], check=True)
        b = bundle(["ls", "/sys/class/net"])

        def edit(s):
            for ns in s["linux"]["namespaces"]:
                if ns["type"] == "network":
                    ns["path"] = f"/var/run/netns/{name}"
        edit_config(b, edit)
        assert sorted(run_report(quark, b).split()) == ["lo", "qv0", "qv1"]
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def test_user_namespace_with_mappings(quark, tmp_path):
    from tests.support.busybox import make_bundle
    # the mapped root (host uid 100000) must be able to reach the rootfs, as with runc
    top = tempfile.mkdtemp(prefix="quark-userns-")
    os.chmod(top, 0o755)
    b = os.path.join(top, "bundle")
    make_bundle(b, ["sh", "-c", "cat /proc/self/uid_map /proc/self/gid_map; id -u"], readonly=False)

    def edit(s):
        s["linux"]["namespaces"].append({"type": "user"})
        s["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
        s["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
        s["mounts"] = [m for m in s["mounts"] if m["type"] not in ("sysfs", "cgroup")]
    edit_config(b, edit)
    subprocess.run(["chown", "-R", "100000:100000", os.path.join(b, "rootfs")], check=True)
    try:
        out = run_report(quark, b).split()
    finally:
        shutil.rmtree(top)
    assert out == ["0", "100000", "65536", "0", "100000", "65536", "0"]


def test_cgroup_resources_and_path(quark, bundle):
    path = f"/quark-test/{uuid.uuid4().hex[:8]}"
    b = bundle(["sleep", "100"])

    def edit(s):
        s["linux"]["cgroupsPath"] = path
        s["linux"]["resources"].update({"memory": {"limit": 256 << 20}, "pids": {"limit": 32},
                                        "cpu": {"shares": 512, "quota": 50000, "period": 100000}})
    edit_config(b, edit)
    quark("run", "-d", "--bundle", b, "res")
    pid = quark.state("res")["pid"]
    own = open(f"/proc/{pid}/cgroup").read()
    if cgroups.detect() == "v2":
        files = {"memory.max": str(256 << 20), "pids.max": "32", "cpu.weight": str(v2.shares_to_weight(512)),
                 "cpu.max": "50000 100000"}
        assert f"0::{path}\n" in own
        assert {n: open(f"/sys/fs/cgroup{path}/{n}").read().strip() for n in files} == files
        own_view = "/sys/fs/cgroup/memory.max"
    else:
        files = {"memory/memory.limit_in_bytes": str(256 << 20), "pids/pids.max": "32", "cpu/cpu.shares": "512",
                 "cpu/cpu.cfs_quota_us": "50000"}
        assert f"memory:{path}" in own and f"pids:{path}" in own
        assert {n: open(f"/sys/fs/cgroup/{n.split('/')[0]}{path}/{n.split('/')[1]}").read().strip()
                for n in files} == files
        own_view = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
    r = quark("exec", "res", "cat", own_view)
    assert r.stdout.strip() == str(256 << 20), "the container sees its own cgroup, not the host's"
    quark("delete", "--force", "res")
    assert cgroup_dirs(path) == []
    for d in (["."] if cgroups.detect() == "v2" else ["memory", "pids", "cpu"]):
        os.rmdir(f"/sys/fs/cgroup/{d}/quark-test")


def test_pids_limit_is_enforced(quark, bundle):
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"]["resources"].update({"pids": {"limit": 4}}))
    quark("run", "-d", "--bundle", b, "pl")
    codes = [quark("exec", "-d", "pl", "sleep", "100", check=False).returncode for _ in range(5)]
    assert 0 in codes and 1 in codes
    assert len(json.loads(quark("ps", "--format", "json", "pl").stdout)) <= 4


def test_masked_and_readonly_paths(quark, bundle):
    b = bundle(["sh", "-c", "wc -c < /proc/keys; ls /sys/firmware | wc -l; "
                            "echo 1 > /proc/sys/kernel/domainname 2>/dev/null && echo sys-rw || echo sys-ro; "
                            "echo x > /proc/sysrq-trigger 2>/dev/null && echo sysrq-rw || echo sysrq-ro"])
    assert run_report(quark, b).split() == ["0", "0", "sys-ro", "sysrq-ro"]


def test_devices_default_and_extra(quark, bundle):
    b = bundle(["sh", "-c", "head -c 4 /dev/zero | wc -c; echo x > /dev/null && echo null-ok; "
                            "ls -l /dev/kmsg2 | cut -c1; head -c1 /dev/kmsg2 >/dev/null 2>&1 || echo kmsg-denied; "
                            "ls /dev/sda 2>/dev/null || echo no-sda"])
    edit_config(b, lambda s: s["linux"].__setitem__("devices", [
        {"path": "/dev/kmsg2", "type": "c", "major": 1, "minor": 11, "fileMode": 0o600}]))
    out = run_report(quark, b).split()
    assert out[:3] == ["4", "null-ok", "c"] and "no-sda" in out


def test_device_cgroup_refuses_unlisted_devices(quark, bundle):
    # mknod is allowed (runc's default), but the node is unusable: the cgroup denies rw on it
    b = bundle(["sh", "-c", "mknod /tmp/mem c 1 1 && (head -c1 /tmp/mem >/dev/null 2>&1 && echo read || echo denied)"],
               readonly=False)
    edit_config(b, lambda s: s["process"]["capabilities"]["bounding"].append("CAP_MKNOD") or
                s["process"]["capabilities"]["effective"].append("CAP_MKNOD") or
                s["process"]["capabilities"]["permitted"].append("CAP_MKNOD"))
    assert run_report(quark, b).split() == ["denied"]


def test_sysctl(quark, bundle):
    b = bundle(["cat", "/proc/sys/kernel/shmmni", "/proc/sys/net/ipv4/ip_forward"])
    edit_config(b, lambda s: s["linux"].__setitem__("sysctl", {"kernel.shmmni": "1234", "net.ipv4.ip_forward": "1"}))
    assert run_report(quark, b).split() == ["1234", "1"]
    assert open("/proc/sys/kernel/shmmni").read().strip() != "1234"


def test_seccomp_profile_of_the_bundle(quark, bundle):
    b = bundle(["sh", "-c", "mkdir /tmp/d 2>&1; echo rc=$?"], readonly=False)
    edit_config(b, lambda s: s["linux"].__setitem__("seccomp", {
        "defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}))
    out = run_report(quark, b)
    assert "Operation not permitted" in out and "rc=1" in out


def test_hooks_get_state_and_run_in_order(quark, bundle, tmp_path):
    log = tmp_path / "hooks.log"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\nstate=$(cat)\necho \"$1 $state\" >> {log}\n")
    hook.chmod(0o755)
    b = bundle(["true"])
    # createContainer and startContainer run in the container; a startContainer hook's path is in its
    # rootfs, a createContainer hook's in the runtime's (it runs before pivot_root, from the rootfs)
    inner = os.path.join(b, "rootfs/hook.sh")
    with open(inner, "w") as f:
        f.write("#!/bin/sh\ncat > /dev/null\necho $1 > /tmp/$1\n")
    os.chmod(inner, 0o755)
    outer = tmp_path / "create-container.sh"
    outer.write_text("#!/bin/sh\ncat > /dev/null\necho $1 > tmp/$1\n")
    outer.chmod(0o755)

    def h(name):
        return [{"path": str(hook), "args": ["hook.sh", name]}]

    def edit(s):
        s["root"]["readonly"] = False
        s["hooks"] = {"createRuntime": h("createRuntime"), "poststart": h("poststart"), "poststop": h("poststop"),
                      "createContainer": [{"path": str(outer), "args": ["hook.sh", "createContainer"]}],
                      "startContainer": [{"path": "/hook.sh", "args": ["hook.sh", "startContainer"]}]}
        s["annotations"] = {"org.example/k": "v"}
    edit_config(b, edit)
    run_report(quark, b, "hk")
    lines = log.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["createRuntime", "poststart", "poststop"]
    states = [json.loads(ln.split(" ", 1)[1]) for ln in lines]
    # the bundle's annotations, plus quark's report of what it applied (qvisor/security.py)
    assert all(st["id"] == "hk" and {k: v for k, v in st["annotations"].items()
                                     if not k.startswith("io.quark.security.")} == {"org.example/k": "v"}
               for st in states)
    assert states[0]["status"] == "creating" and states[0]["pid"] > 0
    assert states[2]["status"] == "stopped"
    for name in ("createContainer", "startContainer"):
        assert open(os.path.join(b, "rootfs/tmp", name)).read().strip() == name


def test_failing_hook_fails_create_and_leaves_nothing(quark, bundle):
    b = bundle(["true"])
    edit_config(b, lambda s: s.__setitem__("hooks", {"createRuntime": [{"path": "/bin/false"}]}))
    r = quark("create", "--bundle", b, "hf", check=False)
    assert r.returncode == 1 and "createRuntime" in r.stderr
    assert quark.ids() == [] and cgroup_dirs("/quark/hf") == []


def test_negative_oom_score_adj_is_handled(quark, bundle):
    b = bundle(["cat", "/proc/self/oom_score_adj"])
    edit_config(b, lambda s: s["process"].__setitem__("oomScoreAdj", -500))
    out = run_report(quark, b).strip()
    # the kernel here refuses lowering it even to root (EACCES); either way the container runs
    assert out in ("-500", open("/proc/self/oom_score_adj").read().strip())


def test_positive_oom_score_adj(quark, bundle):
    b = bundle(["cat", "/proc/self/oom_score_adj"])
    edit_config(b, lambda s: s["process"].__setitem__("oomScoreAdj", 300))
    assert run_report(quark, b).strip() == "300"
