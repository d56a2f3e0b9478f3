"""The OCI runtime-spec config.json model (runtime-spec 1.0.2, plus the 1.1 fields quark uses).

`load_spec(bundle)` reads `<bundle>/config.json` into the dataclasses below and validates it.
Every problem is a ConfigError that names the file and the field path (`process.args`,
`linux.namespaces[2].type`), so a user can fix the bundle without reading quark's code.

Unknown keys are ignored: the spec allows extensions and runc ignores them too. JSON null
counts as absent, as it does for Go's encoding/json, which wrote most configs we will meet.
`default_spec()` is what `quark spec` writes: runc 1.1's example config.
"""
from __future__ import annotations

import json
import os
import re
import resource
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from qvisor.errors import ConfigError

_CAP_NAMES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)
# Capability name -> bit number (linux/capability.h order, CAP_CHOWN=0 .. CAP_CHECKPOINT_RESTORE=40).
CAPABILITIES: dict[str, int] = {f"CAP_{name}": bit for bit, name in enumerate(_CAP_NAMES)}

# The Linux numbers back up constants this Python build lacks (it has no RLIMIT_LOCKS).
_LINUX_RLIMITS = ("CPU", "FSIZE", "DATA", "STACK", "CORE", "RSS", "NPROC", "NOFILE", "MEMLOCK",
                  "AS", "LOCKS", "SIGPENDING", "MSGQUEUE", "NICE", "RTPRIO", "RTTIME")
RLIMITS: dict[str, int] = {f"RLIMIT_{n}": getattr(resource, f"RLIMIT_{n}", i)
                           for i, n in enumerate(_LINUX_RLIMITS)}

NAMESPACE_TYPES = ("pid", "network", "mount", "ipc", "uts", "user", "cgroup", "time")
# namespace type -> its name under /proc/PID/ns/
PROC_NS_NAMES = {"user": "user", "mount": "mnt", "pid": "pid", "network": "net", "ipc": "ipc", "uts": "uts",
                 "cgroup": "cgroup", "time": "time"}
SECCOMP_ACTIONS = ("SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD", "SCMP_ACT_TRAP",
                   "SCMP_ACT_ERRNO", "SCMP_ACT_TRACE", "SCMP_ACT_ALLOW", "SCMP_ACT_LOG", "SCMP_ACT_NOTIFY")
SECCOMP_OPS = ("SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_LE", "SCMP_CMP_EQ", "SCMP_CMP_GE",
               "SCMP_CMP_GT", "SCMP_CMP_MASKED_EQ")
PROPAGATIONS = ("", "private", "rprivate", "slave", "rslave", "shared", "rshared",
                "unbindable", "runbindable")
RLIM_INFINITY = 2**64 - 1  # how the spec (a uint64) spells "unlimited"


@dataclass
class User:
    uid: int = 0
    gid: int = 0
    umask: int | None = None
    additional_gids: list[int] = field(default_factory=list)


@dataclass
class Capabilities:
    bounding: list[str] = field(default_factory=list)
    effective: list[str] = field(default_factory=list)
    inheritable: list[str] = field(default_factory=list)
    permitted: list[str] = field(default_factory=list)
    ambient: list[str] = field(default_factory=list)


@dataclass
class Rlimit:
    type: str = ""
    soft: int = 0
    hard: int = 0


@dataclass
class Process:
    terminal: bool = False
    console_size: tuple[int, int] | None = None  # (height, width)
    user: User = field(default_factory=User)
    args: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    cwd: str = "/"
    capabilities: Capabilities | None = None
    rlimits: list[Rlimit] = field(default_factory=list)
    no_new_privileges: bool = False
    oom_score_adj: int | None = None
    apparmor_profile: str = ""
    selinux_label: str = ""


@dataclass
class Root:
    path: str = ""
    readonly: bool = False


@dataclass
class IDMapping:
    container_id: int = 0
    host_id: int = 0
    size: int = 0


@dataclass
class Mount:
    destination: str = ""
    type: str = ""
    source: str = ""
    options: list[str] = field(default_factory=list)
    uid_mappings: list[IDMapping] = field(default_factory=list)
    gid_mappings: list[IDMapping] = field(default_factory=list)


