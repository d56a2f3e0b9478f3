"""config.json never changes the host: settings that would land in a namespace the container does
not own (the runtime's, i.e. the host's) are refused at create, naming the field, and the host's
value is checked unchanged afterwards. Also the namespace rules of the OCI spec: a type that is not
listed is inherited from the runtime, mount namespace included, and a path joins one."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from tests.integration.conftest import cgroup_dirs, edit_config

pytestmark = pytest.mark.root


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def without_namespaces(*types: str):
    def edit(s):
        s["linux"]["namespaces"] = [ns for ns in s["linux"]["namespaces"] if ns["type"] not in types]
    return edit


def refused(quark, b: str, cid: str, *expected: str) -> str:
    r = quark("create", "--bundle", b, cid, check=False)
    assert r.returncode == 1, r.stderr
    assert f"{b}/config.json" in r.stderr and all(e in r.stderr for e in expected), r.stderr
    assert "Traceback" not in r.stderr and quark.ids() == [] and cgroup_dirs(f"/quark/{cid}") == []
    return r.stderr


GUARDED = ["/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/fs/mqueue/queues_max",
           "/proc/sys/kernel/shmmni", "/proc/sys/kernel/msgmax", "/proc/sys/net/ipv4/ip_default_ttl"]


@pytest.fixture(autouse=True)
def host_values_restored():
    """Should quark regress and write into the host, the test fails and the host is put back."""
    before = {p: read(p) for p in GUARDED}
    yield
    for p, value in before.items():
        if read(p) != value:
            with open(p, "w") as f:
                f.write(value)


@pytest.mark.parametrize("field, proc", [("hostname", "/proc/sys/kernel/hostname"),
                                         ("domainname", "/proc/sys/kernel/domainname")])
def test_names_without_a_uts_namespace_are_refused(quark, bundle, field, proc):
    before = read(proc)
    b = bundle(["true"])
    edit_config(b, lambda s: (without_namespaces("uts")(s), s.pop("hostname"), s.__setitem__(field, "probe")))
    refused(quark, b, "uts", f"{field}: unable to set {field} without a private UTS namespace")
    assert read(proc) == before


def test_hostname_in_the_hosts_uts_namespace_joined_by_path_is_refused(quark, bundle):
    before = read("/proc/sys/kernel/hostname")
    b = bundle(["true"])

    def edit(s):
        without_namespaces("uts")(s)
        s["linux"]["namespaces"].append({"type": "uts", "path": "/proc/self/ns/uts"})
        s["hostname"] = "probe"
    edit_config(b, edit)
    refused(quark, b, "utsp", "hostname: unable to set hostname without a private UTS namespace")
    assert read("/proc/sys/kernel/hostname") == before


@pytest.mark.parametrize("key", ["fs.mqueue.queues_max", "kernel.shmmni", "kernel/msgmax"])
def test_ipc_sysctls_without_an_ipc_namespace_are_refused(quark, bundle, key):
    proc = "/proc/sys/" + key.replace(".", "/")
    before = read(proc)
    b = bundle(["true"])
    edit_config(b, lambda s: (without_namespaces("ipc")(s),
                              s["linux"].__setitem__("sysctl", {key: str(int(before) - 1)})))
    refused(quark, b, "ipc", f"linux.sysctl.{key}", "host's IPC namespace")
    assert read(proc) == before


def test_net_sysctls_need_a_network_namespace_of_the_container(quark, bundle):
    proc = "/proc/sys/net/ipv4/ip_default_ttl"
    before = read(proc)
    b = bundle(["true"])
    edit_config(b, lambda s: (without_namespaces("network")(s),
                              s["linux"].__setitem__("sysctl", {"net.ipv4.ip_default_ttl": "33"})))
    refused(quark, b, "net", "linux.sysctl.net.ipv4.ip_default_ttl", "host's network namespace")
    # a path naming the runtime's own network namespace is the host's too (runc's isHostNetNS)
    edit_config(b, lambda s: s["linux"]["namespaces"].append({"type": "network", "path": "/proc/self/ns/net"}))
    refused(quark, b, "netp", "linux.sysctl.net.ipv4.ip_default_ttl", "host's network namespace")
    assert read(proc) == before


@pytest.mark.parametrize("key", ["kernel.hostname", "kernel.domainname"])
def test_name_sysctls_are_always_refused(quark, bundle, key):
    b = bundle(["true"])
    edit_config(b, lambda s: s["linux"].__setitem__("sysctl", {key: "probe"}))
    refused(quark, b, "kname", f"linux.sysctl.{key}", "conflicts with the OCI")


def test_sysctl_keys_spelled_with_slashes(quark, bundle):
    b = bundle(["cat", "/proc/sys/net/ipv4/ip_default_ttl", "/proc/sys/kernel/shmmni"])
    edit_config(b, lambda s: s["linux"].__setitem__("sysctl", {"net/ipv4/ip_default_ttl": "33",
                                                               "kernel/shmmni": "777"}))
    r = quark("run", "--bundle", b, "slash", check=False)
    assert r.returncode == 0 and r.stdout.split() == ["33", "777"], r.stderr


def test_sysctls_apply_without_a_proc_mount_in_the_container(quark, bundle):
    b = bundle(["true"])
    edit_config(b, lambda s: (s.__setitem__("mounts", [m for m in s["mounts"] if m["destination"] != "/proc"]),
                              s["linux"].__setitem__("sysctl", {"kernel.shmmni": "777"})))
    r = quark("run", "--bundle", b, "noproc", check=False)
    assert r.returncode == 0, r.stderr


def test_capabilities_set_in_a_container_without_proc(quark, bundle):
    """/proc/sys/kernel/cap_last_cap is read before pivot_root: after it there may be no /proc."""
    b = bundle(["true"])
    edit_config(b, lambda s: s.__setitem__("mounts", [m for m in s["mounts"] if m["destination"] != "/proc"]))
    r = quark("run", "--bundle", b, "nocap", check=False)
    assert r.returncode == 0 and "cap_last_cap" not in r.stderr, r.stderr


# ---- namespaces not listed are inherited; a path joins ----------------------------------------

def no_mount_settings(s) -> None:
    """Without a new mount namespace nothing may be mounted: a bundle that asks for no mounts."""
    s["mounts"] = []
    s["linux"].pop("maskedPaths", None)
    s["linux"].pop("readonlyPaths", None)
    s["root"]["readonly"] = False


def test_container_without_a_mount_namespace_runs_in_a_chroot(quark, bundle):
    b = bundle(["sleep", "30"])
    with open(os.path.join(b, "rootfs/marker-of-the-rootfs"), "w"):
        pass

    def edit(s):
        without_namespaces("mount")(s)
        no_mount_settings(s)
    edit_config(b, edit)
    quark("run", "-d", "--bundle", b, "nomnt")
    pid = quark.state("nomnt")["pid"]
    assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")   # inherited
    assert os.path.samefile(f"/proc/{pid}/root", os.path.join(b, "rootfs"))
    # an exec'd process enters the same chroot, not the host's root
    r = quark("exec", "nomnt", "ls", "/")
    assert "marker-of-the-rootfs" in r.stdout.split()
    quark("kill", "nomnt", "KILL")
    quark("delete", "--force", "nomnt")
    assert b not in read("/proc/self/mountinfo")


@pytest.mark.parametrize("field, edit", [
    ("mounts", lambda s: None),
    ("linux.maskedPaths", lambda s: s.__setitem__("mounts", [])),
    ("root.readonly", lambda s: (s.__setitem__("mounts", []), s["linux"].pop("maskedPaths"),
                                 s["linux"].pop("readonlyPaths"))),
    ("linux.devices", lambda s: (no_mount_settings(s), s["linux"].__setitem__(
        "devices", [{"path": "/dev/x", "type": "c", "major": 1, "minor": 3}]))),
])
def test_mount_settings_without_a_new_mount_namespace_are_refused(quark, bundle, field, edit):
    b = bundle(["true"])
    edit_config(b, lambda s: (without_namespaces("mount")(s), edit(s)))
    refused(quark, b, "nomnt2", f"{field}: needs a new mount namespace")
    assert b not in read("/proc/self/mountinfo")


def test_joining_a_mount_namespace_by_path(quark, bundle, tmp_path):
    # a process of the test's own in a new mount namespace, whose namespace the container joins
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    try:
        ns = f"/proc/{holder.pid}/ns/mnt"
        for _ in range(100):
            if os.readlink(ns) != os.readlink("/proc/self/ns/mnt"):
                break
            time.sleep(0.02)
        b = bundle(["true"])

        def edit(s):
            without_namespaces("mount")(s)
            no_mount_settings(s)
            s["linux"]["namespaces"].append({"type": "mount", "path": ns})
        edit_config(b, edit)
        quark("create", "--bundle", b, "joinmnt")
        pid = quark.state("joinmnt")["pid"]
        assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink(ns)
        quark("delete", "--force", "joinmnt")
    finally:
        holder.kill()
        holder.wait()


def test_loopback_of_a_new_network_namespace_is_up(quark, bundle):
    # IFF_UP is bit 0 of /sys/class/net/lo/flags
    b = bundle(["cat", "/sys/class/net/lo/flags"])
    r = quark("run", "--bundle", b, "lo", check=False)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip(), 16) & 1


def test_loopback_serves_inside_the_container(quark, bundle):
    b = bundle(["sh", "-c", "nc -l -p 7777 -e echo served & sleep 0.3; nc 127.0.0.1 7777 </dev/null"])
    r = quark("run", "--bundle", b, "lo2", check=False)
    assert r.returncode == 0 and "served" in r.stdout, (r.stdout, r.stderr)


# ---- hooks ---------------------------------------------------------------------------------------

def test_create_container_hooks_run_in_the_container_before_pivot_root(quark, bundle, tmp_path):
    """The OCI spec: createContainer hooks run in the container's namespaces, their path resolves in
    the runtime's (so a host path works: before pivot_root), from the rootfs; a hook without env
    gets the runtime's environment."""
    out = tmp_path / "hook.out"
    hook = tmp_path / "hook.sh"   # a host path, not inside the rootfs
    hook.write_text("#!/bin/sh\ncat >/dev/null\n"
                    f"{{ hostname; readlink /proc/self/ns/mnt; pwd; echo \"env=$QUARK_HOOK_PROBE\"; }} > {out}\n")
    hook.chmod(0o755)
    b = bundle(["true"])
    edit_config(b, lambda s: s.__setitem__("hooks", {"createContainer": [{"path": str(hook)}]}))
    r = quark("create", "--bundle", b, "cch", env={**os.environ, "QUARK_HOOK_PROBE": "from-runtime"}, check=False)
    assert r.returncode == 0, r.stderr
    pid = quark.state("cch")["pid"]
    host, mnt, cwd, env = out.read_text().split("\n")[:4]
    assert host == "quark" != socket.gethostname()
    assert mnt == os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert cwd == os.path.join(b, "rootfs")
    assert env == "env=from-runtime"
    quark("delete", "--force", "cch")


