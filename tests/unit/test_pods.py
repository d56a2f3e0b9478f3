"""Which pod a container belongs to and who supervises it (qvisor/pods.py): CRI's annotations name
the sandbox; `supervisor: {scope}` is `pod` unless the operator says `container`, and a value quark
cannot take is refused naming the field; the supervisor section's two settings read side by side."""
from __future__ import annotations

import pytest

from qlib.errors import ConfigError
from qvisor import page_merge, pods

CRI = "io.kubernetes.cri.container-type", "io.kubernetes.cri.sandbox-id"
CRIO = "io.kubernetes.cri-o.ContainerType", "io.kubernetes.cri-o.SandboxID"


@pytest.mark.parametrize("kind, sandbox", [CRI, CRIO])
def test_a_pods_containers_name_its_sandbox_and_the_sandbox_names_none(kind, sandbox):
    assert pods.is_sandbox({kind: "sandbox", sandbox: "p1"})
    assert pods.sandbox_of("p1", {kind: "sandbox", sandbox: "p1"}) is None
    assert pods.sandbox_of("c1", {kind: "container", sandbox: "p1"}) == "p1"
    assert not pods.is_sandbox({kind: "container", sandbox: "p1"})


def test_a_container_outside_a_pod_has_no_sandbox():
    assert pods.sandbox_of("c1", {}) is None
    assert pods.sandbox_of("c1", {"io.kubernetes.cri.sandbox-id": "c1"}) is None   # names itself


def test_the_scope_is_pod_unless_the_operator_says_container(tmp_path):
    p = tmp_path / "config.yaml"
    assert pods.scope(str(tmp_path / "absent.yaml")) == "pod"
    p.write_text("supervisor: {memory_merge: false}\n")
    assert pods.scope(str(p)) == "pod" and page_merge.load_setting(str(p)) is False
    p.write_text("supervisor: {scope: container, memory_merge: false}\n")
    assert pods.scope(str(p)) == "container" and page_merge.load_setting(str(p)) is False


@pytest.mark.parametrize("value", ["node", "true", "[pod]"])
def test_a_scope_quark_cannot_take_is_refused_naming_the_field(tmp_path, value):
    p = tmp_path / "config.yaml"
    p.write_text(f"supervisor: {{scope: {value}}}\n")
    with pytest.raises(ConfigError) as e:
        pods.scope(str(p))
    assert "supervisor.scope" in str(e.value) and str(p) in str(e.value)
