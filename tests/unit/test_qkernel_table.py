"""The syscall table, the filter built from it, platform selection and `quark syscalls` — no root."""
from __future__ import annotations

import argparse
import errno
import json
import re
from types import SimpleNamespace

import pytest

from qkernel import config, policy, table
from qkernel.errors import FilterError, UnknownPlatform
from qlib.errors import QuarkError
from qvisor.commands import syscalls as syscalls_cmd

ISSUE_DENIED = ["init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf",
                "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
                "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev",
                "mount", "umount2", "pivot_root", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
                "open_tree", "unshare", "setns", "clone", "open_by_handle_at", "reboot", "swapon",
                "swapoff", "settimeofday", "acct", "quotactl", "lookup_dcookie"]
SOCKET_FAMILY = ["connect", "listen", "accept", "accept4", "getsockname", "getpeername", "setsockopt",
                 "getsockopt"]


def test_issue_policy_is_in_the_table():
    t = table.by_name()
    for name in ISSUE_DENIED:
        assert t[name].fate is table.Fate.DENIED, name
        assert t[name].errno and t[name].reason
    for name in SOCKET_FAMILY + ["sysinfo", "personality"]:
        assert t[name].fate is table.Fate.TRAPPED and t[name].handler is not None, name
    for name in ("socket", "bind"):   # nothing for TSoR to do: never trapped
        assert t[name].fate is table.Fate.NATIVE, name
    assert t["shutdown"].sockmap_only and not t["shutdown"].tsor_only   # (see the test below)
    assert t["clone"].when.mask == table.CLONE_NEWUSER and t["unshare"].when.mask == table.CLONE_NEWUSER
    assert t["read"].fate is table.Fate.NATIVE and t["getpid"].fate is table.Fate.NATIVE


def test_numbers_are_unique_per_arch():
    for arch in ("x86_64", "aarch64"):
        nrs = [s.nr(arch) for s in table.table() if s.nr(arch) is not None]
        assert len(nrs) == len(set(nrs)), arch
    t = table.by_name()
    assert (t["getpid"].x86_64, t["getpid"].aarch64) == (39, 172)
    assert t["open"].aarch64 is None and t["open_tree_attr"].x86_64 == 467


@pytest.mark.parametrize("platform", config.PLATFORMS)
def test_base_filter_compiles(platform, tmp_path):
    out = tmp_path / "filter.pfc"
    with open(out, "w") as f:
        policy.build_base_filter(platform).export_pfc(f)
    pfc = out.read_text()
    assert "# filter for syscall \"bpf\"" in pfc
    trap = "0x7fc00000" if platform == "seccomp" else f"TRACE({policy.TRACE_DATA})"
    assert trap in pfc   # SECCOMP_RET_USER_NOTIF, or SECCOMP_RET_TRACE with quark's data


def _notify_rules(f, tmp_path) -> str:
    with open(tmp_path / "f.pfc", "w") as out:
        f.export_pfc(out)
    return (tmp_path / "f.pfc").read_text()


def test_socket_family_is_trapped_only_for_tsor_and_options_only_at_emulated_levels(tmp_path):
    without = _notify_rules(policy.build_base_filter("seccomp", sockets=False), tmp_path)
    assert "0x7fc00000" in without   # sysinfo, personality
    for name in SOCKET_FAMILY:
        assert f'# filter for syscall "{name}"' not in without, name
    with_tsor = _notify_rules(policy.build_base_filter("seccomp", sockets=True), tmp_path)
    setsockopt = with_tsor.split('# filter for syscall "setsockopt"')[1].split("# filter for syscall")[0]
    # levels IPPROTO_IP (0), IPPROTO_TCP (6), IPPROTO_IPV6 (41); SOL_SOCKET (1) only with SO_DOMAIN & co
    for level in (0, 6, 41, 1):
        assert f"if ($a1.lo32 == {level})" in setsockopt, level
    assert "if ($a2.lo32 == 39)" in setsockopt and "if ($a2.lo32 == 7)" not in setsockopt   # SO_DOMAIN, not SO_SNDBUF
    assert "if ($syscall == 54)\n    action" not in setsockopt   # no unconditional trap


def test_shutdown_is_trapped_only_on_the_sockmap_path_and_only_when_it_sends_a_fin(tmp_path):
    for kw in ({"sockets": False}, {"sockets": True}):
        assert '# filter for syscall "shutdown"' not in _notify_rules(policy.build_base_filter("seccomp", **kw), tmp_path)
    rules = _notify_rules(policy.build_base_filter("seccomp", sockets=False, sockmap=True), tmp_path)
    shutdown = rules.split('# filter for syscall "shutdown"')[1].split("# filter for syscall")[0]
    assert "if ($a1.lo32 == 1)" in shutdown and "if ($a1.lo32 == 2)" in shutdown   # SHUT_WR, SHUT_RDWR
    assert "if ($a1.lo32 == 0)" not in shutdown                                    # SHUT_RD runs natively
    for name in SOCKET_FAMILY:                                   # nothing else of the family
        assert f'# filter for syscall "{name}"' not in rules, name