# ---- mounts and devices as runc takes them -----------------------------------------------------

def test_bind_mount_onto_the_root(quark, bundle, tmp_path):
    from tests.support.busybox import make_rootfs
    other = tmp_path / "other-root"
    make_rootfs(str(other))
    (other / "marker-of-the-other-root").write_text("")
    b = bundle(["ls", "/"], readonly=False)
    edit_config(b, lambda s: s["mounts"].insert(0, {"destination": "/", "type": "bind", "source": str(other),
                                                     "options": ["rbind"]}))
    r = quark("run", "--bundle", b, "bindroot", check=False)
    assert r.returncode == 0 and "marker-of-the-other-root" in r.stdout.split(), (r.stdout, r.stderr)


def test_bind_source_in_a_user_namespace_is_opened_as_host_root(quark, tmp_path):
    """The source sits under a directory only the host's root may enter: the mapped root of the
    container could not reach it, the runtime does, as with runc."""
    from tests.support.busybox import make_bundle
    top = tempfile.mkdtemp(prefix="quark-userns-bind-")
    try:
        os.chmod(top, 0o755)
        secret_dir = os.path.join(top, "root-only")
        os.makedirs(os.path.join(secret_dir, "data"))
        os.chmod(secret_dir, 0o700)
        with open(os.path.join(secret_dir, "data", "f"), "w") as f:
            f.write("through the bind\n")
        os.chmod(os.path.join(secret_dir, "data"), 0o755)
        os.chmod(os.path.join(secret_dir, "data", "f"), 0o644)
        b = os.path.join(top, "bundle")
        make_bundle(b, ["cat", "/data/f"], readonly=False)

        def edit(s):
            s["linux"]["namespaces"].append({"type": "user"})
            s["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            s["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            s["mounts"] = [m for m in s["mounts"] if m["type"] not in ("sysfs", "cgroup")]
            s["mounts"].append({"destination": "/data", "type": "bind", "source": os.path.join(secret_dir, "data"),
                                "options": ["rbind", "ro"]})
        edit_config(b, edit)
        subprocess.run(["chown", "-R", "100000:100000", os.path.join(b, "rootfs")], check=True)
        r = quark("run", "--bundle", b, "usrbind", check=False)
        assert r.returncode == 0 and r.stdout == "through the bind\n", (r.stdout, r.stderr)
    finally:
        shutil.rmtree(top)


def test_tmpfs_without_mode_keeps_the_mode_of_its_mount_point(quark, bundle):
    b = bundle(["stat", "-c", "%a", "/private", "/open"])
    os.makedirs(os.path.join(b, "rootfs/private"), mode=0o700)
    os.chmod(os.path.join(b, "rootfs/private"), 0o711)
    edit_config(b, lambda s: s["mounts"].extend([
        {"destination": "/private", "type": "tmpfs", "source": "tmpfs", "options": ["size=1m"]},
        {"destination": "/open", "type": "tmpfs", "source": "tmpfs", "options": ["mode=1777"]}]))
    r = quark("run", "--bundle", b, "tmpmode", check=False)
    assert r.returncode == 0 and r.stdout.split() == ["711", "1777"], (r.stdout, r.stderr)


def test_device_path_with_a_trailing_slash(quark, bundle):
    b = bundle(["stat", "-c", "%F %t:%T", "/dev/extra-null"])
    edit_config(b, lambda s: s["linux"].__setitem__("devices", [
        {"path": "/dev/extra-null/", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666}]))
    r = quark("run", "--bundle", b, "devslash", check=False)
    assert r.returncode == 0 and r.stdout.strip() == "character special file 1:3", (r.stdout, r.stderr)


@pytest.mark.parametrize("field, edit", [
    ("root.path", lambda s: s["root"].__setitem__("path", "root\0fs")),
    ("mounts[0].source", lambda s: s["mounts"][0].__setitem__("source", "pr\0oc")),
    ("process.args[0]", lambda s: s["process"].__setitem__("args", ["tr\0ue"])),
    ("process.env[0]", lambda s: s["process"]["env"].__setitem__(0, "A=\0")),
    ("process.cwd", lambda s: s["process"].__setitem__("cwd", "/\0")),
    ("hostname", lambda s: s.__setitem__("hostname", "a\0b")),
    ("linux.sysctl", lambda s: s["linux"].__setitem__("sysctl", {"kernel.shm\0mni": "1"})),
])
def test_a_nul_in_a_string_is_a_config_error_naming_the_field(quark, bundle, field, edit):
    b = bundle(["true"])
    edit_config(b, edit)
    r = quark("create", "--bundle", b, "nul", check=False)
    assert r.returncode == 1 and f"config.json: {field}: must not contain a NUL character" in r.stderr, r.stderr
    assert "embedded null" not in r.stderr and "Error:" not in r.stderr
    assert quark.ids() == []
