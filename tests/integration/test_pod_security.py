"""Pod security settings as Kubernetes means them, through the real CLI with config.json shaped as
containerd's CRI plugin writes it: CAP_SYS_ADMIN added to a container, `privileged: true` (every
capability, no seccomp profile, no masked or read-only paths, /sys and cgroup writable, no host
devices with privileged_without_host_devices), and `seccompProfile: Unconfined` (no linux.seccomp).

Grants (qkernel/table.py): capability-gated syscalls run when the container holds the capability and
the namespace they act on is its own. The operator setting `security:` in $QUARK_CONFIG decides
whether privileged and Unconfined are honoured inside the sandbox (reported in `quark state`) or refused.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import time
import uuid

import pytest

from qlib import linux as L
from qlib import procfs
from qvisor import security
from qvisor.spec import CAPABILITIES
from tests.integration.conftest import cgroup_dirs, edit_config

pytestmark = pytest.mark.root

RUNTIME_DEFAULT = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
                   "syscalls": [{"names": ["kexec_load"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


def all_caps() -> list[str]:
    """containerd's privileged capability list: every capability it holds itself (cap.Current())."""
    last, held = L.last_cap(), procfs.permitted_caps()
    return sorted(n for n, bit in CAPABILITIES.items() if bit <= last and held & (1 << bit))


def add_caps(spec: dict, names) -> None:
    for k in ("bounding", "effective", "permitted"):
        caps = spec["process"]["capabilities"].setdefault(k, [])
        caps.extend(n for n in names if n not in caps)


def cri_container(spec: dict, *, seccomp: dict | None = RUNTIME_DEFAULT) -> None:
    """What containerd's CRI plugin changes against runc's default spec for an ordinary container."""
    spec["process"]["capabilities"].pop("ambient", None)
    spec["process"]["noNewPrivileges"] = False
    if seccomp is None:
        spec["linux"].pop("seccomp", None)   # seccompProfile: Unconfined
    else:
        spec["linux"]["seccomp"] = seccomp


def cri_privileged(spec: dict, host_devices: bool = False) -> None:
    """containerd's privileged container: WithPrivileged, WithoutApparmor/seccomp, cleared masked and
    read-only paths, writable sysfs and cgroup mounts; with privileged_without_host_devices false,
    WithHostDevices + WithAllDevicesAllowed as well."""
    cri_container(spec, seccomp=None)
    for k in ("bounding", "effective", "permitted"):
        spec["process"]["capabilities"][k] = all_caps()
    spec["linux"]["maskedPaths"] = []
    spec["linux"]["readonlyPaths"] = []
    for m in spec["mounts"]:
        if m["type"] in ("sysfs", "cgroup"):
            m["options"] = [o for o in m["options"] if o != "ro"] + ["rw"]
    if host_devices:
        spec["linux"]["resources"]["devices"] = [{"allow": True, "access": "rwm"}]
        spec["linux"]["devices"] = [{"path": "/dev/null2", "type": "c", "major": 1, "minor": 3}]


def host_mounts(quark) -> set[str]:
    """The host's mounts (root and mount point) under this test run's temporary directory, which holds
    the state root, the bundles and the volumes (other sessions on the machine mount elsewhere)."""
    base = os.path.dirname(quark.root)
    with open("/proc/self/mountinfo") as f:
        return {" ".join(line.split()[3:5]) for line in f if line.split()[4].startswith(base)}


def config_file(tmp_path, text: str) -> dict:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return dict(os.environ, QUARK_CONFIG=str(p))


def assert_nothing_left(quark, cid: str, mounts_before: set[str]) -> None:
    assert quark.ids() == []
    assert cgroup_dirs(f"/quark/{cid}") == []
    assert host_mounts(quark) == mounts_before
    from tests.integration.conftest import _processes_mentioning
    assert _processes_mentioning(quark.root) == []


@pytest.fixture
def pod_uts():
    """A pod's UTS namespace, as the pause container holds it (CRI containers join it by path)."""
    p = subprocess.Popen(["unshare", "--uts", "sleep", "600"])
    path = f"/proc/{p.pid}/ns/uts"
    for _ in range(100):
        if os.stat(path).st_ino != os.stat("/proc/self/ns/uts").st_ino:
            break
        time.sleep(0.02)
    yield path
    p.kill()
    p.wait()


def _long_running(quark, bundle, cid: str, edit) -> None:
    b = bundle(["sleep", "600"], readonly=False)
    edit_config(b, edit)
    quark("create", "--bundle", b, cid)
    quark("start", cid)


