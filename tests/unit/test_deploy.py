"""deploy/: every manifest loads into the official Kubernetes client's models (the schema kubectl and
the API server hold it to), and the fields that make quark work are what the code expects: the
RuntimeClass handler containerd knows, RBAC covering what tsord watches, the DaemonSet mounting
exactly the host directories the installer writes, the ConfigMap a tsor.yaml tsord accepts. The
installer itself runs against a scratch host root, twice (the second run changes nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (pip install -e .) is needed")

from deploy import install  # noqa: E402
from tsor import config as tsor_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
MODEL = {("v1", "Namespace"): "V1Namespace", ("v1", "ServiceAccount"): "V1ServiceAccount",
         ("v1", "ConfigMap"): "V1ConfigMap", ("apps/v1", "DaemonSet"): "V1DaemonSet",
         ("node.k8s.io/v1", "RuntimeClass"): "V1RuntimeClass",
         ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
         ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding"}


# The API server takes a number where a quantity is due (resources, overhead): the client types
# those maps dict(str, str)
_QUANTITY_MAPS = {"limits", "requests", "podFixed"}


def strict_errors(doc: dict) -> list[str]:
    """What the API server would refuse in one manifest, by the client's model metadata walked
    field by field (no network): an unknown field, a value of the wrong type, a required field
    missing. The client's own deserialiser ignores unknown fields and turns numbers into strings."""
    errors: list[str] = []
    model = MODEL.get((doc.get("apiVersion"), doc.get("kind")))
    if model is None:
        return [f"{doc.get('apiVersion')}/{doc.get('kind')}: not a kind these tests know"]
    _walk(doc, model, doc["kind"], errors, quantity=False)
    try:
        kubernetes.client.ApiClient()._ApiClient__deserialize(doc, model)
    except ValueError as e:   # the models' required fields (client-side validation)
        errors.append(f"{doc['kind']}: {e}")
    return errors


def _walk(value: object, type_name: str, where: str, errors: list[str], quantity: bool) -> None:
    if type_name.startswith(("list[", "List[")):
        if not isinstance(value, list):
            return errors.append(f"{where}: a list is due, not {type(value).__name__}")
        for i, item in enumerate(value):
            _walk(item, type_name[5:-1], f"{where}[{i}]", errors, quantity)
    elif type_name.startswith(("dict(", "Dict[")):
        if not isinstance(value, dict):
            return errors.append(f"{where}: a map is due, not {type(value).__name__}")
        inner = type_name[type_name.index(",") + 1:-1].strip()
        for k, item in value.items():
            _walk(item, inner, f"{where}.{k}", errors, quantity)
    elif type_name == "object":
        pass   # IntOrString and free-form fields: any JSON value
    elif type_name in ("str", "datetime", "bytes"):
        if not (isinstance(value, str) or quantity and isinstance(value, (int, float)) and not isinstance(value, bool)):
            errors.append(f"{where}: a string is due, not {type(value).__name__} {value!r}")
    elif type_name == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{where}: an integer is due, not {type(value).__name__} {value!r}")
    elif type_name == "bool":
        if not isinstance(value, bool):
            errors.append(f"{where}: true or false is due, not {type(value).__name__} {value!r}")
    elif type_name == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            errors.append(f"{where}: a number is due, not {type(value).__name__} {value!r}")
    else:   # one of the client's models: every key must be one of its fields
        klass = getattr(kubernetes.client.models, type_name)
        if not isinstance(value, dict):
            return errors.append(f"{where}: an object ({type_name}) is due, not {type(value).__name__}")
        by_key = {key: attr for attr, key in klass.attribute_map.items()}
        fields = getattr(klass, "model_fields", {})   # the client's models are pydantic's
        errors.extend(f"{where}: required field {klass.attribute_map[attr]!r} missing"
                      for attr, field in fields.items() if field.is_required() and klass.attribute_map[attr] not in value)
        for key, item in value.items():
            if key not in by_key:
                errors.append(f"{where}: unknown field {key!r} ({type_name} has no such field)")
                continue
            _walk(item, klass.openapi_types[by_key[key]], f"{where}.{key}", errors, key in _QUANTITY_MAPS)


