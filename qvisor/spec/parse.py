"""Reading config.json into the model: `load_spec(bundle)` reads `<bundle>/config.json`,
`parse_spec` validates decoded JSON into a `Spec`, and `parse_process` validates the lone process
object of `quark exec --process FILE`.

Every problem is a ConfigError that names the file and the field path (`process.args`,
`linux.namespaces[2].type`). Unknown keys are ignored: the spec allows extensions and runc ignores
them too. JSON null counts as absent, as it does for Go's encoding/json. linux.resources is
checked in `resources`.
"""
from __future__ import annotations

import json
import os
from typing import Any

from qlib.errors import ConfigError

from .model import (
    CAPABILITIES,
    IOPRIO_CLASSES,
    MAX_CPUS,
    MAX_NUMA_NODES,
    MEMORY_POLICY_FLAGS,
    MEMORY_POLICY_MODES,
    PERSONALITIES,
    NAMESPACE_TYPES,
    PROPAGATIONS,
    RLIMITS,
    SECCOMP_ACTIONS,
    SCHED_FLAGS,
    SCHED_POLICIES,
    SECCOMP_OPS,
    TIME_CLOCKS,
    UNSUPPORTED_LINUX,
    Capabilities,
    CPUAffinity,
    Device,
    Hook,
    Hooks,
    IDMapping,
    IOPriority,
    Linux,
    MemoryPolicy,
    Mount,
    Namespace,
    Process,
    Resources,
    Rlimit,
    Root,
    Scheduler,
    Seccomp,
    SeccompArg,
    Spec,
    SyscallRule,
    User,
)
from .reader import (
    Check,
    I64,
    MISSING,
    U32,
    U64,
    absolute_path,
    boolean,
    integer,
    list_of,
    no_duplicates,
    nonempty_strings,
    mapping,
    one_of,
    optional_absolute_path,
    Reader,
    string,
    string_map,
)
from .resources import resources_field


def _user(r: Reader, f: str, v: Any) -> User:
    d = mapping(r, f, v)
    # uid/gid default to 0 rather than being required: runc (Go zero values) accepts that too.
    return User(uid=r.get(d, f, "uid", U32, 0), gid=r.get(d, f, "gid", U32, 0),
                umask=r.get(d, f, "umask", U32, None),
                additional_gids=r.get(d, f, "additionalGids", list_of(U32), []))


def _console_size(r: Reader, f: str, v: Any) -> tuple[int, int]:
    d = mapping(r, f, v)
    return (r.get(d, f, "height", U32), r.get(d, f, "width", U32))


def _capabilities(r: Reader, f: str, v: Any) -> Capabilities:
    d = mapping(r, f, v)
    names = list_of(one_of(CAPABILITIES, "capability"))
    return Capabilities(**{k: r.get(d, f, k, names, [])
                           for k in ("bounding", "effective", "inheritable", "permitted", "ambient")})


def _rlimit(r: Reader, f: str, v: Any) -> Rlimit:
    d = mapping(r, f, v)
    rl = Rlimit(type=r.get(d, f, "type", one_of(RLIMITS, "rlimit")),
                soft=r.get(d, f, "soft", U64), hard=r.get(d, f, "hard", U64))
    if rl.soft > rl.hard:  # setrlimit(2) would fail with EINVAL inside the container
        r.fail(f"{f}.soft", f"soft limit {rl.soft} exceeds hard limit {rl.hard}")
    return rl


def _scheduler(r: Reader, f: str, v: Any) -> Scheduler:
    """As runc checks it (sched_setattr(2)'s rules): a nice value only in range, a priority only
    for the real-time policies, runtime/deadline/period only for SCHED_DEADLINE."""
    d = mapping(r, f, v)
    s = Scheduler(policy=r.get(d, f, "policy", one_of(SCHED_POLICIES, "scheduling policy")),
                  nice=r.get(d, f, "nice", integer(-2**31, 2**31 - 1), 0),
                  priority=r.get(d, f, "priority", integer(-2**31, 2**31 - 1), 0),
                  flags=r.get(d, f, "flags", list_of(one_of(SCHED_FLAGS, "scheduling flag")), []),
                  runtime=r.get(d, f, "runtime", U64, 0), deadline=r.get(d, f, "deadline", U64, 0),
                  period=r.get(d, f, "period", U64, 0))
    if s.policy in ("SCHED_OTHER", "SCHED_BATCH") and not -20 <= s.nice <= 19:
        r.fail(f"{f}.nice", f"must be between -20 and 19 for {s.policy}, got {s.nice}")
    if s.priority and s.policy not in ("SCHED_FIFO", "SCHED_RR"):
        r.fail(f"{f}.priority", f"only SCHED_FIFO and SCHED_RR take a priority, not {s.policy}")
    if s.policy in ("SCHED_FIFO", "SCHED_RR") and not 1 <= s.priority <= 99:
        r.fail(f"{f}.priority", f"must be between 1 and 99 for {s.policy}, got {s.priority}")
    if s.policy != "SCHED_DEADLINE" and (s.runtime or s.deadline or s.period):
        r.fail(f, f"runtime, deadline and period are for SCHED_DEADLINE only, not {s.policy}")
    return s


