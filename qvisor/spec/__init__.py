"""The OCI runtime-spec config.json model (runtime-spec 1.0.2, plus the 1.1 and 1.2 fields quark uses).

`load_spec(bundle)` reads `<bundle>/config.json` into the dataclasses of the model and validates it.
Every problem is a ConfigError that names the file and the field path (`process.args`,
`linux.namespaces[2].type`), so a user can fix the bundle without reading quark's code.

Unknown keys are ignored: the spec allows extensions and runc ignores them too. JSON null
counts as absent, as it does for Go's encoding/json, which wrote most configs we will meet.
`default_spec()` is what `quark spec` writes: runc 1.1's example config.

The parts:
- `model`: the dataclasses and the names they use (CAPABILITIES, RLIMITS, PROC_NS_NAMES, SECCOMP_ACTIONS,
  THROTTLES, ...) and `sysctl_key`.
- `reader`: `_Reader` and the small per-field checks every parser is built from.
- `parse`: config.json -> `Spec` (`load_spec`, `parse_spec`, `parse_process`).
- `resources`: linux.resources -> `Resources` (`parse_resources`).
- `defaults`: what `quark spec` writes (`default_spec`, `make_rootless`).

This package re-exports the public names, so callers import them from `qvisor.spec`.
"""
from .defaults import default_spec, make_rootless
from .model import (
                    CAPABILITIES,
                    IOPRIO_CLASSES,
                    MEMORY_POLICY_FLAGS,
                    MEMORY_POLICY_MODES,
                    NAMESPACE_TYPES,
                    PERSONALITIES,
                    PROC_NS_NAMES,
                    PROPAGATIONS,
                    RLIM_INFINITY,
                    RLIMITS,
                    SCHED_FLAGS,
                    SCHED_POLICIES,
                    SECCOMP_ACTIONS,
                    SECCOMP_OPS,
                    THROTTLES,
                    BlockIO,
                    Capabilities,
                    CPUAffinity,
                    CpuResources,
                    Device,
                    DeviceRule,
                    Hook,
                    Hooks,
                    HugepageLimit,
                    IDMapping,
                    InterfacePriority,
                    IOPriority,
                    Linux,
                    MemoryPolicy,
                    MemoryResources,
                    Mount,
                    Namespace,
                    NetworkResources,
                    Process,
                    RdmaLimit,
                    Resources,
                    Rlimit,
                    Root,
                    Scheduler,
                    Seccomp,
                    SeccompArg,
                    Spec,
                    SyscallRule,
                    ThrottleDevice,
                    User,
                    WeightDevice,
                    sysctl_key,
)
from .parse import load_spec, parse_process, parse_spec
from .resources import parse_resources

__all__ = [
                    "CAPABILITIES",
                    "IOPRIO_CLASSES",
                    "MEMORY_POLICY_FLAGS",
                    "MEMORY_POLICY_MODES",
                    "NAMESPACE_TYPES",
                    "PERSONALITIES",
                    "PROC_NS_NAMES",
                    "PROPAGATIONS",
                    "RLIMITS",
                    "RLIM_INFINITY",
                    "SCHED_FLAGS",
                    "SCHED_POLICIES",
                    "SECCOMP_ACTIONS",
                    "SECCOMP_OPS",
                    "THROTTLES",
                    "BlockIO",
                    "Capabilities",
                    "CPUAffinity",
                    "CpuResources",
                    "Device",
                    "DeviceRule",
                    "Hook",
                    "Hooks",
                    "HugepageLimit",
                    "IDMapping",
                    "InterfacePriority",
                    "IOPriority",
                    "Linux",
                    "MemoryPolicy",
                    "MemoryResources",
                    "Mount",
                    "Namespace",
                    "NetworkResources",
                    "Process",
                    "RdmaLimit",
                    "Resources",
                    "Rlimit",
                    "Root",
                    "Scheduler",
                    "Seccomp",
                    "SeccompArg",
                    "Spec",
                    "SyscallRule",
                    "ThrottleDevice",
                    "User",
                    "WeightDevice",
                    "default_spec",
                    "load_spec",
                    "make_rootless",
                    "parse_process",
                    "parse_resources",
                    "parse_spec",
                    "sysctl_key",
]