def rule(names, action, errno_ret=None, args=()):
    return SimpleNamespace(names=names, action=action, errno_ret=errno_ret, args=list(args))


def oci(syscalls, default="SCMP_ACT_ERRNO", **kw):
    d = dict(default_action=default, default_errno_ret=None, architectures=["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
             flags=[], listener_path="", syscalls=syscalls)
    d.update(kw)
    return SimpleNamespace(**d)


def test_bundle_filter_translates_runc_style(tmp_path):
    arg = SimpleNamespace(index=0, value=0x10, value_two=0x10, op="SCMP_CMP_MASKED_EQ")
    same_index = [SimpleNamespace(index=1, value=1, value_two=0, op="SCMP_CMP_EQ"),
                  SimpleNamespace(index=1, value=2, value_two=0, op="SCMP_CMP_EQ")]
    f = policy.build_bundle_filter(oci([
        rule(["read", "write", "no_such_syscall_xyz"], "SCMP_ACT_ALLOW"),
        rule(["personality"], "SCMP_ACT_ALLOW", args=[arg]),
        rule(["socket"], "SCMP_ACT_ALLOW", args=same_index),     # ORed, as runc does
        rule(["mkdir"], "SCMP_ACT_ERRNO"),                       # repeats the default: skipped
    ], flags=["SECCOMP_FILTER_FLAG_LOG"]))
    with open(tmp_path / "b.pfc", "w") as out:
        f.export_pfc(out)
    assert "personality" in (tmp_path / "b.pfc").read_text()


@pytest.mark.parametrize("bad, message", [
    (dict(listener_path="/run/agent.sock"), "listenerPath"),
    (dict(default="SCMP_ACT_NOTIFY"), "SCMP_ACT_NOTIFY"),
    (dict(default="SCMP_ACT_WHATEVER"), "unknown action"),
    (dict(architectures=["SCMP_ARCH_VAX"]), "unknown architecture"),
    (dict(flags=["SECCOMP_FILTER_FLAG_NEW_LISTENER"]), "unsupported flag"),
])
def test_bundle_filter_errors_name_the_field(bad, message):
    with pytest.raises(FilterError, match=message) as e:
        policy.build_bundle_filter(oci([], **bad))
    assert isinstance(e.value, QuarkError)


def test_bundle_filter_rejects_unknown_operator():
    bad = SimpleNamespace(index=0, value=1, value_two=0, op="SCMP_CMP_SOMETIMES")
    with pytest.raises(FilterError, match=r"syscalls\[0\].args: unknown operator"):
        policy.build_bundle_filter(oci([rule(["read"], "SCMP_ACT_ALLOW", args=[bad])]))


def test_load_platform(tmp_path):
    cfg = tmp_path / "config.yaml"
    assert config.load_platform(None, str(cfg)) == "seccomp"
    cfg.write_text("# quark\nplatform: 'ptrace'   # fallback\nsupervisor:\n  platform: seccomp\n")
    assert config.load_platform(None, str(cfg)) == "ptrace"
    assert config.load_platform("seccomp", str(cfg)) == "seccomp"
    with pytest.raises(UnknownPlatform, match="--platform: unknown platform 'kvm'"):
        config.load_platform("kvm", str(cfg))
    cfg.write_text("platform: gvisor\n")
    with pytest.raises(QuarkError, match=f"{cfg}: platform: unknown platform 'gvisor'"):
        config.load_platform(None, str(cfg))
    # real YAML: a block scalar is read, a broken file is an error naming it (never the default)
    cfg.write_text("platform: >-\n  ptrace\n")
    assert config.load_platform(None, str(cfg)) == "ptrace"
    cfg.write_text("platform: [seccomp\n")
    with pytest.raises(QuarkError, match=str(cfg)):
        config.load_platform(None, str(cfg))


def run_cmd(capsys, *argv):
    p = argparse.ArgumentParser()
    syscalls_cmd.add_arguments(p)
    assert syscalls_cmd.run(p.parse_args(list(argv))) == 0
    return capsys.readouterr().out


def test_quark_syscalls_table(capsys):
    out = run_cmd(capsys, "--platform", "seccomp")
    assert "platform: seccomp" in out.splitlines()[0]
    bpf = next(line for line in out.splitlines() if " bpf " in line)
    assert bpf.split()[:5] == ["321", "280", "bpf", "denied", "EPERM:"]
    assert "EPERM if flags has CLONE_NEWUSER" in next(line for line in out.splitlines() if " clone " in line)


def test_quark_syscalls_json(capsys):
    doc = json.loads(run_cmd(capsys, "--format", "json", "--platform", "ptrace"))
    assert doc["platform"] == "ptrace" and "no fd installation" in doc["trapped_via"]
    rows = {r["name"]: r for r in doc["syscalls"]}
    assert rows["io_uring_setup"]["errno"] == "ENOSYS"
    assert rows["getsockopt"]["handler"] == "qkernel.syscalls.sys_socket.handle"
    assert rows["getpid"] == {"name": "getpid", "x86_64": 39, "aarch64": 172, "fate": "native"}
    assert len(rows) == len(table.table()) and errno.EPERM == table.by_name()["mount"].errno


# --- capability grants (Docker's `includes.caps`, limited to the container's own namespaces) ---------

def test_grants_need_the_capability_and_the_containers_own_namespace():
    t = table.by_name()
    for name in ("sethostname", "setdomainname"):
        assert t[name].fate is table.Fate.DENIED
        assert t[name].granted({"CAP_SYS_ADMIN"}, {"uts"})
        assert not t[name].granted({"CAP_SYS_ADMIN"}, {"mount", "pid"})   # the host's UTS namespace
        assert not t[name].granted({"CAP_NET_ADMIN"}, {"uts"})
    for name in ("mount", "umount2", "pivot_root", "open_tree", "move_mount", "mount_setattr"):
        assert t[name].granted({"CAP_SYS_ADMIN"}, {"mount"}) and not t[name].granted(set(), {"mount"}), name
    for name in ("fsopen", "fsmount", "fspick", "fsconfig", "setns", "init_module", "kexec_load", "bpf"):
        assert t[name].grant is None, name   # new filesystems and host-wide calls are never granted
    assert t["reboot"].granted({"CAP_SYS_BOOT"}, {"pid"}) and not t["reboot"].granted({"CAP_SYS_BOOT"}, set())
    # clock adjustment is refused only to a process that could make it
    assert t["adjtimex"].applies({"CAP_SYS_TIME"}, set()) and not t["adjtimex"].applies(set(), set())


def _syscall_section(pfc: str, name: str) -> str:
    return pfc.split(f'# filter for syscall "{name}"')[1].split("# filter for syscall")[0] \
        if f'# filter for syscall "{name}"' in pfc else ""


def test_granted_mount_keeps_only_the_flag_patterns_that_reach_the_host(tmp_path):
    denied = _notify_rules(policy.build_base_filter("seccomp", False), tmp_path)
    mount = _syscall_section(denied, "mount")
    assert "action ERRNO(1);" in mount and "$a3" not in mount   # no grant: mount always EPERM
    assert _syscall_section(denied, "sethostname")
    granted = _notify_rules(policy.build_base_filter("seccomp", False, frozenset({"CAP_SYS_ADMIN"}),
                                                     frozenset({"mount", "uts"})), tmp_path)
    mount = _syscall_section(granted, "mount")
    # EPERM: MS_REMOUNT without MS_BIND; a bind remount without MS_RDONLY; MS_MOVE (also with the
    # magic number 0xC0ED in the top bits, which the kernel drops and whose bits include MS_PRIVATE
    # and MS_SLAVE); trapped (0x7fc00000, SECCOMP_RET_USER_NOTIF): a new filesystem, also with the magic
    rules = {(int(mask, 16), int(value)): action for mask, value, action in
             re.findall(r"if \(\$a3\.lo32 & (0x[0-9a-f]+) == (\d+)\)\n\s+action (\S+);", mount)}
    assert rules == {(0x1020, 0x20): "ERRNO(1)", (0x1021, 0x1020): "ERRNO(1)", (0x1e3020, 0x2000): "ERRNO(1)",
                     (0xFFFF3020, 0xC0ED2000): "ERRNO(1)",
                     (0x1e3020, 0): "0x7fc00000", (0xFFFF3020, 0xC0ED0000): "0x7fc00000"}, mount
    assert _syscall_section(granted, "sethostname") == "" and _syscall_section(granted, "umount2") == ""
    assert "action ERRNO(1);" in _syscall_section(granted, "fsopen")


def test_syscalls_command_shows_the_grant():
    rows = {r["name"]: r for r in syscalls_cmd.rows("seccomp")}
    assert rows["sethostname"]["unless"].startswith("CAP_SYS_ADMIN and its own UTS namespace")
    assert rows["adjtimex"]["when"] == "the process holds CAP_SYS_TIME"