def _io_priority(r: Reader, f: str, v: Any) -> IOPriority:
    d = mapping(r, f, v)
    return IOPriority(io_class=r.get(d, f, "class", one_of(IOPRIO_CLASSES, "I/O priority class")),
                      priority=r.get(d, f, "priority", integer(0, 7)))


def _number_list(what: str, limit: int) -> Check:
    """A list of CPUs or NUMA nodes as the kernel writes one ("0-3,7"); "" means not set (None)."""
    def check(r: Reader, f: str, v: Any) -> frozenset[int] | None:
        text, numbers = string(r, f, v).strip(), set()
        if not text:
            return None
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                r.fail(f, f"{json.dumps(v)} is not a {what} list (like \"0-3,7\")")
            a, b = int(lo), int(hi or lo)
            if not 0 <= a <= b < limit:
                r.fail(f, f"{part.strip()!r}: {what}s are numbered 0 to {limit - 1}, low to high")
            numbers.update(range(a, b + 1))
        return frozenset(numbers)
    return check


_cpu_list = _number_list("CPU", MAX_CPUS)


def _memory_policy(r: Reader, f: str, v: Any) -> MemoryPolicy:
    """As runc checks it: the modes that need nodes get some, the ones that take none get none."""
    d = mapping(r, f, v)
    mode = r.get(d, f, "mode", one_of(MEMORY_POLICY_MODES, "memory policy mode"))
    nodes = r.get(d, f, "nodes", _number_list("NUMA node", MAX_NUMA_NODES), None) or frozenset()
    flags = r.get(d, f, "flags", list_of(one_of(MEMORY_POLICY_FLAGS, "memory policy flag")), [])
    takes = MEMORY_POLICY_MODES[mode][1]
    if takes is True and not nodes:
        r.fail(f"{f}.nodes", f"{mode} needs at least one node")
    if takes is False and nodes:
        r.fail(f"{f}.nodes", f"{mode} takes no nodes")
    return MemoryPolicy(mode=mode, nodes=nodes, flags=flags)


def _cpu_affinity(r: Reader, f: str, v: Any) -> CPUAffinity:
    d = mapping(r, f, v)
    return CPUAffinity(initial=r.get(d, f, "initial", _cpu_list, None), final=r.get(d, f, "final", _cpu_list, None))


def _process(r: Reader, f: str, v: Any) -> Process:
    d = mapping(r, f, v)
    p = Process(
        terminal=r.get(d, f, "terminal", boolean, False),
        console_size=r.get(d, f, "consoleSize", _console_size, None),
        user=r.get(d, f, "user", _user, User()),
        args=nonempty_strings(r, f"{f}.args", d.get("args")),  # missing gets the same message
        env=r.get(d, f, "env", list_of(string), []),
        cwd=r.get(d, f, "cwd", absolute_path),
        capabilities=r.get(d, f, "capabilities", _capabilities, None),
        rlimits=r.get(d, f, "rlimits", list_of(_rlimit), []),
        no_new_privileges=r.get(d, f, "noNewPrivileges", boolean, False),
        oom_score_adj=r.get(d, f, "oomScoreAdj", integer(-1000, 1000), None),
        apparmor_profile=r.get(d, f, "apparmorProfile", string, ""),
        selinux_label=r.get(d, f, "selinuxLabel", string, ""),
        scheduler=r.get(d, f, "scheduler", _scheduler, None),
        io_priority=r.get(d, f, "ioPriority", _io_priority, None),
        exec_cpu_affinity=r.get(d, f, "execCPUAffinity", _cpu_affinity, None))
    no_duplicates(r, f"{f}.rlimits", [rl.type for rl in p.rlimits], "rlimit")
    return p


