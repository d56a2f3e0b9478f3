"""Pod security settings as Kubernetes means them: a privileged container and `seccompProfile:
Unconfined` (config.json without linux.seccomp). quark either honours them inside the sandbox — with
its protections against the host in place, and says so in the container's state — or refuses them at
create, naming the field. The operator chooses in /etc/quark/config.yaml ($QUARK_CONFIG):

    security:
      privileged: sandbox            # or: refuse
      unconfined_seccomp: sandbox    # or: refuse
      privileged_without_host_devices: false   # or: true

Both modes default to `sandbox` (SECURITY.md says why). A privileged spec that allows every host
device is refused, unless privileged_without_host_devices is true: then it gets none of the host's
devices, as containerd's option of that name does for CRI (docker and podman have no such option).
Checked before anything is made, so a refusal leaves no state, cgroup, mount or process behind.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from qlib import hostconfig
from qlib import linux as L
from qlib import procfs
from qlib.errors import ConfigError
from qvisor.spec import CAPABILITIES, DeviceRule, Spec
from qvisor.spec.defaults import default_spec

log = logging.getLogger("quark.security")

MODES = ("sandbox", "refuse")
_PREFIX = "io.quark.security."
ANNOTATION_PRIVILEGED = _PREFIX + "privileged"
ANNOTATION_SECCOMP = _PREFIX + "seccomp"
_DEVICES_HINT = ("set `security: {privileged_without_host_devices: true}` in quark's host config (docker, "
                 "podman), or privileged_without_host_devices = true for quark's runtime in containerd's CRI "
                 "config (deploy/containerd/quark.toml does)")


@dataclass(frozen=True)
class Settings:
    privileged: str = "sandbox"
    unconfined_seccomp: str = "sandbox"
    privileged_without_host_devices: bool = False
    source: str = ""   # the config file they came from ("" when it has no security section)


def load_settings(config_path: str | None = None) -> Settings:
    """The `security` section of quark's host config; defaults where absent."""
    path = config_path or hostconfig.path()
    section = hostconfig.entry(path, "security")
    if section is None:
        return Settings()
    if not isinstance(section, dict):
        raise ConfigError(path, "security", "expected a mapping {privileged: sandbox|refuse, "
                                            "unconfined_seccomp: sandbox|refuse}")
    values = {}
    for key, value in section.items():
        if key == "privileged_without_host_devices":
            if not isinstance(value, bool):
                raise ConfigError(path, f"security.{key}", f"{value!r}: expected true or false")
        elif key not in ("privileged", "unconfined_seccomp"):
            raise ConfigError(path, f"security.{key}", "unknown setting (known: privileged, unconfined_seccomp, "
                                                       "privileged_without_host_devices)")
        elif value not in MODES:
            raise ConfigError(path, f"security.{key}", f"{value!r}: expected sandbox or refuse")
        values[key] = value
    return Settings(source=path, **values)


def is_privileged(spec: Spec) -> bool:
    """A privileged container as containerd, Docker and podman make one: its bounding set holds
    every capability the runtime itself holds (config.json has no privileged flag)."""
    caps = spec.process.capabilities if spec.process is not None else None
    if caps is None:
        return False
    # of those, the ones every manager knows: docker 20.10 lists none after CAP_AUDIT_READ (no
    # CAP_PERFMON, CAP_BPF, CAP_CHECKPOINT_RESTORE), and its privileged containers are privileged
    last = min(L.last_cap(), CAPABILITIES["CAP_AUDIT_READ"])
    held = procfs.permitted_caps()
    wanted = {name for name, bit in CAPABILITIES.items() if bit <= last and held & (1 << bit)}
    return bool(wanted) and wanted <= set(caps.bounding)