@dataclass
class Hook:
    path: str = ""
    args: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    timeout: int | None = None


@dataclass
class Hooks:
    prestart: list[Hook] = field(default_factory=list)
    create_runtime: list[Hook] = field(default_factory=list)
    create_container: list[Hook] = field(default_factory=list)
    start_container: list[Hook] = field(default_factory=list)
    poststart: list[Hook] = field(default_factory=list)
    poststop: list[Hook] = field(default_factory=list)


@dataclass
class Namespace:
    type: str = ""
    path: str = ""  # "" = create a new namespace; otherwise join the one at this path


@dataclass
class Device:
    path: str = ""
    type: str = ""  # 'c', 'b', 'u' or 'p'
    major: int = 0
    minor: int = 0
    file_mode: int | None = None
    uid: int | None = None
    gid: int | None = None


@dataclass
class DeviceRule:
    allow: bool = False
    type: str = "a"
    major: int | None = None  # None = any (the spec's -1 or absent)
    minor: int | None = None
    access: str = "rwm"


@dataclass
class MemoryResources:
    limit: int | None = None
    reservation: int | None = None
    swap: int | None = None
    kernel: int | None = None
    kernel_tcp: int | None = None
    swappiness: int | None = None
    disable_oom_killer: bool = False
    use_hierarchy: bool | None = None
    check_before_update: bool = False


@dataclass
class CpuResources:
    shares: int | None = None
    quota: int | None = None
    period: int | None = None
    realtime_runtime: int | None = None
    realtime_period: int | None = None
    cpus: str = ""
    mems: str = ""
    idle: int | None = None


@dataclass
class WeightDevice:
    major: int = 0
    minor: int = 0
    weight: int | None = None
    leaf_weight: int | None = None


@dataclass
class ThrottleDevice:
    major: int = 0
    minor: int = 0
    rate: int = 0


# blockIO's throttle lists: OCI key -> BlockIO attribute
THROTTLES = {"throttleReadBpsDevice": "throttle_read_bps", "throttleWriteBpsDevice": "throttle_write_bps",
             "throttleReadIOPSDevice": "throttle_read_iops", "throttleWriteIOPSDevice": "throttle_write_iops"}


@dataclass
class BlockIO:
    weight: int | None = None
    leaf_weight: int | None = None
    weight_device: list[WeightDevice] = field(default_factory=list)
    throttle_read_bps: list[ThrottleDevice] = field(default_factory=list)
    throttle_write_bps: list[ThrottleDevice] = field(default_factory=list)
    throttle_read_iops: list[ThrottleDevice] = field(default_factory=list)
    throttle_write_iops: list[ThrottleDevice] = field(default_factory=list)


@dataclass
class HugepageLimit:
    page_size: str = ""  # "2MB", "1GB": the kernel's name in hugetlb.<size>.* files
    limit: int = 0


@dataclass
class InterfacePriority:
    name: str = ""
    priority: int = 0


@dataclass
class NetworkResources:
    class_id: int | None = None
    priorities: list[InterfacePriority] = field(default_factory=list)


@dataclass
class RdmaLimit:
    hca_handles: int | None = None
    hca_objects: int | None = None


@dataclass
class Resources:
    memory: MemoryResources | None = None
    cpu: CpuResources | None = None
    pids_limit: int | None = None
    devices: list[DeviceRule] = field(default_factory=list)
    block_io: BlockIO | None = None
    hugepage_limits: list[HugepageLimit] = field(default_factory=list)
    network: NetworkResources | None = None
    rdma: dict[str, RdmaLimit] = field(default_factory=dict)  # device name -> its limits
    unified: dict[str, str] = field(default_factory=dict)     # cgroup v2 file name -> value


@dataclass
class SeccompArg:
    index: int = 0
    value: int = 0
    value_two: int = 0
    op: str = ""


@dataclass
class SyscallRule:
    names: list[str] = field(default_factory=list)
    action: str = ""
    errno_ret: int | None = None
    args: list[SeccompArg] = field(default_factory=list)


@dataclass
class Seccomp:
    default_action: str = ""
    default_errno_ret: int | None = None
    architectures: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    listener_path: str = ""
    listener_metadata: str = ""
    syscalls: list[SyscallRule] = field(default_factory=list)


