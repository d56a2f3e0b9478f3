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
    _I64,
    _MISSING,
    _U32,
    _U64,
    _abs,
    _bool,
    _int,
    _list,
    _no_duplicates,
    _nonempty_strs,
    _obj,
    _one_of,
    _opt_abs,
    _Reader,
    _str,
    _str_map,
)
from .resources import _resources


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


def _scheduler(r: _Reader, f: str, v: Any) -> Scheduler:
    """As runc checks it (sched_setattr(2)'s rules): a nice value only in range, a priority only
    for the real-time policies, runtime/deadline/period only for SCHED_DEADLINE."""
    d = _obj(r, f, v)
    s = Scheduler(policy=r.get(d, f, "policy", _one_of(SCHED_POLICIES, "scheduling policy")),
                  nice=r.get(d, f, "nice", _int(-2**31, 2**31 - 1), 0),
                  priority=r.get(d, f, "priority", _int(-2**31, 2**31 - 1), 0),
                  flags=r.get(d, f, "flags", _list(_one_of(SCHED_FLAGS, "scheduling flag")), []),
                  runtime=r.get(d, f, "runtime", _U64, 0), deadline=r.get(d, f, "deadline", _U64, 0),
                  period=r.get(d, f, "period", _U64, 0))
    if s.policy in ("SCHED_OTHER", "SCHED_BATCH") and not -20 <= s.nice <= 19:
        r.fail(f"{f}.nice", f"must be between -20 and 19 for {s.policy}, got {s.nice}")
    if s.priority and s.policy not in ("SCHED_FIFO", "SCHED_RR"):
        r.fail(f"{f}.priority", f"only SCHED_FIFO and SCHED_RR take a priority, not {s.policy}")
    if s.policy in ("SCHED_FIFO", "SCHED_RR") and not 1 <= s.priority <= 99:
        r.fail(f"{f}.priority", f"must be between 1 and 99 for {s.policy}, got {s.priority}")
    if s.policy != "SCHED_DEADLINE" and (s.runtime or s.deadline or s.period):
        r.fail(f, f"runtime, deadline and period are for SCHED_DEADLINE only, not {s.policy}")
    return s


def _io_priority(r: _Reader, f: str, v: Any) -> IOPriority:
    d = _obj(r, f, v)
    return IOPriority(io_class=r.get(d, f, "class", _one_of(IOPRIO_CLASSES, "I/O priority class")),
                      priority=r.get(d, f, "priority", _int(0, 7)))


def _number_list(what: str, limit: int) -> Check:
    """A list of CPUs or NUMA nodes as the kernel writes one ("0-3,7"); "" means not set (None)."""
    def check(r: _Reader, f: str, v: Any) -> frozenset[int] | None:
        text, numbers = _str(r, f, v).strip(), set()
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


def _memory_policy(r: _Reader, f: str, v: Any) -> MemoryPolicy:
    """As runc checks it: the modes that need nodes get some, the ones that take none get none."""
    d = _obj(r, f, v)
    mode = r.get(d, f, "mode", _one_of(MEMORY_POLICY_MODES, "memory policy mode"))
    nodes = r.get(d, f, "nodes", _number_list("NUMA node", MAX_NUMA_NODES), None) or frozenset()
    flags = r.get(d, f, "flags", _list(_one_of(MEMORY_POLICY_FLAGS, "memory policy flag")), [])
    takes = MEMORY_POLICY_MODES[mode][1]
    if takes is True and not nodes:
        r.fail(f"{f}.nodes", f"{mode} needs at least one node")
    if takes is False and nodes:
        r.fail(f"{f}.nodes", f"{mode} takes no nodes")
    return MemoryPolicy(mode=mode, nodes=nodes, flags=flags)


def _cpu_affinity(r: _Reader, f: str, v: Any) -> CPUAffinity:
    d = _obj(r, f, v)
    return CPUAffinity(initial=r.get(d, f, "initial", _cpu_list, None), final=r.get(d, f, "final", _cpu_list, None))


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
        selinux_label=r.get(d, f, "selinuxLabel", _str, ""),
        scheduler=r.get(d, f, "scheduler", _scheduler, None),
        io_priority=r.get(d, f, "ioPriority", _io_priority, None),
        exec_cpu_affinity=r.get(d, f, "execCPUAffinity", _cpu_affinity, None))
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


def _personality(r: _Reader, f: str, v: Any) -> str:
    d = _obj(r, f, v)
    domain = r.get(d, f, "domain", _one_of(PERSONALITIES, "personality domain"))
    if r.get(d, f, "flags", _list(_str), []):   # (runc warns and drops them; the spec defines none)
        r.fail(f"{f}.flags", "no personality flags are supported")
    return domain


def _time_offsets(r: _Reader, f: str, v: Any) -> dict[str, tuple[int, int]]:
    out = {}
    for clock, offset in _obj(r, f, v).items():
        if clock not in TIME_CLOCKS:
            r.fail(f"{f}.{clock}", f"unknown clock (time namespaces offset {' and '.join(TIME_CLOCKS)})")
        o = _obj(r, f"{f}.{clock}", offset)
        out[clock] = (r.get(o, f"{f}.{clock}", "secs", _I64, 0),
                      r.get(o, f"{f}.{clock}", "nanosecs", _int(0, 999_999_999), 0))
    return out


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
        personality=r.get(d, f, "personality", _personality, None),
        time_offsets=r.get(d, f, "timeOffsets", _time_offsets, {}),
        memory_policy=r.get(d, f, "memoryPolicy", _memory_policy, None))
    for key, why in UNSUPPORTED_LINUX.items():
        if d.get(key) is not None:
            r.fail(f"{f}.{key}", why)
    timens = lin.namespace("time")
    if lin.time_offsets and (timens is None or timens.path):
        r.fail(f"{f}.timeOffsets", "needs a new time namespace (a \"time\" entry without a path in linux.namespaces)")
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