def _exec(quark, cid: str, script: str) -> subprocess.CompletedProcess:
    return quark("exec", cid, "sh", "-c", script, check=False)


# --- 1. capability-gated syscalls in the container's own namespaces -------------------------------

def test_sethostname_with_cap_sys_admin_in_the_pods_uts_namespace(quark, bundle, pod_uts):
    """ExecSync `hostname` in a container holding CAP_SYS_ADMIN that joined its pod's UTS namespace
    works, as with runc; the same container without CAP_SYS_ADMIN still gets EPERM."""
    host = socket.gethostname()

    def edit(s, caps=("CAP_SYS_ADMIN",)):
        cri_container(s)
        add_caps(s, caps)
        s["linux"]["namespaces"] = [n for n in s["linux"]["namespaces"] if n["type"] != "uts"] + [
            {"type": "uts", "path": pod_uts}]
        s.pop("hostname", None)
    _long_running(quark, bundle, "uts-admin", edit)
    r = _exec(quark, "uts-admin", "hostname pod-renamed && hostname")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["pod-renamed"]
    _long_running(quark, bundle, "uts-plain", lambda s: edit(s, caps=()))
    r = _exec(quark, "uts-plain", "hostname other 2>&1; hostname")
    assert "Operation not permitted" in r.stdout and r.stdout.split()[-1] == "pod-renamed"   # the pod's, unchanged
    assert socket.gethostname() == host