def _documents() -> list[tuple[str, dict]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [(name, doc) for name in kustomization["resources"]
            for doc in yaml.safe_load_all((DEPLOY / name).read_text())]


def manifests() -> dict[str, object]:
    """kind/name -> the client's model object, from every manifest the kustomization lists."""
    api = kubernetes.client.ApiClient()
    out = {}
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            model = MODEL[(doc["apiVersion"], doc["kind"])]
            obj = api._ApiClient__deserialize(doc, model)   # the client's own (strict) deserialiser
            assert obj.metadata.name, f"{name}: {doc['kind']} without a name"
            out[f"{doc['kind']}/{obj.metadata.name}"] = obj
    return out


def test_every_manifest_is_listed_and_loads():
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml"}
    objs = manifests()
    assert {"RuntimeClass/quark", "DaemonSet/quark-node", "ClusterRole/quark-node",
            "ClusterRoleBinding/quark-node", "ServiceAccount/quark-node", "ConfigMap/quark-tsor",
            "Namespace/quark-system"} <= set(objs)


def test_every_manifest_holds_to_the_api_schema_strictly():
    errors = [f"{name}: {e}" for name, doc in _documents() for e in strict_errors(doc)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.__setitem__("overheed", d.pop("overhead")), "unknown field 'overheed'"),
    (lambda d: d["scheduling"].__setitem__("nodeSelectr", {}), "unknown field 'nodeSelectr'"),
    (lambda d: d.__setitem__("handler", 7), "a string is due"),
    (lambda d: d.pop("handler"), "required field 'handler' missing"),
], ids=["misspelt top-level field", "misspelt nested field", "wrong type", "missing required field"])
def test_the_schema_check_refuses_what_the_api_server_would(mutate, expected):
    doc = next(d for _, d in _documents() if d["kind"] == "RuntimeClass")
    assert not strict_errors(doc)
    mutate(doc)
    assert any(expected in e for e in strict_errors(doc)), strict_errors(doc)


def test_the_schema_check_reaches_into_the_pod_template():
    doc = next(d for _, d in _documents() if d["kind"] == "DaemonSet")
    container = doc["spec"]["template"]["spec"]["initContainers"][0]
    container["securityContext"]["privilegd"] = True
    container["volumeMounts"][0]["readOnly"] = "yes"
    del container["name"]
    errors = "\n".join(strict_errors(doc))
    assert "securityContext: unknown field 'privilegd'" in errors, errors
    assert "volumeMounts[0].readOnly: true or false is due" in errors, errors
    assert "initContainers[0]: required field 'name' missing" in errors, errors


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl (Debian's kubernetes-client; make install installs it) is not installed")
def test_kubectl_kustomize_builds_the_same_objects():
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d}
    assert built == {(d["kind"], d["metadata"]["name"]) for _, d in _documents()}


def test_runtimeclass_names_the_handler_containerd_registers():
    rc = manifests()["RuntimeClass/quark"]
    with open(DEPLOY / "containerd" / "quark.toml", "rb") as f:
        runtimes = tomllib.load(f)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert rc.handler in runtimes and runtimes[rc.handler]["runtime_type"] == "io.containerd.quark.v1"
    assert rc.scheduling.node_selector == {install.NODE_LABEL[0]: install.NODE_LABEL[1]}


def test_pod_overhead_covers_the_measured_supervisor():
    overhead = manifests()["RuntimeClass/quark"].overhead.pod_fixed["memory"]
    assert overhead.endswith("Mi")
    measured = json.loads((REPO / "bench" / "results" / "startup.json").read_text())
    pss = measured["supervisor_memory"]["pss_median_mib"]
    assert pss <= int(overhead[:-2]) <= pss * 2, (overhead, pss)


