"""The OCI runtime-spec config.json model: the dataclasses a parsed config.json becomes, and the
names (capabilities, rlimits, namespace types, seccomp actions and ops, mount propagations, blockIO
throttles) that both the parser and the code that applies a spec look up.

Nothing here reads or checks a file: `qvisor.spec.parse` fills these classes in, and every default
below is what an absent field means.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, field

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
# process.scheduler and process.ioPriority (runtime-spec 1.2): name -> the kernel's number
SCHED_POLICIES = {"SCHED_OTHER": 0, "SCHED_FIFO": 1, "SCHED_RR": 2, "SCHED_BATCH": 3, "SCHED_ISO": 4,
                  "SCHED_IDLE": 5, "SCHED_DEADLINE": 6}
SCHED_FLAGS = {"SCHED_FLAG_RESET_ON_FORK": 0x01, "SCHED_FLAG_RECLAIM": 0x02, "SCHED_FLAG_DL_OVERRUN": 0x04,
               "SCHED_FLAG_KEEP_POLICY": 0x08, "SCHED_FLAG_KEEP_PARAMS": 0x10,
               "SCHED_FLAG_UTIL_CLAMP_MIN": 0x20, "SCHED_FLAG_UTIL_CLAMP_MAX": 0x40}
IOPRIO_CLASSES = {"IOPRIO_CLASS_RT": 1, "IOPRIO_CLASS_BE": 2, "IOPRIO_CLASS_IDLE": 3}
PERSONALITIES = {"LINUX": 0x0000, "LINUX32": 0x0008}   # linux.personality.domain -> personality(2)'s
TIME_CLOCKS = ("monotonic", "boottime")                # linux.timeOffsets keys: time_namespaces(7)
# linux fields of runtime-spec 1.2-1.3 that quark cannot honour: refused, never dropped
UNSUPPORTED_LINUX = {
    "intelRdt": "Intel RDT (resctrl) is not supported by quark",
    "netDevices": "moving host network devices into the container is not supported by quark",
}
# linux.memoryPolicy (set_mempolicy(2)): mode -> MPOL_*, and whether it takes nodes (None: zero or more)
MEMORY_POLICY_MODES = {"MPOL_DEFAULT": (0, False), "MPOL_PREFERRED": (1, None), "MPOL_BIND": (2, True),
                       "MPOL_INTERLEAVE": (3, True), "MPOL_LOCAL": (4, False), "MPOL_PREFERRED_MANY": (5, True),
                       "MPOL_WEIGHTED_INTERLEAVE": (6, True)}
MEMORY_POLICY_FLAGS = {"MPOL_F_NUMA_BALANCING": 1 << 13, "MPOL_F_RELATIVE_NODES": 1 << 14,
                       "MPOL_F_STATIC_NODES": 1 << 15}
MAX_NUMA_NODES = 1024
MAX_CPUS = 8192   # CPU numbers in process.execCPUAffinity lists are below this (as runc's)


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
class Scheduler:
    """process.scheduler: sched_setattr(2)'s attributes, applied to the process before it execs."""
    policy: str = "SCHED_OTHER"
    nice: int = 0
    priority: int = 0
    flags: list[str] = field(default_factory=list)
    runtime: int = 0
    deadline: int = 0
    period: int = 0


@dataclass
class IOPriority:
    io_class: str = "IOPRIO_CLASS_BE"
    priority: int = 0


@dataclass
class CPUAffinity:
    """process.execCPUAffinity, for exec'd processes: the CPUs before (initial) and after (final)
    the move into the container's cgroup; None: not set."""
    initial: frozenset[int] | None = None
    final: frozenset[int] | None = None


@dataclass
class MemoryPolicy:
    """linux.memoryPolicy: the NUMA policy set_mempolicy(2) gives the container's processes."""
    mode: str = "MPOL_DEFAULT"
    nodes: frozenset[int] = frozenset()
    flags: list[str] = field(default_factory=list)


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
    scheduler: Scheduler | None = None
    io_priority: IOPriority | None = None
    exec_cpu_affinity: CPUAffinity | None = None


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
    burst: int | None = None   # (us; 0 is a value: no burst)


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
    personality: str | None = None                # its domain: "LINUX" or "LINUX32"
    time_offsets: dict[str, tuple[int, int]] = field(default_factory=dict)   # clock -> (secs, nanosecs)
    memory_policy: MemoryPolicy | None = None

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
    # Not from config.json: the namespace kinds the container has its own of (a new one, or one joined
    # by a path that is not the runtime's own), decided on the host at create (validate.owns_namespace);
    # QKernel's capability grants read it.
    own_namespaces: frozenset[str] = frozenset()