@dataclass
class Linux:
    namespaces: list[Namespace] = field(default_factory=list)
    uid_mappings: list[IDMapping] = field(default_factory=list)
    gid_mappings: list[IDMapping] = field(default_factory=list)
    devices: list[Device] = field(default_factory=list)
    cgroups_path: str = ""
    resources: Resources = field(default_factory=Resources)
    sysctl: dict[str, str] = field(default_factory=dict)
    seccomp: Seccomp | None = None
    masked_paths: list[str] = field(default_factory=list)
    readonly_paths: list[str] = field(default_factory=list)
    rootfs_propagation: str = ""
    mount_label: str = ""
    personality: dict | None = None

    def namespace(self, type: str) -> Namespace | None:
        return next((ns for ns in self.namespaces if ns.type == type), None)

    def new_namespace(self, type: str) -> bool:
        """Is a namespace of `type` made for the container (listed, without a path to join)?"""
        ns = self.namespace(type)
        return ns is not None and not ns.path


def sysctl_key(key: str) -> str:
    """sysctl(8) also spells keys with '/' (net/ipv4/conf/eth0.100/rp_filter); this is the dotted
    form (net.ipv4.conf.eth0/100.rp_filter), in which a '.' inside a component becomes '/'."""
    first = next((c for c in key if c in "./"), ".")
    return key if first == "." else key.translate(str.maketrans("./", "/."))


@dataclass
class Spec:
    oci_version: str = "1.0.2"
    process: Process | None = None
    root: Root = field(default_factory=Root)
    hostname: str = ""
    domainname: str = ""
    mounts: list[Mount] = field(default_factory=list)
    hooks: Hooks = field(default_factory=Hooks)
    annotations: dict[str, str] = field(default_factory=dict)
    linux: Linux = field(default_factory=Linux)
    bundle: str = ""
    raw: dict = field(default_factory=dict)


# ---- validation: every check is (reader, field path, value) -> parsed value ----

_MISSING: Any = object()
Check = Callable[["_Reader", str, Any], Any]