def test_rbac_covers_what_tsord_watches_and_the_node_label():
    objs = manifests()
    allowed = {(g, r, v) for rule in objs["ClusterRole/quark-node"].rules
               for g in rule.api_groups for r in rule.resources for v in rule.verbs}
    from tsor.routes_k8s import WATCHED
    for group, resource in WATCHED:
        for verb in ("get", "list", "watch"):
            assert (group, resource, verb) in allowed, (group, resource, verb)
    assert ("", "nodes", "patch") in allowed          # install.py labels its node
    assert not any(v in ("create", "delete", "update", "*") for _, _, v in allowed)
    binding = objs["ClusterRoleBinding/quark-node"]
    ds = objs["DaemonSet/quark-node"]
    assert binding.role_ref.name == "quark-node"
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == \
        [("ServiceAccount", ds.spec.template.spec.service_account_name, ds.metadata.namespace)]


def test_daemonset_mounts_exactly_where_the_installer_writes():
    spec = manifests()["DaemonSet/quark-node"].spec.template.spec
    host_paths = {v.name: v.host_path.path for v in spec.volumes if v.host_path}
    init = next(c for c in spec.init_containers if c.name == "install")
    mounted = {m.mount_path: host_paths[m.name] for m in init.volume_mounts if m.name in host_paths}
    assert {f"/host{p}": p for p in install.HOST_DIRS} == mounted
    assert "--host-root" in init.command and init.command[init.command.index("--host-root") + 1] == "/host"
    tsord = next(c for c in spec.containers if c.name == "tsord")
    by_path = {m.mount_path: m for m in tsord.volume_mounts}
    assert host_paths[by_path["/run/quark"].name] == "/run/quark"          # the sandboxes' tsord socket
    netns = by_path["/var/run/netns"]
    assert host_paths[netns.name] == "/var/run/netns" and netns.mount_propagation == "HostToContainer"
    # the node's cgroup root, where tsord attaches the sockmap programs (its own cgroup namespace's
    # root would reach only its own container)
    assert host_paths[by_path["/sys/fs/cgroup"].name] == "/sys/fs/cgroup"
    assert spec.host_network and spec.host_pid


def test_the_configmap_is_a_tsor_yaml_tsord_accepts(tmp_path):
    cm = manifests()["ConfigMap/quark-tsor"]
    path = tmp_path / "tsor.yaml"
    path.write_text(cm.data["tsor.yaml"])
    secret = tmp_path / "tsor-secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    text = path.read_text().replace("/etc/quark/tsor-secret", str(secret))
    path.write_text(text)
    cfg = tsor_config.load(str(path))
    assert cfg.socket == "/run/quark/tsord.sock" and cfg.cluster_secret == b"s" * 32


def test_installer_on_a_scratch_host_twice(tmp_path, capsys):
    host = tmp_path / "host"
    (host / "etc" / "containerd").mkdir(parents=True)
    original = (Path("/etc/containerd/config.toml").read_text() if Path("/etc/containerd/config.toml").exists()
                else 'version = 2\n\n[plugins."io.containerd.grpc.v1.cri".cni]\n  bin_dir = "/usr/lib/cni"\n')
    (host / "etc" / "containerd" / "config.toml").write_text(original)
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "tsor.yaml").write_text("node: n1\n")
    (conf / "tsor-secret").write_text("x" * 32)
    first = install.Installer(str(host), str(REPO), str(conf), dry_run=True)
    first.run()
    assert first.commands == [["make", "-C", "/opt/quark/src", "install"], ["systemctl", "restart", "containerd"]]
    assert (host / "opt/quark/src/qvisor/cli.py").read_bytes() == (REPO / "qvisor/cli.py").read_bytes()
    assert not list((host / "opt/quark/src").rglob("__pycache__"))
    cfg = tomllib.loads((host / "etc/containerd/config.toml").read_text())
    assert install.IMPORTS_GLOB in cfg["imports"]
    assert (host / "etc/containerd/config.toml").read_text().replace(
        f'imports = ["{install.IMPORTS_GLOB}"]\n', "") == original          # nothing else touched
    assert (host / "etc/containerd/conf.d/quark.toml").read_text() == (DEPLOY / "containerd/quark.toml").read_text()
    cni_dir = tomllib.loads(original).get("plugins", {}).get("io.containerd.grpc.v1.cri", {}).get("cni", {}).get(
        "bin_dir", install.CNI_BIN_DEFAULT)
    assert os.readlink(host / cni_dir.lstrip("/") / "quark-cni") == "/opt/quark/src/.venv/bin/quark-cni"
    assert oct((host / "etc/quark/tsor-secret").stat().st_mode & 0o777) == "0o600"
    (host / "opt/quark/src/.venv/bin").mkdir(parents=True)   # as make install on the host leaves it
    (host / "opt/quark/src/.venv/bin/quark").touch()
    again = install.Installer(str(host), str(REPO), str(conf), dry_run=True)
    again.run()
    assert (again.changed, again.commands) == ([], [])   # idempotent: no write, no restart


