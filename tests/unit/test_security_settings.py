"""The operator's `security:` setting (privileged / unconfined_seccomp: sandbox|refuse) and what
quark does with a privileged or Unconfined spec under it — parsed and applied, no container."""
from __future__ import annotations

import pytest

from qlib import linux as L
from qlib import procfs
from qlib.errors import ConfigError
from qvisor import security
from qvisor.spec import CAPABILITIES, default_spec, parse_spec


def _spec(privileged: bool = False, seccomp: bool = False):
    data = default_spec()
    if privileged:
        last, held = L.last_cap(), procfs.permitted_caps()
        caps = [n for n, bit in CAPABILITIES.items() if bit <= last and held & (1 << bit)]
        data["process"]["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
        data["linux"]["maskedPaths"], data["linux"]["readonlyPaths"] = [], []
        for m in data["mounts"]:
            m["options"] = [o for o in m.get("options", []) if o != "ro"]
    if seccomp:
        data["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ALLOW"}
    return parse_spec(data, "/b/config.json", "/b")


def test_settings_default_to_sandbox_and_are_read_from_the_config(tmp_path):
    assert security.load_settings(str(tmp_path / "absent.yaml")) == security.Settings()
    p = tmp_path / "config.yaml"
    p.write_text("platform: seccomp\nsecurity:\n  privileged: refuse\n")
    s = security.load_settings(str(p))
    assert (s.privileged, s.unconfined_seccomp, s.source) == ("refuse", "sandbox", str(p))


@pytest.mark.parametrize("text, field", [
    ("security: yes\n", "security: expected a mapping"),
    ("security:\n  privileged: allow\n", "security.privileged: 'allow': expected sandbox or refuse"),
    ("security:\n  hostDevices: refuse\n", "security.hostDevices: unknown setting"),
    ("security:\n  privileged_without_host_devices: 1\n",
     "security.privileged_without_host_devices: 1: expected true or false"),
])
def test_bad_settings_name_the_file_and_field(tmp_path, text, field):
    p = tmp_path / "config.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"^{p}: {field}"):
        security.load_settings(str(p))


def test_privileged_is_every_capability_the_runtime_holds():
    assert security.is_privileged(_spec(privileged=True))
    assert not security.is_privileged(_spec())


def test_refuse_names_the_field_and_the_setting():
    with pytest.raises(ConfigError, match=r"process.capabilities: every capability .* security.privileged: refuse"):
        security.apply(_spec(privileged=True), security.Settings(privileged="refuse", source="/etc/q.yaml"))
    with pytest.raises(ConfigError, match=r"linux.seccomp: absent \(seccompProfile Unconfined\) is refused"):
        security.apply(_spec(), security.Settings(unconfined_seccomp="refuse"))
    security.apply(_spec(seccomp=True), security.Settings("refuse", "refuse"))   # neither: nothing refused


def test_sandbox_puts_back_what_keeps_the_host_out_and_reports_it():
    spec = _spec(privileged=True)
    report = security.apply(spec, security.Settings())
    assert "/proc/sys" in spec.linux.readonly_paths and "/proc/kcore" in spec.linux.masked_paths
    assert all("ro" in m.options for m in spec.mounts if m.type in ("sysfs", "cgroup"))
    assert report[security.ANNOTATION_PRIVILEGED].startswith("sandbox: every capability")
    assert report[security.ANNOTATION_SECCOMP].startswith("quark's base policy only")


def _with_every_host_device(spec):
    # what docker and podman write for --privileged: a rule allowing every device, and every host
    # device node in linux.devices
    data = default_spec()
    data["process"]["capabilities"] = {k: sorted(spec.process.capabilities.bounding)
                                       for k in ("bounding", "effective", "permitted")}
    data["linux"]["resources"]["devices"] = [{"allow": True, "access": "rwm"}]
    data["linux"]["devices"] = [{"path": "/dev/vda", "type": "b", "major": 254, "minor": 0},
                                {"path": "/dev/kmsg", "type": "c", "major": 1, "minor": 11}]
    return parse_spec(data, "/b/config.json", "/b")


def test_every_host_device_is_refused_or_left_out_as_the_operator_sets():
    with pytest.raises(ConfigError, match=r"linux.resources.devices\[0\]: allows every host device .*"
                                          r"privileged_without_host_devices: true"):
        security.apply(_with_every_host_device(_spec(privileged=True)), security.Settings())
    spec = _with_every_host_device(_spec(privileged=True))
    report = security.apply(spec, security.Settings(privileged_without_host_devices=True, source="/etc/q.yaml"))
    # the rule is turned around (a v1 cgroup would otherwise keep its parent's allow-all) and no
    # host device node is made; the report says so
    assert [(r.allow, r.type, r.major, r.minor) for r in spec.linux.resources.devices] == [(False, "a", None, None)]
    assert spec.linux.devices == []
    assert "no host devices (/etc/q.yaml: security.privileged_without_host_devices; 2 device nodes" in \
        report[security.ANNOTATION_PRIVILEGED]


def test_a_pod_cannot_forge_the_report():
    forged = {security.ANNOTATION_PRIVILEGED: "forged", "io.quark.procview": "false"}
    assert security.reported(forged, {security.ANNOTATION_SECCOMP: "x"}) == {
        "io.quark.procview": "false", security.ANNOTATION_SECCOMP: "x"}
