"""The devices every container gets, and the device-cgroup rules that let it use them."""
from __future__ import annotations

import dataclasses

from qvisor.spec import DeviceRule, Resources, Spec

# (path, type, major, minor, mode): the OCI spec's default devices
DEFAULT_DEVICES = [
    ("/dev/null", "c", 1, 3, 0o666), ("/dev/zero", "c", 1, 5, 0o666), ("/dev/full", "c", 1, 7, 0o666),
    ("/dev/random", "c", 1, 8, 0o666), ("/dev/urandom", "c", 1, 9, 0o666), ("/dev/tty", "c", 5, 0, 0o666),
]
# after the spec's own rules, as runc appends its AllowedDevices: mknod of anything (the node is
# still useless without rw), the default devices, the pty multiplexer and the container's ptys
_IMPLICIT = [DeviceRule(True, "c", None, None, "m"), DeviceRule(True, "b", None, None, "m")] + \
    [DeviceRule(True, t, ma, mi, "rwm") for _, t, ma, mi, _ in DEFAULT_DEVICES] + \
    [DeviceRule(True, "c", 5, 2, "rwm"), DeviceRule(True, "c", 136, None, "rwm")]


def cgroup_resources(spec: Spec) -> Resources:
    """The spec's resources with the device rules the container needs to use its own /dev."""
    res = spec.linux.resources
    own = [DeviceRule(True, d.type, d.major, d.minor, "rwm") for d in spec.linux.devices if d.type in ("c", "b")]
    return dataclasses.replace(res, devices=list(res.devices) + _IMPLICIT + own)
