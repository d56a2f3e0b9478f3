"""config.json model: the default spec parses, each class of bad input names its field, `quark spec` works."""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource

import pytest

from qlib.errors import ConfigError, QuarkError
from qvisor import cli
from qvisor.spec import (
    CAPABILITIES,
    RLIMITS,
    BlockIO,
    CpuResources,
    DeviceRule,
    HugepageLimit,
    InterfacePriority,
    Linux,
    MemoryResources,
    Namespace,
    NetworkResources,
    RdmaLimit,
    ThrottleDevice,
    WeightDevice,
    default_spec,
    load_spec,
    make_rootless,
    parse_resources,
    parse_spec,
)

CFG = "/b/config.json"


def _with_seccomp(s: dict, **rule_changes) -> None:
    rule = {"names": ["personality"], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]}
    for key, value in rule_changes.items():
        if key.startswith("arg_"):
            rule["args"][0][key[4:]] = value
        else:
            rule[key] = value
    s["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [rule]}


def _user_ns(s: dict) -> None:
    s["linux"]["namespaces"].append({"type": "user"})


# (id, mutation of default_spec(), field the error must name, text the message must contain)
MUTATIONS = [
    ("no-ociVersion", lambda s: s.pop("ociVersion"), "ociVersion", "is required"),
    ("ociVersion-2", lambda s: s.update(ociVersion="2.0.0"), "ociVersion", "unsupported version"),
    ("no-root", lambda s: s.pop("root"), "root", "is required"),
    ("args-not-list", lambda s: s["process"].update(args="sh"), "process.args", "must be a non-empty list of strings"),
    ("args-empty", lambda s: s["process"].update(args=[]), "process.args", "must be a non-empty list of strings"),
    ("args-missing", lambda s: s["process"].pop("args"), "process.args", "must be a non-empty list of strings"),
    ("relative-cwd", lambda s: s["process"].update(cwd="tmp"), "process.cwd", "absolute path"),
    ("terminal-str", lambda s: s["process"].update(terminal="yes"), "process.terminal", "boolean"),
    ("unknown-cap", lambda s: s["process"]["capabilities"]["bounding"].append("CAP_FOO"),
     "process.capabilities.bounding[3]", 'unknown capability "CAP_FOO"'),
    ("unknown-rlimit", lambda s: s["process"]["rlimits"][0].update(type="RLIMIT_FOO"),
     "process.rlimits[0].type", 'unknown rlimit "RLIMIT_FOO"'),
    ("soft-gt-hard", lambda s: s["process"]["rlimits"][0].update(soft=2048), "process.rlimits[0].soft", "exceeds"),
    ("bool-uid", lambda s: s["process"]["user"].update(uid=True), "process.user.uid", "must be an integer"),
    ("negative-gid", lambda s: s["process"]["user"].update(gid=-1), "process.user.gid", "negative"),
    ("bad-ns-type", lambda s: s["linux"]["namespaces"][2].update(type="foo"),
     "linux.namespaces[2].type", 'unknown namespace type "foo"'),
    ("dup-ns", lambda s: s["linux"]["namespaces"].append({"type": "pid"}),
     "linux.namespaces[5].type", 'duplicate namespace type "pid"'),
    ("relative-ns-path", lambda s: s["linux"]["namespaces"][0].update(path="proc/1/ns/pid"),
     "linux.namespaces[0].path", "absolute path"),
    ("userns-no-maps", _user_ns, "linux.uidMappings", "required when a new user namespace"),
    ("maps-no-userns", lambda s: s["linux"].update(gidMappings=[{"containerID": 0, "hostID": 1000, "size": 1}]),
     "linux.gidMappings", "needs a user namespace"),
    ("relative-mount", lambda s: s["mounts"][0].update(destination="proc"), "mounts[0].destination", "absolute"),
    ("mount-opts-str", lambda s: s["mounts"][1].update(options="ro"), "mounts[1].options", "must be a list"),
    ("bad-seccomp-action", lambda s: _with_seccomp(s, action="SCMP_ACT_NOPE"),
     "linux.seccomp.syscalls[0].action", "unknown seccomp action"),
    ("bad-seccomp-op", lambda s: _with_seccomp(s, arg_op="SCMP_CMP_XX"),
     "linux.seccomp.syscalls[0].args[0].op", "unknown seccomp op"),
    ("bad-seccomp-index", lambda s: _with_seccomp(s, arg_index=6),
     "linux.seccomp.syscalls[0].args[0].index", "between 0 and 5"),
    ("notify-no-listener", lambda s: _with_seccomp(s, action="SCMP_ACT_NOTIFY"),
     "linux.seccomp.listenerPath", "SCMP_ACT_NOTIFY"),
    ("relative-hook", lambda s: s.update(hooks={"prestart": [{"path": "bin/true"}]}),
     "hooks.prestart[0].path", "absolute path"),
    ("hook-timeout-0", lambda s: s.update(hooks={"poststop": [{"path": "/bin/true", "timeout": 0}]}),
     "hooks.poststop[0].timeout", "between 1"),
    ("device-rule-access", lambda s: s["linux"]["resources"]["devices"][0].update(access="rwx"),
     "linux.resources.devices[0].access", "r, w and m"),
    ("device-no-major", lambda s: s["linux"].update(devices=[{"path": "/dev/fuse", "type": "c", "minor": 229}]),
     "linux.devices[0].major", "is required"),
    ("bad-propagation", lambda s: s["linux"].update(rootfsPropagation="weird"),
     "linux.rootfsPropagation", "unknown propagation"),
    ("annotation-int", lambda s: s.update(annotations={"a": 1}), "annotations.a", "must be a string"),
    # runtime-spec 1.2's scheduling fields, checked as runc checks them (sched_setattr(2)'s rules)
    ("sched-policy", lambda s: s["process"].update(scheduler={"policy": "SCHED_FAST"}),
     "process.scheduler.policy", "unknown scheduling policy"),
    ("sched-no-policy", lambda s: s["process"].update(scheduler={"nice": 3}), "process.scheduler.policy",
     "is required"),
    ("sched-nice", lambda s: s["process"].update(scheduler={"policy": "SCHED_BATCH", "nice": 20}),
     "process.scheduler.nice", "between -20 and 19"),
    ("sched-priority-other", lambda s: s["process"].update(scheduler={"policy": "SCHED_OTHER", "priority": 5}),
     "process.scheduler.priority", "only SCHED_FIFO and SCHED_RR"),
    ("sched-priority-fifo", lambda s: s["process"].update(scheduler={"policy": "SCHED_FIFO", "priority": 100}),
     "process.scheduler.priority", "between 1 and 99"),
    ("sched-deadline-fields", lambda s: s["process"].update(scheduler={"policy": "SCHED_RR", "priority": 1,
                                                                       "period": 1000}),
     "process.scheduler", "for SCHED_DEADLINE only"),
    ("sched-flag", lambda s: s["process"].update(scheduler={"policy": "SCHED_OTHER", "flags": ["SCHED_FLAG_FAST"]}),
     "process.scheduler.flags[0]", "unknown scheduling flag"),
    ("ioprio-class", lambda s: s["process"].update(ioPriority={"class": "IOPRIO_CLASS_NONE", "priority": 0}),
     "process.ioPriority.class", "unknown I/O priority class"),
    ("ioprio-level", lambda s: s["process"].update(ioPriority={"class": "IOPRIO_CLASS_BE", "priority": 8}),
     "process.ioPriority.priority", "between 0 and 7"),
    ("ioprio-no-level", lambda s: s["process"].update(ioPriority={"class": "IOPRIO_CLASS_BE"}),
     "process.ioPriority.priority", "is required"),
    ("affinity-text", lambda s: s["process"].update(execCPUAffinity={"final": "0-"}),
     "process.execCPUAffinity.final", "is not a CPU list"),
    ("affinity-order", lambda s: s["process"].update(execCPUAffinity={"initial": "3-1"}),
     "process.execCPUAffinity.initial", "low to high"),
    ("affinity-big", lambda s: s["process"].update(execCPUAffinity={"initial": "8192"}),
     "process.execCPUAffinity.initial", "0 to 8191"),
    ("personality-domain", lambda s: s["linux"].update(personality={"domain": "SVR4"}),
     "linux.personality.domain", "unknown personality domain"),
    ("personality-flags", lambda s: s["linux"].update(personality={"domain": "LINUX", "flags": ["ADDR_NO_RANDOMIZE"]}),
     "linux.personality.flags", "no personality flags"),
    ("timeoffsets-clock", lambda s: (s["linux"]["namespaces"].append({"type": "time"}),
                                     s["linux"].update(timeOffsets={"realtime": {"secs": 1}})),
     "linux.timeOffsets.realtime", "unknown clock"),
    ("timeoffsets-nanosecs", lambda s: (s["linux"]["namespaces"].append({"type": "time"}),
                                        s["linux"].update(timeOffsets={"boottime": {"nanosecs": 10**9}})),
     "linux.timeOffsets.boottime.nanosecs", "between 0 and 999999999"),
    ("timeoffsets-no-timens", lambda s: s["linux"].update(timeOffsets={"monotonic": {"secs": 1}}),
     "linux.timeOffsets", "needs a new time namespace"),
    ("intel-rdt", lambda s: s["linux"].update(intelRdt={"closID": "x"}), "linux.intelRdt", "not supported"),
    ("net-devices", lambda s: s["linux"].update(netDevices={"eth1": {}}), "linux.netDevices", "not supported"),
    ("mpol-mode", lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_NEAR"}),
     "linux.memoryPolicy.mode", "unknown memory policy mode"),
    ("mpol-bind-no-nodes", lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_BIND"}),
     "linux.memoryPolicy.nodes", "needs at least one node"),
    ("mpol-local-nodes", lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_LOCAL", "nodes": "0"}),
     "linux.memoryPolicy.nodes", "takes no nodes"),
    ("mpol-nodes-text", lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_BIND", "nodes": "zero"}),
     "linux.memoryPolicy.nodes", "is not a NUMA node list"),
    ("mpol-flag", lambda s: s["linux"].update(memoryPolicy={"mode": "MPOL_BIND", "nodes": "0", "flags": ["MPOL_F_X"]}),
     "linux.memoryPolicy.flags[0]", "unknown memory policy flag"),
]



def _res(**fields):
    return lambda s: s["linux"]["resources"].update(fields)


# linux.resources beyond memory limits, cpu shares/quota, pids and devices: every field is modelled
# and validated, so a bad value is named here rather than written (or dropped) by the cgroup code
MUTATIONS += [
    ("swappiness-101", _res(memory={"swappiness": 101}), "linux.resources.memory.swappiness", "between 0 and 100"),
    ("oom-killer-str", _res(memory={"disableOOMKiller": "yes"}), "linux.resources.memory.disableOOMKiller",
     "boolean"),
    ("use-hierarchy-int", _res(memory={"useHierarchy": 1}), "linux.resources.memory.useHierarchy", "boolean"),
    ("check-before-update-str", _res(memory={"checkBeforeUpdate": "no"}),
     "linux.resources.memory.checkBeforeUpdate", "boolean"),
    ("kernel-str", _res(memory={"kernel": "64M"}), "linux.resources.memory.kernel", "integer"),
    ("kernel-tcp-float", _res(memory={"kernelTCP": 1.5}), "linux.resources.memory.kernelTCP", "integer"),
    ("cpu-idle-2", _res(cpu={"idle": 2}), "linux.resources.cpu.idle", "between 0 and 1"),
    ("rt-period-negative", _res(cpu={"realtimePeriod": -1}), "linux.resources.cpu.realtimePeriod", "negative"),
    ("rt-runtime-str", _res(cpu={"realtimeRuntime": "1"}), "linux.resources.cpu.realtimeRuntime", "integer"),
    ("blkio-weight-5", _res(blockIO={"weight": 5}), "linux.resources.blockIO.weight", "between 10 and 1000"),
    ("blkio-leaf-weight-2000", _res(blockIO={"leafWeight": 2000}), "linux.resources.blockIO.leafWeight",
     "between 10 and 1000"),
    ("weight-device-leaf-2000", _res(blockIO={"weightDevice": [{"major": 8, "minor": 0, "leafWeight": 2000}]}),
     "linux.resources.blockIO.weightDevice[0].leafWeight", "between 10 and 1000"),
    ("weight-device-no-major", _res(blockIO={"weightDevice": [{"minor": 0, "weight": 100}]}),
     "linux.resources.blockIO.weightDevice[0].major", "is required"),
    ("throttle-no-rate", _res(blockIO={"throttleWriteIOPSDevice": [{"major": 8, "minor": 0}]}),
     "linux.resources.blockIO.throttleWriteIOPSDevice[0].rate", "is required"),
    ("hugepage-size-path", _res(hugepageLimits=[{"pageSize": "2MB/../x", "limit": 1}]),
     "linux.resources.hugepageLimits[0].pageSize", "huge page size"),
    ("hugepage-no-limit", _res(hugepageLimits=[{"pageSize": "2MB"}]), "linux.resources.hugepageLimits[0].limit",
     "is required"),
    ("classid-negative", _res(network={"classID": -1}), "linux.resources.network.classID", "negative"),
    ("ifprio-name-space", _res(network={"priorities": [{"name": "eth 0", "priority": 1}]}),
     "linux.resources.network.priorities[0].name", "without whitespace"),
    ("rdma-handles-str", _res(rdma={"mlx5_0": {"hcaHandles": "3"}}), "linux.resources.rdma.mlx5_0.hcaHandles",
     "integer"),
    ("rdma-device-space", _res(rdma={"mlx 5": {}}), "linux.resources.rdma.mlx 5", "without whitespace"),
    ("unified-escape", _res(unified={"../memory.max": "1"}), "linux.resources.unified.../memory.max",
     "CONTROLLER.PARAMETER"),
    ("unified-int", _res(unified={"memory.max": 1}), "linux.resources.unified.memory.max", "must be a string"),
]

@pytest.mark.parametrize("mutate,field,text", [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_bad_input_names_the_field(mutate, field, text):
    data = default_spec()
    mutate(data)
    with pytest.raises(ConfigError) as exc:
        parse_spec(data, CFG, "/b")
    assert (exc.value.path, exc.value.field) == (CFG, field)
    assert text in exc.value.message
    assert str(exc.value).startswith(f"{CFG}: {field}: ")


def test_default_spec_round_trips():
    data = default_spec()
    spec = parse_spec(copy.deepcopy(data), CFG, "/b")
    assert spec.oci_version == "1.0.2" and spec.hostname == "quark"
    assert spec.root.path == "/b/rootfs" and spec.root.readonly and spec.bundle == "/b"
    p = spec.process
    assert p is not None and p.terminal and p.args == ["sh"] and p.cwd == "/" and p.no_new_privileges
    assert (p.user.uid, p.user.gid) == (0, 0)
    assert p.capabilities is not None and p.capabilities.inheritable == []
    assert p.capabilities.ambient == ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    assert [(r.type, r.soft, r.hard) for r in p.rlimits] == [("RLIMIT_NOFILE", 1024, 1024)]
    assert [m.destination for m in spec.mounts] == ["/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue",
                                                   "/sys", "/sys/fs/cgroup"]
    assert spec.mounts[0].options == [] and "ro" in spec.mounts[5].options
    assert [ns.type for ns in spec.linux.namespaces] == ["pid", "network", "ipc", "uts", "mount"]
    assert spec.linux.resources.devices == [DeviceRule(allow=False, type="a", major=None, minor=None, access="rwm")]
    assert "/proc/kcore" in spec.linux.masked_paths and "/proc/sys" in spec.linux.readonly_paths
    assert spec.raw == data
    assert default_spec() is not default_spec()  # callers may mutate what they get


def test_full_featured_spec_parses():
    data = default_spec()
    data["process"].update(consoleSize={"height": 24, "width": 80}, oomScoreAdj=-500,
                           user={"uid": 1000, "gid": 1000, "umask": 0o22, "additionalGids": [5, 10]})
    data["hooks"] = {"createRuntime": [{"path": "/usr/bin/hook", "args": ["hook", "x"], "timeout": 5}]}
    _user_ns(data)
    data["linux"].update(
        uidMappings=[{"containerID": 0, "hostID": 100000, "size": 65536}],
        gidMappings=[{"containerID": 0, "hostID": 100000, "size": 65536}],
        devices=[{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229, "fileMode": 0o666},
                 {"path": "/dev/myfifo", "type": "p"}],
        resources={"memory": {"limit": 1 << 30, "swap": -1}, "cpu": {"shares": 512, "quota": 50000, "cpus": "0-1"},
                   "pids": {"limit": 64}, "devices": [{"allow": True, "type": "c", "major": 1, "minor": -1}],
                   "unified": {"io.weight": "100"}},
        sysctl={"net.ipv4.ip_forward": "1"}, rootfsPropagation="rslave", cgroupsPath="/quark/x",
        seccomp={"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "architectures": ["SCMP_ARCH_X86_64"],
                 "listenerPath": "/run/seccomp.sock",
                 "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_NOTIFY"},
                              {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "args": [
                                  {"index": 0, "value": 0x10000000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}]})
    spec = parse_spec(data, CFG, "/b")
    p = spec.process
    assert p.console_size == (24, 80) and p.oom_score_adj == -500 and p.user.additional_gids == [5, 10]
    assert spec.hooks.create_runtime[0].timeout == 5 and spec.hooks.prestart == []
    assert spec.linux.uid_mappings[0].host_id == 100000 and spec.linux.gid_mappings[0].size == 65536
    assert spec.linux.devices[1].major == 0 and spec.linux.devices[0].file_mode == 0o666
    res = spec.linux.resources
    assert res.memory.limit == 1 << 30 and res.memory.swap == -1 and res.cpu.cpus == "0-1" and res.pids_limit == 64
    assert res.devices[0].minor is None and res.unified == {"io.weight": "100"}
    sc = spec.linux.seccomp
    assert sc.default_errno_ret == 1 and sc.syscalls[1].args[0].op == "SCMP_CMP_MASKED_EQ"
    assert spec.linux.namespace("user") == Namespace("user", "") and spec.linux.namespace("time") is None


def test_scheduling_fields_parse():
    data = default_spec()
    data["process"].update(scheduler={"policy": "SCHED_FIFO", "priority": 10, "flags": ["SCHED_FLAG_RESET_ON_FORK"]},
                           ioPriority={"class": "IOPRIO_CLASS_IDLE", "priority": 7},
                           execCPUAffinity={"initial": "7", "final": "0-3, 7"})
    p = parse_spec(data, CFG, "/b").process
    assert (p.scheduler.policy, p.scheduler.priority, p.scheduler.nice) == ("SCHED_FIFO", 10, 0)
    assert p.scheduler.flags == ["SCHED_FLAG_RESET_ON_FORK"]
    assert (p.io_priority.io_class, p.io_priority.priority) == ("IOPRIO_CLASS_IDLE", 7)
    assert p.exec_cpu_affinity.initial == {7} and p.exec_cpu_affinity.final == {0, 1, 2, 3, 7}
    data["process"].update(execCPUAffinity={"initial": "", "final": ""})   # "": not set
    p = parse_spec(data, CFG, "/b").process
    assert p.exec_cpu_affinity.initial is None and p.exec_cpu_affinity.final is None
    assert parse_spec(default_spec(), CFG, "/b").process.scheduler is None


def test_personality_and_time_offsets_parse():
    data = default_spec()
    data["linux"]["namespaces"].append({"type": "time"})
    data["linux"].update(personality={"domain": "LINUX32", "flags": []},
                         timeOffsets={"monotonic": {"secs": -5, "nanosecs": 7}, "boottime": {"secs": 86400}})
    lin = parse_spec(data, CFG, "/b").linux
    assert lin.personality == "LINUX32"
    assert lin.time_offsets == {"monotonic": (-5, 7), "boottime": (86400, 0)}


def test_memory_policy_parses():
    data = default_spec()
    data["linux"]["memoryPolicy"] = {"mode": "MPOL_INTERLEAVE", "nodes": "0-2,5", "flags": ["MPOL_F_STATIC_NODES"]}
    mp = parse_spec(data, CFG, "/b").linux.memory_policy
    assert (mp.mode, mp.nodes, mp.flags) == ("MPOL_INTERLEAVE", {0, 1, 2, 5}, ["MPOL_F_STATIC_NODES"])
    data["linux"]["memoryPolicy"] = {"mode": "MPOL_PREFERRED"}   # zero or more nodes
    assert parse_spec(data, CFG, "/b").linux.memory_policy.nodes == frozenset()


def test_every_resource_field_is_modelled():
    res = parse_resources({
        "memory": {"limit": 1 << 30, "reservation": 1 << 29, "swap": 2 << 30, "kernel": 1 << 20, "kernelTCP": 1 << 21,
                   "swappiness": 0, "disableOOMKiller": True, "useHierarchy": False, "checkBeforeUpdate": True},
        "cpu": {"shares": 512, "quota": 1000, "period": 2000, "realtimeRuntime": 300, "realtimePeriod": 4000,
                "cpus": "0", "mems": "0", "idle": 1, "burst": 500},
        "blockIO": {"weight": 10, "leafWeight": 1000,
                    "weightDevice": [{"major": 8, "minor": 0, "weight": 500}],
                    "throttleReadBpsDevice": [{"major": 8, "minor": 0, "rate": 1}],
                    "throttleWriteBpsDevice": [{"major": 8, "minor": 16, "rate": 2}],
                    "throttleReadIOPSDevice": [{"major": 8, "minor": 32, "rate": 3}],
                    "throttleWriteIOPSDevice": [{"major": 8, "minor": 48, "rate": 4}]},
        "hugepageLimits": [{"pageSize": "2MB", "limit": 1 << 22}, {"pageSize": "1GB", "limit": 0}],
        "network": {"classID": 0x100001, "priorities": [{"name": "eth0", "priority": 5}]},
        "rdma": {"mlx5_1": {"hcaHandles": 3}}, "unified": {"memory.high": "max"}}, "r.json")
    assert res.memory == MemoryResources(1 << 30, 1 << 29, 2 << 30, 1 << 20, 1 << 21, 0, True, False, True)
    assert res.cpu == CpuResources(512, 1000, 2000, 300, 4000, "0", "0", 1, 500)
    assert res.block_io == BlockIO(10, 1000, [WeightDevice(8, 0, 500, None)], [ThrottleDevice(8, 0, 1)],
                                   [ThrottleDevice(8, 16, 2)], [ThrottleDevice(8, 32, 3)], [ThrottleDevice(8, 48, 4)])
    assert res.hugepage_limits == [HugepageLimit("2MB", 1 << 22), HugepageLimit("1GB", 0)]
    assert res.network == NetworkResources(0x100001, [InterfacePriority("eth0", 5)])
    assert res.rdma == {"mlx5_1": RdmaLimit(3, None)} and res.unified == {"memory.high": "max"}
    # JSON null is absent, and an empty object sets nothing
    assert parse_resources({"memory": {"swappiness": None}, "blockIO": {}}, "r.json").memory == MemoryResources()


def test_go_zero_values_are_unset_as_runc_reads_them():
    # docker writes "blockIO": {"weight": 0} and "cpu": {"shares": 0} into every spec (seen from
    # docker 20.10): runc and crun skip a zero weight, memory limit or class id; so does quark
    res = parse_resources({
        "memory": {"limit": 0, "reservation": 0, "swap": 0, "kernel": 0, "kernelTCP": 0, "disableOOMKiller": False},
        "cpu": {"shares": 0}, "pids": {"limit": 0},
        "blockIO": {"weight": 0, "leafWeight": 0, "weightDevice": [{"major": 8, "minor": 0, "weight": 0}]},
        "network": {"classID": 0}}, "r.json")
    assert res.memory == MemoryResources()
    assert res.block_io == BlockIO(weight_device=[WeightDevice(8, 0, None, None)])
    assert res.network.class_id is None and res.pids_limit == 0
    # a zero that is not an unset number stays a value: swappiness 0, a hugepage limit of 0
    res = parse_resources({"memory": {"swappiness": 0}, "hugepageLimits": [{"pageSize": "2MB", "limit": 0}]}, "r.json")
    assert res.memory.swappiness == 0 and res.hugepage_limits == [HugepageLimit("2MB", 0)]


def test_partial_spec_gets_defaults():
    spec = parse_spec({"ociVersion": "1.1.0", "root": {"path": "/abs/rootfs"}}, CFG, "/b")
    assert spec.process is None and spec.root.path == "/abs/rootfs" and spec.mounts == []
    assert spec.linux == Linux()


def test_capability_and_rlimit_tables():
    assert CAPABILITIES["CAP_CHOWN"] == 0 and CAPABILITIES["CAP_SYS_ADMIN"] == 21
    assert CAPABILITIES["CAP_CHECKPOINT_RESTORE"] == 40 and len(CAPABILITIES) == 41
    assert RLIMITS["RLIMIT_NOFILE"] == resource.RLIMIT_NOFILE and RLIMITS["RLIMIT_LOCKS"] == 10
    assert len(RLIMITS) == 16


def test_load_spec_resolves_root_against_bundle(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(default_spec()))
    spec = load_spec(str(tmp_path))
    assert spec.root.path == str(tmp_path / "rootfs") and spec.bundle == str(tmp_path)


def test_load_spec_invalid_json_gives_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "ociVersion": "1.0.2",\n  "root": {,}\n}')
    with pytest.raises(ConfigError) as exc:
        load_spec(str(tmp_path))
    assert exc.value.path == str(tmp_path / "config.json")
    assert "invalid JSON at line 3 column" in str(exc.value)


def test_load_spec_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must contain a JSON object"):
        load_spec(str(tmp_path))


def test_load_spec_missing_file(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_spec(str(tmp_path))
    assert exc.value.path == str(tmp_path / "config.json") and "no such file" in str(exc.value)


def test_make_rootless():
    data = make_rootless(default_spec(), 1000, 1001)
    spec = parse_spec(data, CFG, "/b")
    assert spec.linux.namespace("network") is None and spec.linux.namespace("user") is not None
    assert (spec.linux.uid_mappings[0].host_id, spec.linux.gid_mappings[0].host_id) == (1000, 1001)
    sys_mount = next(m for m in spec.mounts if m.destination == "/sys")
    assert sys_mount.type == "none" and sys_mount.source == "/sys" and "rbind" in sys_mount.options
    assert all(not o.startswith(("uid=", "gid=")) for m in spec.mounts for o in m.options)
    assert "resources" not in data["linux"]


@pytest.fixture
def spec_only_cli(monkeypatch):
    # build_parser imports every verb's module; keep this test independent of the other verbs.
    monkeypatch.setattr(cli, "COMMANDS", {"spec": cli.COMMANDS["spec"]})


def test_quark_spec_writes_loadable_config_and_refuses_overwrite(tmp_path, spec_only_cli, capsys):
    assert cli.main(["spec", "--bundle", str(tmp_path)]) == 0
    text = (tmp_path / "config.json").read_text()
    assert text.startswith('{\n\t"ociVersion": "1.0.2"') and json.loads(text) == default_spec()
    assert load_spec(str(tmp_path)).process.args == ["sh"]
    assert cli.main(["spec", "--bundle", str(tmp_path)]) == 1
    assert "exists. Remove it first" in capsys.readouterr().err
    assert (tmp_path / "config.json").read_text() == text


def test_quark_spec_rootless(tmp_path, spec_only_cli):
    assert cli.main(["spec", "--rootless", "--bundle", str(tmp_path)]) == 0
    spec = load_spec(str(tmp_path))
    assert spec.linux.uid_mappings[0].host_id == os.geteuid() and spec.linux.namespace("network") is None


def test_quark_spec_default_bundle_is_cwd(tmp_path, spec_only_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["spec"]) == 0
    assert (tmp_path / "config.json").exists()


def test_quark_spec_missing_bundle(tmp_path):
    from qvisor.commands import spec as spec_cmd
    with pytest.raises(QuarkError, match="does not exist"):
        spec_cmd.run(argparse.Namespace(bundle=str(tmp_path / "nope"), spec_rootless=False))