@pytest.mark.parametrize("text, expected", [
    ("version = 2\n", f'version = 2\nimports = ["{install.IMPORTS_GLOB}"]\n'),
    ('[plugins]\n  x = 1\n', f'imports = ["{install.IMPORTS_GLOB}"]\n[plugins]\n  x = 1\n'),
    ('version = 2\nimports = ["/a.toml"]\n', f'version = 2\nimports = ["/a.toml", "{install.IMPORTS_GLOB}"]\n'),
    (f'imports = ["{install.IMPORTS_GLOB}"]\n', f'imports = ["{install.IMPORTS_GLOB}"]\n'),
])
def test_containerd_imports_line(text, expected):
    assert install.with_import(text, "config.toml") == expected


def test_containerd_config_it_cannot_edit_is_refused_by_name():
    with pytest.raises(install.InstallError, match="config.toml: not valid TOML"):
        install.with_import("version = = 2", "config.toml")
    with pytest.raises(install.InstallError, match="by hand"):
        install.with_import('imports = [\n  "/a.toml",\n]\n', "config.toml")


@pytest.fixture
def kube(tmp_path):
    from tests.support import fake_kube_api as k8s
    api = k8s.FakeKubeAPI()
    node = k8s.node("node-a", "10.99.0.1", ["10.1.0.0/24"])
    node["metadata"]["labels"] = {"kubernetes.io/hostname": "node-a"}
    api.put("nodes", node)
    yield api, k8s.write_kubeconfig(str(tmp_path / "kubeconfig"), api.url)
    api.stop()


def test_label_node_patches_the_node_through_the_api(kube):
    """The installer labels its node quark.io/runtime=true (the RuntimeClass schedules onto that
    label) with a merge patch of its labels, keeping the others; again is the same."""
    api, kubeconfig = kube
    for _ in range(2):
        install.label_node("node-a", kubeconfig)
        labels = api.objects["nodes"][("", "node-a")]["metadata"]["labels"]
        assert labels == {"kubernetes.io/hostname": "node-a", install.NODE_LABEL[0]: install.NODE_LABEL[1]}
    assert [r for r, q in api.requests if r.startswith("PATCH")] == ["PATCH nodes", "PATCH nodes"]


def test_label_node_says_what_the_api_server_answered(kube):
    """A node the API server does not know, or RBAC that does not allow the patch: one line naming
    the node, the label and the server's answer (no client exception dump)."""
    api, kubeconfig = kube
    what = f"labelling node node-x {install.NODE_LABEL[0]}={install.NODE_LABEL[1]}"
    with pytest.raises(install.InstallError) as e:
        install.label_node("node-x", kubeconfig)
    assert str(e.value) == f"{what}: the API server answered 404 Not Found"
    api.forbid("nodes")
    with pytest.raises(install.InstallError) as e:
        install.label_node("node-a", kubeconfig)
    assert str(e.value) == f"{what.replace('node-x', 'node-a')}: the API server answered 403 Forbidden"
    assert install.NODE_LABEL[0] not in api.objects["nodes"][("", "node-a")]["metadata"]["labels"]


def test_the_installer_runs_with_the_image_venv_which_has_the_kubernetes_client():
    """label_node imports the kubernetes client, which the image installs into its venv only (the
    system python3 has none): the init container must run the installer with that venv."""
    ds = manifests()["DaemonSet/quark-node"]
    init = ds.spec.template.spec.init_containers[0]
    assert init.command[:2] == ["/quark-src/.venv/bin/python", "/quark-src/deploy/install.py"]
    assert "make -C /quark-src venv" in (DEPLOY / "Dockerfile").read_text()
    assert "'.[test,k8s]'" in (REPO / "Makefile").read_text()   # the venv target's extras