class _Reader:
    """Knows which file is being read, so a check only has to know its field path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> NoReturn:
        raise ConfigError(self.path, where, message)

    def get(self, obj: dict, prefix: str, key: str, check: Check, default: Any = _MISSING) -> Any:
        where = f"{prefix}.{key}" if prefix else key
        value = obj.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(where, "is required")
            return default
        return check(self, where, value)


def _str(r: _Reader, f: str, v: Any) -> str:
    if not isinstance(v, str):
        r.fail(f, "must be a string")
    # the kernel takes C strings: a NUL would cut a path or a name short, or fail half-way through
    # set-up with an error that names nothing
    if "\0" in v:
        r.fail(f, "must not contain a NUL character")
    return v


def _bool(r: _Reader, f: str, v: Any) -> bool:
    if not isinstance(v, bool):
        r.fail(f, "must be a boolean")
    return v


def _obj(r: _Reader, f: str, v: Any) -> dict:
    if not isinstance(v, dict):
        r.fail(f, "must be an object")
    return v


def _int(lo: int, hi: int) -> Check:
    def check(r: _Reader, f: str, v: Any) -> int:
        # bool is an int subclass in Python, but JSON true is never a valid number.
        if isinstance(v, bool) or not isinstance(v, int):
            r.fail(f, "must be an integer")
        if v < lo and lo == 0:
            r.fail(f, f"must not be negative, got {v}")
        if not lo <= v <= hi:
            r.fail(f, f"must be between {lo} and {hi}, got {v}")
        return v
    return check


_U32, _U64, _I64 = _int(0, 2**32 - 1), _int(0, 2**64 - 1), _int(-2**63, 2**63 - 1)


def _list(item: Check) -> Check:
    def check(r: _Reader, f: str, v: Any) -> list:
        if not isinstance(v, list):
            r.fail(f, "must be a list")
        return [item(r, f"{f}[{i}]", x) for i, x in enumerate(v)]
    return check


def _nonempty_strs(r: _Reader, f: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not v:
        r.fail(f, "must be a non-empty list of strings")
    return [_str(r, f"{f}[{i}]", x) for i, x in enumerate(v)]


def _str_map(r: _Reader, f: str, v: Any) -> dict[str, str]:
    return {_str(r, f, k): _str(r, f"{f}.{k}", x) for k, x in _obj(r, f, v).items()}


def _abs(r: _Reader, f: str, v: Any) -> str:
    if not _str(r, f, v).startswith("/"):
        r.fail(f, f"must be an absolute path, got {json.dumps(v)}")
    return v


def _opt_abs(r: _Reader, f: str, v: Any) -> str:
    return _abs(r, f, v) if _str(r, f, v) else v  # "" means "not set" in Go-written configs


def _one_of(choices: Any, what: str) -> Check:
    def check(r: _Reader, f: str, v: Any) -> str:
        if _str(r, f, v) not in choices:
            r.fail(f, f"unknown {what} {json.dumps(v)}")
        return v
    return check


def _no_duplicates(r: _Reader, f: str, types: list[str], what: str) -> None:
    for i, t in enumerate(types):
        if t in types[:i]:
            r.fail(f"{f}[{i}].type", f"duplicate {what} {json.dumps(t)}")


def _user(r: _Reader, f: str, v: Any) -> User:
    d = _obj(r, f, v)
    # uid/gid default to 0 rather than being required: runc (Go zero values) accepts that too.
    return User(uid=r.get(d, f, "uid", _U32, 0), gid=r.get(d, f, "gid", _U32, 0),
                umask=r.get(d, f, "umask", _U32, None),
                additional_gids=r.get(d, f, "additionalGids", _list(_U32), []))


def _console_size(r: _Reader, f: str, v: Any) -> tuple[int, int]:
    d = _obj(r, f, v)
    return (r.get(d, f, "height", _U32), r.get(d, f, "width", _U32))


def _capabilities(r: _Reader, f: str, v: Any) -> Capabilities:
    d = _obj(r, f, v)
    names = _list(_one_of(CAPABILITIES, "capability"))
    return Capabilities(**{k: r.get(d, f, k, names, [])
                           for k in ("bounding", "effective", "inheritable", "permitted", "ambient")})


def _rlimit(r: _Reader, f: str, v: Any) -> Rlimit:
    d = _obj(r, f, v)
    rl = Rlimit(type=r.get(d, f, "type", _one_of(RLIMITS, "rlimit")),
                soft=r.get(d, f, "soft", _U64), hard=r.get(d, f, "hard", _U64))
    if rl.soft > rl.hard:  # setrlimit(2) would fail with EINVAL inside the container
        r.fail(f"{f}.soft", f"soft limit {rl.soft} exceeds hard limit {rl.hard}")
    return rl


def _process(r: _Reader, f: str, v: Any) -> Process:
    d = _obj(r, f, v)
    p = Process(
        terminal=r.get(d, f, "terminal", _bool, False),
        console_size=r.get(d, f, "consoleSize", _console_size, None),
        user=r.get(d, f, "user", _user, User()),
        args=_nonempty_strs(r, f"{f}.args", d.get("args")),  # missing gets the same message
        env=r.get(d, f, "env", _list(_str), []),
        cwd=r.get(d, f, "cwd", _abs),
        capabilities=r.get(d, f, "capabilities", _capabilities, None),
        rlimits=r.get(d, f, "rlimits", _list(_rlimit), []),
        no_new_privileges=r.get(d, f, "noNewPrivileges", _bool, False),
        oom_score_adj=r.get(d, f, "oomScoreAdj", _int(-1000, 1000), None),
        apparmor_profile=r.get(d, f, "apparmorProfile", _str, ""),
        selinux_label=r.get(d, f, "selinuxLabel", _str, ""))
    _no_duplicates(r, f"{f}.rlimits", [rl.type for rl in p.rlimits], "rlimit")
    return p


def _root(r: _Reader, f: str, v: Any) -> Root:
    d = _obj(r, f, v)
    path = r.get(d, f, "path", _str)
    if not path:
        r.fail(f"{f}.path", "must not be empty")
    return Root(path=path, readonly=r.get(d, f, "readonly", _bool, False))


def _idmap(r: _Reader, f: str, v: Any) -> IDMapping:
    d = _obj(r, f, v)
    return IDMapping(container_id=r.get(d, f, "containerID", _U32), host_id=r.get(d, f, "hostID", _U32),
                     size=r.get(d, f, "size", _int(1, 2**32 - 1)))


def _mount(r: _Reader, f: str, v: Any) -> Mount:
    d = _obj(r, f, v)
    return Mount(destination=r.get(d, f, "destination", _abs), type=r.get(d, f, "type", _str, ""),
                 source=r.get(d, f, "source", _str, ""), options=r.get(d, f, "options", _list(_str), []),
                 uid_mappings=r.get(d, f, "uidMappings", _list(_idmap), []),
                 gid_mappings=r.get(d, f, "gidMappings", _list(_idmap), []))


def _hook(r: _Reader, f: str, v: Any) -> Hook:
    d = _obj(r, f, v)
    return Hook(path=r.get(d, f, "path", _abs), args=r.get(d, f, "args", _list(_str), []),
                env=r.get(d, f, "env", _list(_str), []), timeout=r.get(d, f, "timeout", _int(1, 2**63 - 1), None))


def _hooks(r: _Reader, f: str, v: Any) -> Hooks:
    d = _obj(r, f, v)
    hooks = _list(_hook)
    return Hooks(prestart=r.get(d, f, "prestart", hooks, []), create_runtime=r.get(d, f, "createRuntime", hooks, []),
                 create_container=r.get(d, f, "createContainer", hooks, []),
                 start_container=r.get(d, f, "startContainer", hooks, []),
                 poststart=r.get(d, f, "poststart", hooks, []), poststop=r.get(d, f, "poststop", hooks, []))


def _namespace(r: _Reader, f: str, v: Any) -> Namespace:
    d = _obj(r, f, v)
    return Namespace(type=r.get(d, f, "type", _one_of(NAMESPACE_TYPES, "namespace type")),
                     path=r.get(d, f, "path", _opt_abs, ""))


def _device(r: _Reader, f: str, v: Any) -> Device:
    d = _obj(r, f, v)
    kind = r.get(d, f, "type", _one_of(("c", "b", "u", "p"), "device type"))
    number = _int(0, 2**63 - 1)
    # A FIFO has no device numbers; every other node needs both to be created.
    default = 0 if kind == "p" else _MISSING
    # "/dev/fuse/" names /dev/fuse (runc cleans the path too)
    return Device(path=os.path.normpath(r.get(d, f, "path", _abs)), type=kind, major=r.get(d, f, "major", number, default),
                  minor=r.get(d, f, "minor", number, default), file_mode=r.get(d, f, "fileMode", _U32, None),
                  uid=r.get(d, f, "uid", _U32, None), gid=r.get(d, f, "gid", _U32, None))


def _device_rule(r: _Reader, f: str, v: Any) -> DeviceRule:
    d = _obj(r, f, v)
    number = _int(-1, 2**63 - 1)
    rule = DeviceRule(allow=r.get(d, f, "allow", _bool),
                      type=r.get(d, f, "type", _one_of(("a", "c", "b"), "device type"), "a"),
                      major=r.get(d, f, "major", number, None), minor=r.get(d, f, "minor", number, None),
                      access=r.get(d, f, "access", _str, "rwm"))  # empty means all, as in runc
    if not rule.access or set(rule.access) - set("rwm"):
        r.fail(f"{f}.access", f"must be a combination of r, w and m, got {json.dumps(rule.access)}")
    # -1 is the Go spelling of "any"; one spelling (None) is simpler for the cgroup code.
    rule.major = None if rule.major == -1 else rule.major
    rule.minor = None if rule.minor == -1 else rule.minor
    return rule


def _memory(r: _Reader, f: str, v: Any) -> MemoryResources:
    d = _obj(r, f, v)
    return MemoryResources(
        limit=r.get(d, f, "limit", _I64, None), reservation=r.get(d, f, "reservation", _I64, None),
        swap=r.get(d, f, "swap", _I64, None), kernel=r.get(d, f, "kernel", _I64, None),
        kernel_tcp=r.get(d, f, "kernelTCP", _I64, None), swappiness=r.get(d, f, "swappiness", _int(0, 100), None),
        disable_oom_killer=r.get(d, f, "disableOOMKiller", _bool, False),
        use_hierarchy=r.get(d, f, "useHierarchy", _bool, None),
        check_before_update=r.get(d, f, "checkBeforeUpdate", _bool, False))


def _cpu(r: _Reader, f: str, v: Any) -> CpuResources:
    d = _obj(r, f, v)
    return CpuResources(
        shares=r.get(d, f, "shares", _U64, None), quota=r.get(d, f, "quota", _I64, None),
        period=r.get(d, f, "period", _U64, None), realtime_runtime=r.get(d, f, "realtimeRuntime", _I64, None),
        realtime_period=r.get(d, f, "realtimePeriod", _U64, None), cpus=r.get(d, f, "cpus", _str, ""),
        mems=r.get(d, f, "mems", _str, ""),
        idle=r.get(d, f, "idle", _int(0, 1), None))  # the kernel's cpu.idle takes 0 or 1


_BLKIO_WEIGHT = _int(10, 1000)  # the kernel's range for blkio (and BFQ) weights


def _weight_device(r: _Reader, f: str, v: Any) -> WeightDevice:
    d = _obj(r, f, v)
    return WeightDevice(major=r.get(d, f, "major", _I64), minor=r.get(d, f, "minor", _I64),
                        weight=r.get(d, f, "weight", _BLKIO_WEIGHT, None),
                        leaf_weight=r.get(d, f, "leafWeight", _BLKIO_WEIGHT, None))


def _throttle_device(r: _Reader, f: str, v: Any) -> ThrottleDevice:
    d = _obj(r, f, v)
    return ThrottleDevice(major=r.get(d, f, "major", _I64), minor=r.get(d, f, "minor", _I64),
                          rate=r.get(d, f, "rate", _U64))


def _block_io(r: _Reader, f: str, v: Any) -> BlockIO:
    d = _obj(r, f, v)
    throttles = {attr: r.get(d, f, key, _list(_throttle_device), []) for key, attr in THROTTLES.items()}
    return BlockIO(weight=r.get(d, f, "weight", _BLKIO_WEIGHT, None),
                   leaf_weight=r.get(d, f, "leafWeight", _BLKIO_WEIGHT, None),
                   weight_device=r.get(d, f, "weightDevice", _list(_weight_device), []), **throttles)


def _hugepage_limit(r: _Reader, f: str, v: Any) -> HugepageLimit:
    d = _obj(r, f, v)
    size = r.get(d, f, "pageSize", _str)
    # it becomes part of a file name (hugetlb.<size>.max): only the kernel's spelling may pass
    if not re.fullmatch(r"[0-9]+[KMGTP]B", size):
        r.fail(f"{f}.pageSize", f'must be a huge page size such as "2MB" or "1GB", got {json.dumps(size)}')
    return HugepageLimit(page_size=size, limit=r.get(d, f, "limit", _U64))


def _word(r: _Reader, f: str, v: Any) -> str:
    """A name the kernel reads from a "name value" line: non-empty, no whitespace."""
    if not _str(r, f, v) or any(c.isspace() for c in v):
        r.fail(f, f"must be a non-empty name without whitespace, got {json.dumps(v)}")
    return v


def _network(r: _Reader, f: str, v: Any) -> NetworkResources:
    d = _obj(r, f, v)

    def priority(r: _Reader, f: str, v: Any) -> InterfacePriority:
        p = _obj(r, f, v)
        return InterfacePriority(name=r.get(p, f, "name", _word), priority=r.get(p, f, "priority", _U32))
    return NetworkResources(class_id=r.get(d, f, "classID", _U32, None),
                            priorities=r.get(d, f, "priorities", _list(priority), []))


def _rdma(r: _Reader, f: str, v: Any) -> dict[str, RdmaLimit]:
    limits = {}
    for device, x in _obj(r, f, v).items():
        where = f"{f}.{device}"
        d = _obj(r, where, x)
        limits[_word(r, where, device)] = RdmaLimit(hca_handles=r.get(d, where, "hcaHandles", _U32, None),
                                                   hca_objects=r.get(d, where, "hcaObjects", _U32, None))
    return limits


def _unified(r: _Reader, f: str, v: Any) -> dict[str, str]:
    files = _str_map(r, f, v)
    for key in files:
        # a key is a file in the container's cgroup directory: nothing that leads out of it
        if not re.fullmatch(r"[a-z0-9_]+\.[A-Za-z0-9_.]+", key):
            r.fail(f"{f}.{key}", "must be a cgroup file name in the form CONTROLLER.PARAMETER")
    return files


def _resources(r: _Reader, f: str, v: Any) -> Resources:
    d = _obj(r, f, v)
    pids = r.get(d, f, "pids", _obj, None)
    return Resources(
        memory=r.get(d, f, "memory", _memory, None), cpu=r.get(d, f, "cpu", _cpu, None),
        pids_limit=None if pids is None else r.get(pids, f"{f}.pids", "limit", _I64),
        devices=r.get(d, f, "devices", _list(_device_rule), []),
        block_io=r.get(d, f, "blockIO", _block_io, None),
        hugepage_limits=r.get(d, f, "hugepageLimits", _list(_hugepage_limit), []),
        network=r.get(d, f, "network", _network, None), rdma=r.get(d, f, "rdma", _rdma, {}),
        unified=r.get(d, f, "unified", _unified, {}))


def _seccomp_arg(r: _Reader, f: str, v: Any) -> SeccompArg:
    d = _obj(r, f, v)
    return SeccompArg(index=r.get(d, f, "index", _int(0, 5)), value=r.get(d, f, "value", _U64),
                      value_two=r.get(d, f, "valueTwo", _U64, 0),
                      op=r.get(d, f, "op", _one_of(SECCOMP_OPS, "seccomp op")))


def _syscall(r: _Reader, f: str, v: Any) -> SyscallRule:
    d = _obj(r, f, v)
    return SyscallRule(names=_nonempty_strs(r, f"{f}.names", d.get("names")),
                       action=r.get(d, f, "action", _one_of(SECCOMP_ACTIONS, "seccomp action")),
                       errno_ret=r.get(d, f, "errnoRet", _U32, None),
                       args=r.get(d, f, "args", _list(_seccomp_arg), []))


def _seccomp(r: _Reader, f: str, v: Any) -> Seccomp:
    d = _obj(r, f, v)
    s = Seccomp(default_action=r.get(d, f, "defaultAction", _one_of(SECCOMP_ACTIONS, "seccomp action")),
                default_errno_ret=r.get(d, f, "defaultErrnoRet", _U32, None),
                architectures=r.get(d, f, "architectures", _list(_str), []),
                flags=r.get(d, f, "flags", _list(_str), []),
                listener_path=r.get(d, f, "listenerPath", _opt_abs, ""),
                listener_metadata=r.get(d, f, "listenerMetadata", _str, ""),
                syscalls=r.get(d, f, "syscalls", _list(_syscall), []))
    # The spec requires somewhere to send the notify fd; without it the rule could never be answered.
    if not s.listener_path and any(rule.action == "SCMP_ACT_NOTIFY" for rule in s.syscalls):
        r.fail(f"{f}.listenerPath", "is required when a rule uses SCMP_ACT_NOTIFY")
    return s


def _linux(r: _Reader, f: str, v: Any) -> Linux:
    d = _obj(r, f, v)
    lin = Linux(
        namespaces=r.get(d, f, "namespaces", _list(_namespace), []),
        uid_mappings=r.get(d, f, "uidMappings", _list(_idmap), []),
        gid_mappings=r.get(d, f, "gidMappings", _list(_idmap), []),
        devices=r.get(d, f, "devices", _list(_device), []),
        cgroups_path=r.get(d, f, "cgroupsPath", _str, ""),
        resources=r.get(d, f, "resources", _resources, Resources()),
        sysctl=r.get(d, f, "sysctl", _str_map, {}),
        seccomp=r.get(d, f, "seccomp", _seccomp, None),
        masked_paths=r.get(d, f, "maskedPaths", _list(_abs), []),
        readonly_paths=r.get(d, f, "readonlyPaths", _list(_abs), []),
        rootfs_propagation=r.get(d, f, "rootfsPropagation", _one_of(PROPAGATIONS, "propagation"), ""),
        mount_label=r.get(d, f, "mountLabel", _str, ""),
        personality=r.get(d, f, "personality", _obj, None))
    _no_duplicates(r, f"{f}.namespaces", [ns.type for ns in lin.namespaces], "namespace type")
    userns = lin.namespace("user")
    # A new user namespace without mappings leaves every id unmapped (nobody, no privileges);
    # runc rejects it, and mappings without a user namespace have nowhere to go.
    for key, maps in (("uidMappings", lin.uid_mappings), ("gidMappings", lin.gid_mappings)):
        if userns is not None and not userns.path and not maps:
            r.fail(f"{f}.{key}", "is required when a new user namespace is requested")
        if userns is None and maps:
            r.fail(f"{f}.{key}", "needs a user namespace in linux.namespaces")
    return lin


def parse_spec(data: Any, path: str, bundle: str) -> Spec:
    """Validate decoded config.json `data`; errors name `path`. root.path becomes absolute."""
    r = _Reader(path)
    if not isinstance(data, dict):
        r.fail("", "must contain a JSON object")
    version = r.get(data, "", "ociVersion", _str)
    if not version.startswith("1."):
        r.fail("ociVersion", f"unsupported version {json.dumps(version)}, need 1.x")
    bundle = os.path.abspath(bundle)
    root = r.get(data, "", "root", _root)  # runc requires it too: there is nothing to run without
    # The spec says a relative root.path is relative to the bundle, not to our cwd.
    root.path = os.path.normpath(os.path.join(bundle, root.path))
    return Spec(
        oci_version=version, process=r.get(data, "", "process", _process, None), root=root,
        hostname=r.get(data, "", "hostname", _str, ""), domainname=r.get(data, "", "domainname", _str, ""),
        mounts=r.get(data, "", "mounts", _list(_mount), []), hooks=r.get(data, "", "hooks", _hooks, Hooks()),
        annotations=r.get(data, "", "annotations", _str_map, {}),
        linux=r.get(data, "", "linux", _linux, Linux()), bundle=bundle, raw=data)


def parse_process(data: Any, path: str) -> Process:
    """Validate a lone process object (`quark exec --process FILE`); errors name `path`."""
    return _process(_Reader(path), "process", data) if isinstance(data, dict) else _Reader(path).fail("", "must contain a JSON object")


def parse_resources(data: Any, path: str) -> Resources:
    """Validate a lone linux.resources object (`quark update --resources FILE`)."""
    return _resources(_Reader(path), "resources", data)


def load_spec(bundle: str) -> Spec:
    """Read and validate `<bundle>/config.json`."""
    path = os.path.join(bundle, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(path, "", "no such file (is --bundle right?)") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, "", "is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(path, "", f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return parse_spec(data, path, bundle)


def default_spec() -> dict:
    """The config `runc spec` (runc 1.1) writes, with quark's hostname; a fresh dict each call."""
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    no_exec = ["nosuid", "noexec", "nodev"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": True,
            "user": {"uid": 0, "gid": 0},
            "args": ["sh"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "quark",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": no_exec + ["mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": list(no_exec)},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": no_exec + ["ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": no_exec + ["relatime", "ro"]},
        ],
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                            "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def make_rootless(spec: dict, uid: int, gid: int) -> dict:
    """Adapt a default spec for an unprivileged user, as runc's specconv.ToRootless does."""
    linux = spec.setdefault("linux", {})
    # No network namespace: an unprivileged user could not configure its interfaces anyway.
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns["type"] not in ("network", "user")]
    linux["namespaces"].append({"type": "user"})
    linux["uidMappings"] = [{"containerID": 0, "hostID": uid, "size": 1}]
    linux["gidMappings"] = [{"containerID": 0, "hostID": gid, "size": 1}]
    mounts = []
    for m in spec.get("mounts", []):
        if os.path.normpath(m["destination"]) == "/sys":
            # sysfs can't be mounted without owning the network namespace; bind the host's instead.
            mounts.append({"destination": "/sys", "type": "none", "source": "/sys",
                           "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]})
            continue
        # uid=/gid= options name ids that need not be mapped in the new user namespace.
        if "options" in m:
            m["options"] = [o for o in m["options"] if not o.startswith(("uid=", "gid="))]
        mounts.append(m)
    spec["mounts"] = mounts
    linux.pop("resources", None)  # an unprivileged user usually can't write cgroups
    return spec