def _root(r: Reader, f: str, v: Any) -> Root:
    d = mapping(r, f, v)
    path = r.get(d, f, "path", string)
    if not path:
        r.fail(f"{f}.path", "must not be empty")
    return Root(path=path, readonly=r.get(d, f, "readonly", boolean, False))


def _idmap(r: Reader, f: str, v: Any) -> IDMapping:
    d = mapping(r, f, v)
    return IDMapping(container_id=r.get(d, f, "containerID", U32), host_id=r.get(d, f, "hostID", U32),
                     size=r.get(d, f, "size", integer(1, 2**32 - 1)))


def _mount(r: Reader, f: str, v: Any) -> Mount:
    d = mapping(r, f, v)
    return Mount(destination=r.get(d, f, "destination", absolute_path), type=r.get(d, f, "type", string, ""),
                 source=r.get(d, f, "source", string, ""), options=r.get(d, f, "options", list_of(string), []),
                 uid_mappings=r.get(d, f, "uidMappings", list_of(_idmap), []),
                 gid_mappings=r.get(d, f, "gidMappings", list_of(_idmap), []))


def _hook(r: Reader, f: str, v: Any) -> Hook:
    d = mapping(r, f, v)
    return Hook(path=r.get(d, f, "path", absolute_path), args=r.get(d, f, "args", list_of(string), []),
                env=r.get(d, f, "env", list_of(string), []), timeout=r.get(d, f, "timeout", integer(1, 2**63 - 1), None))


def _hooks(r: Reader, f: str, v: Any) -> Hooks:
    d = mapping(r, f, v)
    hooks = list_of(_hook)
    return Hooks(prestart=r.get(d, f, "prestart", hooks, []), create_runtime=r.get(d, f, "createRuntime", hooks, []),
                 create_container=r.get(d, f, "createContainer", hooks, []),
                 start_container=r.get(d, f, "startContainer", hooks, []),
                 poststart=r.get(d, f, "poststart", hooks, []), poststop=r.get(d, f, "poststop", hooks, []))


def _namespace(r: Reader, f: str, v: Any) -> Namespace:
    d = mapping(r, f, v)
    return Namespace(type=r.get(d, f, "type", one_of(NAMESPACE_TYPES, "namespace type")),
                     path=r.get(d, f, "path", optional_absolute_path, ""))


def _device(r: Reader, f: str, v: Any) -> Device:
    d = mapping(r, f, v)
    kind = r.get(d, f, "type", one_of(("c", "b", "u", "p"), "device type"))
    number = integer(0, 2**63 - 1)
    # A FIFO has no device numbers; every other node needs both to be created.
    default = 0 if kind == "p" else MISSING
    # "/dev/fuse/" names /dev/fuse (runc cleans the path too)
    return Device(path=os.path.normpath(r.get(d, f, "path", absolute_path)), type=kind, major=r.get(d, f, "major", number, default),
                  minor=r.get(d, f, "minor", number, default), file_mode=r.get(d, f, "fileMode", U32, None),
                  uid=r.get(d, f, "uid", U32, None), gid=r.get(d, f, "gid", U32, None))


def _personality(r: Reader, f: str, v: Any) -> str:
    d = mapping(r, f, v)
    domain = r.get(d, f, "domain", one_of(PERSONALITIES, "personality domain"))
    if r.get(d, f, "flags", list_of(string), []):   # (runc warns and drops them; the spec defines none)
        r.fail(f"{f}.flags", "no personality flags are supported")
    return domain


def _time_offsets(r: Reader, f: str, v: Any) -> dict[str, tuple[int, int]]:
    out = {}
    for clock, offset in mapping(r, f, v).items():
        if clock not in TIME_CLOCKS:
            r.fail(f"{f}.{clock}", f"unknown clock (time namespaces offset {' and '.join(TIME_CLOCKS)})")
        o = mapping(r, f"{f}.{clock}", offset)
        out[clock] = (r.get(o, f"{f}.{clock}", "secs", I64, 0),
                      r.get(o, f"{f}.{clock}", "nanosecs", integer(0, 999_999_999), 0))
    return out


def _seccomp_arg(r: Reader, f: str, v: Any) -> SeccompArg:
    d = mapping(r, f, v)
    return SeccompArg(index=r.get(d, f, "index", integer(0, 5)), value=r.get(d, f, "value", U64),
                      value_two=r.get(d, f, "valueTwo", U64, 0),
                      op=r.get(d, f, "op", one_of(SECCOMP_OPS, "seccomp op")))