def test_sethostname_in_the_hosts_uts_namespace_stays_denied(quark, bundle):
    """CAP_SYS_ADMIN without a UTS namespace of its own: the name is the runtime's (here a throwaway
    UTS namespace standing in for the host's), so the call stays denied."""
    b = bundle(["sh", "-c", "hostname from-container 2>&1; hostname"], readonly=False)

    def edit(s):
        cri_container(s)
        add_caps(s, ["CAP_SYS_ADMIN"])
        s["linux"]["namespaces"] = [n for n in s["linux"]["namespaces"] if n["type"] != "uts"]
        s.pop("hostname", None)
    edit_config(b, edit)
    # the runtime itself runs in a UTS namespace of the test's, so a failure cannot rename this machine
    r = subprocess.run(["unshare", "--uts", "sh", "-c", 'hostname runtime-uts; exec "$@"', "sh",
                        *quark.argv0, "--root", quark.root, "run", "--bundle", b, "hostuts"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Operation not permitted" in r.stdout and r.stdout.split()[-1] == "runtime-uts"


def test_cap_sys_admin_bind_mounts_and_propagation_in_own_mount_namespace(quark, bundle):
    """Bind mounts, rshared/rslave propagation, read-only bind remounts and umount of its own mounts
    work in the container's mount namespace, from its init and from an exec'd process."""
    script = ("mkdir -p /tmp/a /tmp/b /tmp/s /tmp/t /tmp/u/x && touch /tmp/a/file && "
              "mount --bind /tmp/a /tmp/b && ls /tmp/b && "
              "mount --bind /tmp/s /tmp/s && mount --make-rshared /tmp/s && mount --rbind /tmp/s /tmp/t && "
              "mkdir /tmp/s/in && mount --bind /tmp/u /tmp/s/in && ls /tmp/t/in && "   # propagated to the peer
              "mount --make-rslave /tmp/t && umount /tmp/t/in && ls /tmp/s/in && "      # a slave's umount stays there
              "mount -o remount,bind,ro /tmp/b && (touch /tmp/b/new 2>&1 || true) && "
              "umount /tmp/b && echo done")
    before = host_mounts(quark)
    b = bundle(["sh", "-c", script], readonly=False)
    edit_config(b, lambda s: (cri_container(s), add_caps(s, ["CAP_SYS_ADMIN"])))
    r = quark("run", "--bundle", b, "binds", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["file", "x", "x", "touch:", "/tmp/b/new:", "Read-only", "file", "system", "done"]
    _long_running(quark, bundle, "binds-exec", lambda s: (cri_container(s), add_caps(s, ["CAP_SYS_ADMIN"])))
    r = _exec(quark, "binds-exec", "mkdir -p /tmp/c /tmp/d && mount --bind /tmp/c /tmp/d && "
                                   "mount --make-rshared /tmp/d && umount /tmp/d && echo exec-ok")
    assert r.stdout.strip() == "exec-ok", r.stdout + r.stderr
    assert host_mounts(quark) == before


@pytest.fixture(scope="module")
def mount_probe(tmp_path_factory) -> str:
    from tests.integration.test_qkernel_platforms import compile_c
    return compile_c(tmp_path_factory.mktemp("mount-probe"), "mount_probe", "-static")


def test_cap_sys_admin_mounts_a_tmpfs_and_no_other_new_filesystem(quark, bundle, mount_probe):
    """A new tmpfs works in the container's own mount namespace (the supervisor makes it: the filter
    cannot read the type), from the init and from an exec'd process; proc, sysfs and cgroup stay EPERM,
    also when the flags carry mount(2)'s old magic number (whose top bits look like propagation flags to
    the filter: a magic cgroup v1 mount once ran natively, the host's hierarchy writable), and so does
    MS_MOVE; nothing reaches the host's mount table."""
    script = ("mkdir -p /tmp/t /tmp/p /tmp/m && mount -t tmpfs -o size=1m,mode=700 tmpfs /tmp/t && "
              "echo data > /tmp/t/f && cat /tmp/t/f && grep ' /tmp/t ' /proc/self/mountinfo | sed 's/.* - //'; "
              "stat -c %a /tmp/t; mount -t proc proc /tmp/p 2>&1; mount -t sysfs sysfs /tmp/p 2>&1; "
              "/mount_probe cgroup /tmp/p cgroup 0 none,name=qtest; "
              "/mount_probe cgroup /tmp/p cgroup c0ed0000 none,name=qtest; /mount_probe tmpfs /tmp/m tmpfs c0ed0000; "
              "/mount_probe tmpfs /tmp/m tmpfs 2000; umount /tmp/t && ls /tmp/t && echo end")
    before = host_mounts(quark)
    b = bundle(["sh", "-c", script], readonly=False)
    shutil.copy(mount_probe, os.path.join(b, "rootfs", "mount_probe"))
    edit_config(b, lambda s: (cri_container(s), add_caps(s, ["CAP_SYS_ADMIN"])))
    r = quark("run", "--bundle", b, "tmpfs-init", check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        "data", "tmpfs tmpfs rw,size=1024k,mode=700", "700",
        "mount: permission denied (are you root?)", "mount: permission denied (are you root?)",
        f"{errno.EPERM}", f"{errno.EPERM}", "0", f"{errno.EPERM}", "end"], r.stdout
    _long_running(quark, bundle, "tmpfs-exec", lambda s: (cri_container(s), add_caps(s, ["CAP_SYS_ADMIN"])))
    r = _exec(quark, "tmpfs-exec", "mkdir -p /tmp/e && mount -t tmpfs tmpfs /tmp/e && touch /tmp/e/x && "
                                   "grep -c ' /tmp/e .* - tmpfs ' /proc/self/mountinfo")
    assert r.stdout.strip() == "1", r.stdout + r.stderr
    assert host_mounts(quark) == before


def test_cap_sys_admin_in_a_user_namespace_binds_and_quarks_mounts_stay_locked(quark, bundle, tmp_path):
    """The same grant in a container with a user namespace (root = host uid 100000): binds and a tmpfs
    (owned by the container's root) work, and quark's masks and read-only paths, made inside that
    namespace, are locked too."""
    for p in [tmp_path, *tmp_path.parents]:   # let the mapped root walk down to the bundle
        if p != p.parent and not os.stat(p).st_mode & 0o001:
            os.chmod(p, os.stat(p).st_mode | 0o011)
    b = bundle(["sh", "-c", "mkdir -p /tmp/a /tmp/b && mount --bind /tmp/a /tmp/b && echo bind-ok; "
                            "mkdir -p /tmp/t && mount -t tmpfs tmpfs /tmp/t && touch /tmp/t/y && stat -c %u /tmp/t /tmp/t/y; "
                            "mount --bind /proc /tmp/b 2>&1; umount /proc/sys 2>&1; echo end"], readonly=False)

    def edit(s):
        cri_container(s)
        add_caps(s, ["CAP_SYS_ADMIN"])
        s["linux"]["namespaces"].append({"type": "user"})
        s["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
        s["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    edit_config(b, edit)
    subprocess.run(["chown", "-R", "100000:100000", os.path.join(b, "rootfs")], check=True)
    out = quark("run", "--bundle", b, "userns-binds").stdout
    assert out.splitlines() == ["bind-ok", "0", "0", "mount: mounting /proc on /tmp/b failed: Invalid argument",
                                "umount: can't unmount /proc/sys: Invalid argument", "end"], out


def test_mounts_stay_refused_without_cap_sys_admin(quark, bundle):
    b = bundle(["sh", "-c", "mkdir -p /tmp/a /tmp/b; mount --bind /tmp/a /tmp/b 2>&1; echo rc=$?"], readonly=False)
    edit_config(b, cri_container)
    r = quark("run", "--bundle", b, "nobind")
    assert "rc=1" in r.stdout and "ermission denied" in r.stdout   # busybox: "permission denied (are you root?)"


# --- 2. privileged, honoured inside the sandbox (the default) ---------------------------------------

def test_privileged_in_the_sandbox_is_reported_and_a_host_to_container_volume_carries_nothing_back(
        quark, bundle, tmp_path):
    """A CRI privileged container with a HostToContainer volume (rbind, rslave, from a shared host
    mount) mounts inside it; the host's mount table is unchanged. `quark state` and the supervisor's
    log say what was honoured and what quark kept. The same volume Bidirectional (rshared) is refused
    at create, naming the field, with nothing left behind: quark's locked mount namespace would turn
    it into a slave, so the container's mounts could never reach the host as Bidirectional promises."""
    vol = tmp_path / "vol"
    vol.mkdir()
    subprocess.run(["mount", "--bind", str(vol), str(vol)], check=True)
    subprocess.run(["mount", "--make-shared", str(vol)], check=True)
    try:
        (vol / "sub").mkdir()
        before = host_mounts(quark)
        b = bundle(["sh", "-c", "mkdir -p /tmp/x && touch /tmp/x/marker && mount --bind /tmp/x /vol/sub && "
                                "ls /vol/sub > /result.txt"], readonly=False)

        def edit(s, propagation="rslave"):
            cri_privileged(s)
            s["mounts"].append({"destination": "/vol", "type": "bind", "source": str(vol),
                                "options": ["rbind", propagation]})
            s["linux"]["rootfsPropagation"] = propagation   # what containerd sets along with such a mount
        edit_config(b, edit)
        quark("create", "--bundle", b, "priv")
        annotations = quark.state("priv")["annotations"]
        report = annotations[security.ANNOTATION_PRIVILEGED]
        assert report.startswith("sandbox: every capability") and "runc's masked paths" in report
        assert "/sys read-only" in report and "/sys/fs/cgroup read-only" in report
        assert "Unconfined" in annotations[security.ANNOTATION_SECCOMP]
        with open(os.path.join(quark.root, "priv", "supervisor.log")) as f:
            assert f"{security.ANNOTATION_PRIVILEGED}: sandbox:" in f.read()
        quark("start", "priv")
        quark("wait", "priv", check=False, timeout=60)
        with open(os.path.join(b, "rootfs", "result.txt")) as f:
            assert f.read().split() == ["marker"]   # the bind worked inside
        assert host_mounts(quark) == before              # and reached no host mount table
        assert os.listdir(vol / "sub") == []
        quark("delete", "priv")

        b2 = bundle(["true"], readonly=False)
        edit_config(b2, lambda s: edit(s, "rshared"))
        r = quark("create", "--bundle", b2, "bidir", check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        index = len(json_of(b2)["mounts"]) - 1
        assert f"config.json: mounts[{index}].options: rshared (/vol; Kubernetes' Bidirectional" in r.stderr, r.stderr
        assert "use rslave (HostToContainer)" in r.stderr
        assert_nothing_left(quark, "bidir", before)
    finally:
        subprocess.run(["umount", "-R", str(vol)], check=False)


def json_of(bundle_dir: str) -> dict:
    with open(os.path.join(bundle_dir, "config.json")) as f:
        return json.load(f)


def test_privileged_sandbox_report_and_what_the_container_sees(quark, bundle):
    # the host's knobs are opened for writing with nothing written (`: >`): should the protection ever
    # fail, the test fails without changing the host
    script = ("grep -E '^(CapEff|Seccomp|Seccomp_filters):' /proc/self/status; "
              "mkdir -p /tmp/x /tmp/y && mount --bind /tmp/x /tmp/y && echo bind-ok; "
              "mount --bind /proc /tmp/y 2>&1; umount /proc/sys 2>&1; "
              "mount -o remount,bind,rw /proc/sys 2>&1; mount -t proc proc /tmp/x 2>&1; "
              "(: > /proc/sys/kernel/core_pattern) 2>&1; (: > /sys/kernel/uevent_helper) 2>&1; echo end")
    b = bundle(["sh", "-c", script], readonly=False)
    edit_config(b, cri_privileged)
    out = quark("run", "--bundle", b, "privrun").stdout
    lines = dict(line.split(":\t") for line in out.splitlines() if ":\t" in line)
    assert int(lines["CapEff"], 16) == sum(1 << CAPABILITIES[n] for n in all_caps())   # all quark holds
    assert lines["Seccomp"] == "2" and lines["Seccomp_filters"] == "1"  # quark's base policy, nothing else
    assert "bind-ok" in out
    assert "mounting /proc on /tmp/y failed: Invalid argument" in out     # /proc/sys is locked under it
    assert "can't unmount /proc/sys: Invalid argument" in out
    assert "core_pattern: Read-only file system" in out and "uevent_helper: Read-only file system" in out
    assert out.count("permission denied") == 2                          # rw remount, new procfs
    assert out.rstrip().endswith("end")


# --- 3. the operator's refusals -----------------------------------------------------------------------

def test_refuse_mode_refuses_privileged_and_leaves_nothing(quark, bundle, tmp_path):
    env = config_file(tmp_path, "security:\n  privileged: refuse\n")
    b = bundle(["true"])
    edit_config(b, cri_privileged)
    before = host_mounts(quark)
    r = quark("create", "--bundle", b, "privno", check=False, env=env)
    assert r.returncode == 1
    assert "config.json: process.capabilities: every capability (a privileged container) is refused" in r.stderr
    assert "security.privileged: refuse" in r.stderr and "Traceback" not in r.stderr
    assert_nothing_left(quark, "privno", before)
    # the same setting lets an ordinary container with CAP_SYS_ADMIN run
    b2 = bundle(["true"])
    edit_config(b2, lambda s: (cri_container(s), add_caps(s, ["CAP_SYS_ADMIN"])))
    quark("run", "--bundle", b2, "notpriv", env=env)


def test_privileged_with_every_host_device_is_refused_naming_the_field(quark, bundle):
    b = bundle(["true"])
    edit_config(b, lambda s: cri_privileged(s, host_devices=True))
    before = host_mounts(quark)
    r = quark("create", "--bundle", b, "privdev", check=False)
    assert r.returncode == 1
    assert "linux.resources.devices[0]: allows every host device" in r.stderr
    assert "privileged_without_host_devices" in r.stderr
    assert_nothing_left(quark, "privdev", before)


@pytest.mark.parametrize("mode", ["default", "sandbox", "refuse"])
def test_unconfined_seccomp_under_each_operator_setting(quark, bundle, tmp_path, mode):
    env = dict(os.environ, QUARK_CONFIG=str(tmp_path / "absent.yaml")) if mode == "default" else \
        config_file(tmp_path, f"security:\n  unconfined_seccomp: {mode}\n")
    cid = f"unconf-{mode}"
    b = bundle(["sh", "-c", "grep -E '^Seccomp(_filters)?:' /proc/self/status"])

    def edit(s):
        cri_container(s, seccomp=None)
        # containerd passes io.quark.* pod annotations through: a pod must not forge quark's report
        s["annotations"] = {security.ANNOTATION_PRIVILEGED: "forged", security.ANNOTATION_SECCOMP: "forged"}
    edit_config(b, edit)
    before = host_mounts(quark)
    r = quark("create", "--bundle", b, cid, check=False, env=env)
    if mode == "refuse":
        assert r.returncode == 1
        assert "config.json: linux.seccomp: absent (seccompProfile Unconfined) is refused" in r.stderr
        assert "security.unconfined_seccomp: refuse" in r.stderr
        assert_nothing_left(quark, cid, before)
    else:
        assert r.returncode == 0, r.stderr
        annotations = quark.state(cid)["annotations"]
        assert security.ANNOTATION_PRIVILEGED not in annotations
        report = annotations[security.ANNOTATION_SECCOMP]
        assert report.startswith("quark's base policy only") and "Unconfined" in report
        log = open(os.path.join(quark.root, cid, "supervisor.log")).read()
        assert f"{security.ANNOTATION_SECCOMP}: quark's base policy only" in log
        quark("delete", "--force", cid)
        out = quark("run", "--bundle", b, cid + "-run", env=env).stdout
        assert out.split() == ["Seccomp:", "2", "Seccomp_filters:", "1"]   # what is really applied
    # a container with a profile (RuntimeDefault) runs under every setting, both filters stacked
    b2 = bundle(["sh", "-c", "grep -E '^Seccomp_filters:' /proc/self/status"])
    edit_config(b2, cri_container)
    out = quark("run", "--bundle", b2, cid + "-prof", env=env).stdout
    assert out.split() == ["Seccomp_filters:", "2"]


def test_bad_security_setting_names_the_file_and_field(quark, bundle, tmp_path):
    env = config_file(tmp_path, "security:\n  privileged: maybe\n")
    b = bundle(["true"])
    r = quark("create", "--bundle", b, "badcfg-" + uuid.uuid4().hex[:6], check=False, env=env)
    assert r.returncode == 1 and "config.yaml: security.privileged: 'maybe': expected sandbox or refuse" in r.stderr
    assert quark.ids() == []