def apply(spec: Spec, settings: Settings) -> dict[str, str]:
    """Refuse what the operator refuses; otherwise adapt the spec so quark's protections stay, and
    return the annotations that report what is really applied (they go into `quark state`)."""
    cfg = os.path.join(spec.bundle, "config.json")
    where = settings.source or "quark's host config"
    report = {}
    if is_privileged(spec):
        if settings.privileged == "refuse":
            raise ConfigError(cfg, "process.capabilities", "every capability (a privileged container) is "
                              f"refused on this host ({where}: security.privileged: refuse)")
        report[ANNOTATION_PRIVILEGED] = _sandbox_privileged(spec, cfg, settings, where)
    if spec.linux.seccomp is None:
        if settings.unconfined_seccomp == "refuse":
            raise ConfigError(cfg, "linux.seccomp", "absent (seccompProfile Unconfined) is refused on this host "
                              f"({where}: security.unconfined_seccomp: refuse); give the container a profile, "
                              "e.g. RuntimeDefault")
        report[ANNOTATION_SECCOMP] = ("quark's base policy only: linux.seccomp is absent (Unconfined); the base "
                                      "policy stays (`quark syscalls`)")
    else:
        report[ANNOTATION_SECCOMP] = "quark's base policy and linux.seccomp, stacked (the stricter answer wins)"
    return report


def _sandbox_privileged(spec: Spec, cfg: str, settings: Settings, where: str) -> str:
    """Honour a privileged spec inside the sandbox: every capability in the container's own
    namespaces, with what would reach the host put back or refused. Returns the report."""
    if not spec.linux.new_namespace("mount"):
        raise ConfigError(cfg, "linux.namespaces", "a privileged container needs a new mount namespace under "
                          "quark (its masks and read-only paths keep the host's kernel knobs out of reach)")
    added = []
    rules = spec.linux.resources.devices
    every = [i for i, rule in enumerate(rules)
             if rule.allow and rule.type == "a" and rule.major is None and rule.minor is None]
    if every and not settings.privileged_without_host_devices:
        raise ConfigError(cfg, f"linux.resources.devices[{every[0]}]", "allows every host device to a privileged "
                          f"container, which quark does not pass into a sandbox; {_DEVICES_HINT}, so that the "
                          "host's devices stay out")
    if every:
        # the rule becomes its opposite (the cgroup's own default is its parent's, allow-all on v1),
        # and docker's and podman's every host device node in linux.devices beside it goes: neither
        # would have come with containerd's option
        spec.linux.resources.devices = [DeviceRule(False, "a", None, None, "rwm") if i in every else r
                                        for i, r in enumerate(rules)]
        added.append(f"no host devices ({where}: security.privileged_without_host_devices; "
                     f"{len(spec.linux.devices)} device nodes and the rule allowing every device left out)")
        spec.linux.devices = []
    defaults = default_spec()["linux"]
    if not spec.linux.masked_paths:
        spec.linux.masked_paths = list(defaults["maskedPaths"])
        added.append("runc's masked paths")
    if not spec.linux.readonly_paths:
        spec.linux.readonly_paths = list(defaults["readonlyPaths"])
        added.append("runc's read-only paths (/proc/sys, /proc/sysrq-trigger, ...)")
    for m in spec.mounts:
        if m.type in ("sysfs", "cgroup", "cgroup2") and "ro" not in m.options:
            m.options = [o for o in m.options if o != "rw"] + ["ro"]
            added.append(f"{m.destination} read-only")
    return ("sandbox: every capability inside the container's own namespaces; quark's base seccomp policy, "
            "the container's device rules and its locked mounts stay"
            + (f"; added: {', '.join(added)}" if added else ""))


def reported(annotations: dict[str, str], report: dict[str, str]) -> dict[str, str]:
    """The state's annotations: the bundle's, less any io.quark.security.* of its own (a pod may pass
    io.quark.* annotations through containerd: it must not forge the report), plus quark's report."""
    return {k: v for k, v in annotations.items() if not k.startswith(_PREFIX)} | report


def log_report(annotations: dict[str, str]) -> None:
    """One log line per setting, in the supervisor's log."""
    for key in (ANNOTATION_PRIVILEGED, ANNOTATION_SECCOMP):
        if key in annotations:
            log.info("%s: %s", key, annotations[key])