def _syscall(r: Reader, f: str, v: Any) -> SyscallRule:
    d = mapping(r, f, v)
    return SyscallRule(names=nonempty_strings(r, f"{f}.names", d.get("names")),
                       action=r.get(d, f, "action", one_of(SECCOMP_ACTIONS, "seccomp action")),
                       errno_ret=r.get(d, f, "errnoRet", U32, None),
                       args=r.get(d, f, "args", list_of(_seccomp_arg), []))


def _seccomp(r: Reader, f: str, v: Any) -> Seccomp:
    d = mapping(r, f, v)
    s = Seccomp(default_action=r.get(d, f, "defaultAction", one_of(SECCOMP_ACTIONS, "seccomp action")),
                default_errno_ret=r.get(d, f, "defaultErrnoRet", U32, None),
                architectures=r.get(d, f, "architectures", list_of(string), []),
                flags=r.get(d, f, "flags", list_of(string), []),
                listener_path=r.get(d, f, "listenerPath", optional_absolute_path, ""),
                listener_metadata=r.get(d, f, "listenerMetadata", string, ""),
                syscalls=r.get(d, f, "syscalls", list_of(_syscall), []))
    # The spec requires somewhere to send the notify fd; without it the rule could never be answered.
    if not s.listener_path and any(rule.action == "SCMP_ACT_NOTIFY" for rule in s.syscalls):
        r.fail(f"{f}.listenerPath", "is required when a rule uses SCMP_ACT_NOTIFY")
    return s


def _linux(r: Reader, f: str, v: Any) -> Linux:
    d = mapping(r, f, v)
    lin = Linux(
        namespaces=r.get(d, f, "namespaces", list_of(_namespace), []),
        uid_mappings=r.get(d, f, "uidMappings", list_of(_idmap), []),
        gid_mappings=r.get(d, f, "gidMappings", list_of(_idmap), []),
        devices=r.get(d, f, "devices", list_of(_device), []),
        cgroups_path=r.get(d, f, "cgroupsPath", string, ""),
        resources=r.get(d, f, "resources", resources_field, Resources()),
        sysctl=r.get(d, f, "sysctl", string_map, {}),
        seccomp=r.get(d, f, "seccomp", _seccomp, None),
        masked_paths=r.get(d, f, "maskedPaths", list_of(absolute_path), []),
        readonly_paths=r.get(d, f, "readonlyPaths", list_of(absolute_path), []),
        rootfs_propagation=r.get(d, f, "rootfsPropagation", one_of(PROPAGATIONS, "propagation"), ""),
        mount_label=r.get(d, f, "mountLabel", string, ""),
        personality=r.get(d, f, "personality", _personality, None),
        time_offsets=r.get(d, f, "timeOffsets", _time_offsets, {}),
        memory_policy=r.get(d, f, "memoryPolicy", _memory_policy, None))
    for key, why in UNSUPPORTED_LINUX.items():
        if d.get(key) is not None:
            r.fail(f"{f}.{key}", why)
    timens = lin.namespace("time")
    if lin.time_offsets and (timens is None or timens.path):
        r.fail(f"{f}.timeOffsets", "needs a new time namespace (a \"time\" entry without a path in linux.namespaces)")
    no_duplicates(r, f"{f}.namespaces", [ns.type for ns in lin.namespaces], "namespace type")
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
    r = Reader(path)
    if not isinstance(data, dict):
        r.fail("", "must contain a JSON object")
    version = r.get(data, "", "ociVersion", string)
    if not version.startswith("1."):
        r.fail("ociVersion", f"unsupported version {json.dumps(version)}, need 1.x")
    bundle = os.path.abspath(bundle)
    root = r.get(data, "", "root", _root)  # runc requires it too: there is nothing to run without
    # The spec says a relative root.path is relative to the bundle, not to our cwd.
    root.path = os.path.normpath(os.path.join(bundle, root.path))
    return Spec(
        oci_version=version, process=r.get(data, "", "process", _process, None), root=root,
        hostname=r.get(data, "", "hostname", string, ""), domainname=r.get(data, "", "domainname", string, ""),
        mounts=r.get(data, "", "mounts", list_of(_mount), []), hooks=r.get(data, "", "hooks", _hooks, Hooks()),
        annotations=r.get(data, "", "annotations", string_map, {}),
        linux=r.get(data, "", "linux", _linux, Linux()), bundle=bundle, raw=data)


def parse_process(data: Any, path: str) -> Process:
    """Validate a lone process object (`quark exec --process FILE`); errors name `path`."""
    return _process(Reader(path), "process", data) if isinstance(data, dict) else Reader(path).fail("", "must contain a JSON object")


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
