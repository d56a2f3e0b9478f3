"""quark features: what this runtime implements, in the OCI features JSON format."""
from __future__ import annotations

import argparse
import json

from qvisor import mountopts

_SCMP_ARCH = {"x86_64": "SCMP_ARCH_X86_64", "aarch64": "SCMP_ARCH_AARCH64"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def features() -> dict:
    import platform

    from qvisor.sandbox import NS_FLAGS
    from qvisor.spec import CAPABILITIES, SECCOMP_ACTIONS, SECCOMP_OPS
    return {
        "ociVersionMin": "1.0.0",
        "ociVersionMax": "1.0.2",
        "hooks": ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"],
        "mountOptions": sorted(set(mountopts.FLAGS) | set(mountopts.PROPAGATION) | mountopts.IGNORED
                               | set(mountopts.COPY_UP)),
        "linux": {
            "namespaces": sorted(NS_FLAGS),
            "capabilities": sorted(CAPABILITIES, key=CAPABILITIES.get),
            # v2 device rules are an eBPF program (qvisor/cgroups/devicefilter.py); rdma.max on both
            "cgroup": {"v1": True, "v2": True, "systemd": False, "systemdUser": False, "rdma": True},
            "seccomp": {"enabled": True, "actions": [a for a in SECCOMP_ACTIONS if a != "SCMP_ACT_NOTIFY"],
                        "operators": list(SECCOMP_OPS), "archs": [_SCMP_ARCH.get(platform.machine(), platform.machine())]},
            "apparmor": {"enabled": False},
            "selinux": {"enabled": False},
            "intelRdt": {"enabled": False},
            "mountExtensions": {"idmap": {"enabled": False}},
        },
        "annotations": {"io.quark.platform": "seccomp,ptrace"},
    }


def run(args: argparse.Namespace) -> int:
    print(json.dumps(features(), indent=4))
    return 0
