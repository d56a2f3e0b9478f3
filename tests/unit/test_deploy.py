"""deploy/: every manifest loads into the official Kubernetes client's models (the schema kubectl and
the API server hold it to), and the fields that make quark work are what the code expects: the
RuntimeClass handler containerd knows, RBAC covering what tsord watches, the DaemonSet mounting
exactly the host directories the installer writes, the ConfigMap a tsor.yaml tsord accepts. The
installer itself runs against a scratch host root: installed, again (nothing changes), with a newer
payload, and uninstalled (every file as it was); tests/integration/test_node_install.py installs on
a fresh node and runs pods there."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes", reason="the kubernetes client (pip install -e .) is needed")

from deploy import install, node_config, node_processes, versions  # noqa: E402
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


def _files(cleanup: bool = True) -> list[str]:
    """The manifests the kustomization lists, and (cleanup) deploy/cleanup's, applied on their own."""
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    return listed + (sorted(str(p.relative_to(DEPLOY)) for p in (DEPLOY / "cleanup").glob("*.yaml")) if cleanup else [])


def _documents(cleanup: bool = True) -> list[tuple[str, dict]]:
    return [(name, doc) for name in _files(cleanup) for doc in yaml.safe_load_all((DEPLOY / name).read_text())]


def manifests() -> dict[str, object]:
    """kind/name -> the client's model object, from every manifest under deploy/."""
    api = kubernetes.client.ApiClient()
    out = {}
    for name in _files():
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
            "Namespace/quark-system", "DaemonSet/quark-cleanup"} <= set(objs)


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
    assert built == {(d["kind"], d["metadata"]["name"]) for _, d in _documents(cleanup=False)}


def test_runtimeclass_names_the_handler_containerd_registers():
    rc = manifests()["RuntimeClass/quark"]
    with open(DEPLOY / "containerd" / "quark.toml", "rb") as f:
        runtimes = tomllib.load(f)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert rc.handler in runtimes and runtimes[rc.handler]["runtime_type"] == "io.containerd.quark.v1"
    assert rc.scheduling.node_selector == {install.NODE_LABEL[0]: install.NODE_LABEL[1]}


def test_pod_overhead_covers_what_a_pod_costs_outside_its_cgroup():
    """podFixed memory is bench/pod_overhead.py's figure (a pod's shim and both supervisors, PSS,
    the median once the sandbox factory has exited) with the margin its comment states, and not
    wildly more."""
    overhead = manifests()["RuntimeClass/quark"].overhead.pod_fixed["memory"]
    assert overhead.endswith("Mi")
    measured = json.loads((REPO / "bench" / "results" / "pod_overhead.json").read_text())
    outside = measured["summary"]["quark_factory_exited"]["outside_mib"]
    assert outside["n"] >= 10 and outside["median"] >= measured["summary"]["quark"]["outside_mib"]["median"]
    assert outside["median"] * 1.25 <= int(overhead[:-2]) <= outside["median"] * 2, (overhead, outside)
    assert "25% margin" in (REPO / "deploy" / "runtimeclass.yaml").read_text()


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
    for ds in ("quark-node", "quark-cleanup"):   # install, and uninstall
        spec = manifests()[f"DaemonSet/{ds}"].spec.template.spec
        host_paths = {v.name: v.host_path.path for v in spec.volumes if v.host_path}
        init = spec.init_containers[0]
        mounted = {m.mount_path: host_paths[m.name] for m in init.volume_mounts if m.name in host_paths}
        assert {f"/host{p}": p for p in install.HOST_DIRS} == mounted, ds
        assert "--host-root" in init.command and init.command[init.command.index("--host-root") + 1] == "/host"
        assert spec.host_pid, ds   # nsenter into the host's namespaces to restart containerd
    spec = manifests()["DaemonSet/quark-node"].spec.template.spec
    host_paths = {v.name: v.host_path.path for v in spec.volumes if v.host_path}
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


DEBIAN_CONTAINERD = '''version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
'''   # Debian 12's /etc/containerd/config.toml, as the containerd package installs it
NETWORK = {"cniVersion": "1.0.0", "name": "cbr0", "plugins": [
    {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "subnet": "10.88.0.0/16"}}]}


def scratch_payload(path: Path) -> Path:
    """A payload's shape (what deploy/payload.py builds; the integration test builds the real one)."""
    for rel, text in (("bin/quark", "front end"), ("bin/quark-cni", "cni"), ("bin/containerd-shim-quark-v1", "shim"),
                      ("lib/libz.so.1", "lib"), ("lib/python3.11/os.py", "# os")):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    (path / "lib/libz.so").symlink_to("libz.so.1")
    (path / "share").mkdir()
    shutil.copy2(DEPLOY / "containerd/quark.toml", path / "share/containerd-quark.toml")
    return path


def scratch_host(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(host root as a fresh Debian node has it, a payload, the ConfigMap/Secret directory)."""
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(DEBIAN_CONTAINERD)
    (host / "etc/cni/net.d").mkdir(parents=True)
    (host / "etc/cni/net.d/10-cbr0.conflist").write_text(json.dumps(NETWORK))
    (host / "usr/lib/cni").mkdir(parents=True)
    (host / "usr/lib/cni/bridge").write_text("plugin")
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "tsor.yaml").write_text("node: n1\n")
    (conf / "tsor-secret").write_text("x" * 32)
    return host, scratch_payload(tmp_path / "payload"), conf


def test_installer_on_a_scratch_host_again_upgraded_and_uninstalled(tmp_path):
    from tests.support.fresh_node import snapshot
    host, payload, conf = scratch_host(tmp_path)
    before = snapshot(host)
    first = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    first.install()
    assert first.commands == [["systemctl", "restart", "containerd"]]
    # the payload as a version of its own (deploy/versions.py), made current
    ident = versions.payload_id(str(payload))
    assert os.readlink(host / "opt/quark/current") == f"versions/{ident}"
    assert os.readlink(host / "opt/quark/lib") == "current/lib" and os.readlink(host / "opt/quark/share") == "current/share"
    assert os.readlink(host / "opt/quark/bin/quark") == f"../versions/{ident}/bin/quark"   # one link: Python's prefix
    assert (host / "opt/quark/bin/quark").read_text() == "front end"
    assert os.readlink(host / "opt/quark/lib/libz.so") == "libz.so.1"
    # quark's runtimes at the end of containerd's own config, the rest as it was, runc kept
    text = (host / "etc/containerd/config.toml").read_text()
    assert text.startswith(DEBIAN_CONTAINERD) and node_config.BEGIN in text
    runtimes = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["quark"]["runtime_type"] == "io.containerd.quark.v1" and runtimes["runc"]["runtime_type"] == \
        "io.containerd.runc.v2"
    assert runtimes["quark-runc"]["options"]["BinaryName"] == "/opt/quark/bin/quark"
    assert tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]["cni"]["conf_dir"] == "/etc/cni/net.d"
    # the programs where containerd looks, quark-cni last in the node's network
    assert os.readlink(host / "usr/lib/cni/quark-cni") == "/opt/quark/bin/quark-cni"
    assert os.readlink(host / "usr/local/bin/containerd-shim-quark-v1") == "/opt/quark/bin/containerd-shim-quark-v1"
    chained = json.loads((host / "etc/cni/net.d/10-cbr0.conflist").read_text())
    assert chained["plugins"] == NETWORK["plugins"] + [{"type": "quark-cni", "failOpen": True}]
    assert oct((host / "etc/quark/tsor-secret").stat().st_mode & 0o777) == "0o600"

    again = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    again.install()
    assert (again.changed, again.commands) == ([], [])   # idempotent: no write, no restart

    # a rebuilt payload, the same files at another time: nothing copied
    for f in (payload / "lib/python3.11/os.py", payload / "bin/quark-cni"):
        os.utime(f, (f.stat().st_atime, f.stat().st_mtime + 100))
    rebuilt = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    rebuilt.install()
    assert (rebuilt.changed, rebuilt.commands) == ([], [])
    # a newer payload: a version beside the first, made current; the first removed (nothing runs it)
    first_tree = os.path.realpath(host / "opt/quark/current")
    (payload / "bin/quark").write_text("front end 2")
    (payload / "lib/libz.so.1").unlink()
    (payload / "lib/libz.so").unlink()
    newer = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    newer.install()
    tree = f"/opt/quark/versions/{versions.payload_id(str(payload))}"
    assert sorted(newer.changed) == sorted([
        tree, "/opt/quark/current", "/opt/quark/versions/" + os.path.basename(first_tree),
        *(f"/opt/quark/bin/{n}" for n in ("containerd-shim-quark-v1", "quark", "quark-cni"))])
    assert newer.commands == [] and not os.path.exists(first_tree)
    assert (host / "opt/quark/bin/quark").read_text() == "front end 2" and not (host / "opt/quark/lib/libz.so.1").exists()
    assert os.readlink(host / "opt/quark/bin/quark") == f"..{tree[len('/opt/quark'):]}/bin/quark"

    gone = install.Installer(str(host), str(payload), dry_run=True)
    gone.uninstall()
    assert gone.commands == [["systemctl", "restart", "containerd"]]
    after = snapshot(host)
    assert sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)) == []
    again = install.Installer(str(host), str(payload), dry_run=True)
    again.uninstall()   # uninstalled already: nothing to do
    assert (again.changed, again.commands) == ([], [])


def test_a_version_a_program_still_uses_is_kept_until_it_ends(tmp_path):
    """An upgrade leaves the tree of a version a running program maps (its late imports and
    dlopens read that tree, never the next version's) and says so; the next run removes it once
    the program has ended. A payload copied flat into /opt/quark by an earlier installer is set
    aside as a version the same way."""
    host, payload, conf = scratch_host(tmp_path)
    home = host / "opt/quark"
    for rel in ("bin/quark", "lib/libz.so.1"):   # an earlier installer's flat copy
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("flat " + rel)
    mapper = "import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); " \
             "f.close(); print('mapped', flush=True); sys.stdin.read()"
    user = subprocess.Popen([sys.executable, "-c", mapper, str(home / "lib/libz.so.1")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout.readline() == "mapped\n"
        first = install.Installer(str(host), str(payload), str(conf), dry_run=True)
        first.install()
        assert (home / "versions/flat/bin/quark").read_text() == "flat bin/quark"   # moved, not removed
        assert versions.users(str(home / "versions/flat")) == [user.pid]
        kept = f"/opt/quark/versions/flat kept: running programs use it (pids {user.pid})"
        assert any(n.startswith(kept) for n in first.notes), first.notes
        assert (home / "bin/quark").read_text() == "front end"
        # an upgrade meanwhile: the first version, which nothing maps, goes; the one in use stays
        one = os.path.realpath(home / "current")
        (payload / "bin/quark").write_text("front end 2")
        upgrade = install.Installer(str(host), str(payload), str(conf), dry_run=True)
        upgrade.install()
        assert not os.path.exists(one) and (home / "versions/flat/lib/libz.so.1").exists()
    finally:
        user.stdin.close()
        user.wait(10)
    again = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    again.install()
    assert again.changed == ["/opt/quark/versions/flat"]
    assert sorted(os.listdir(home / "versions")) == [versions.payload_id(str(payload))]


def test_a_payload_names_itself_by_its_version_and_files(tmp_path):
    a, b = scratch_payload(tmp_path / "a"), scratch_payload(tmp_path / "b")
    os.utime(b / "bin/quark", (0, 0))   # times and owners are not the payload's content
    assert versions.payload_id(str(a)) == versions.payload_id(str(b))
    (b / "bin/quark").chmod(0o755)
    assert versions.payload_id(str(a)) != versions.payload_id(str(b))
    (a / versions.ID_FILE).write_text("1.2.3-abc\n")   # deploy/payload.py writes it
    assert versions.payload_id(str(a)) == "1.2.3-abc"
    (a / versions.ID_FILE).write_text("../x\n")
    with pytest.raises(ValueError, match="not a payload id"):
        versions.payload_id(str(a))


def test_uninstall_leaves_a_file_changed_since_and_says_so(tmp_path):
    host, payload, conf = scratch_host(tmp_path)
    install.Installer(str(host), str(payload), str(conf), dry_run=True).install()
    conflist = host / "etc/cni/net.d/10-cbr0.conflist"
    conflist.write_text(conflist.read_text().replace("cni0", "cni1"))   # the network plugin rewrote it
    gone = install.Installer(str(host), str(payload), dry_run=True)
    gone.uninstall()
    assert "cni1" in conflist.read_text()
    assert gone.notes == ["/etc/cni/net.d/10-cbr0.conflist changed since quark wrote it: left as it is"]
    assert (host / "etc/containerd/config.toml").read_text() == DEBIAN_CONTAINERD
    assert not (host / "opt/quark").exists()


def test_a_node_without_a_network_yet_is_installed_and_told(tmp_path):
    host, payload, conf = scratch_host(tmp_path)
    (host / "etc/cni/net.d/10-cbr0.conflist").unlink()
    inst = install.Installer(str(host), str(payload), str(conf), dry_run=True)
    inst.install()
    assert any("no network configuration yet" in n for n in inst.notes)


def test_main_says_what_it_did_and_refuses_a_missing_payload(tmp_path, capsys):
    host, payload, conf = scratch_host(tmp_path)
    assert install.main(["--host-root", str(host), "--payload", str(tmp_path / "none"), "--dry-run"]) == 1
    assert "not a quark payload (make payload builds one)" in capsys.readouterr().err
    assert install.main(["--host-root", str(host), "--payload", str(payload), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would run on the host: systemctl restart containerd" in out and "quark-install: installed:" in out


@pytest.mark.parametrize("text, has_runc", [
    (DEBIAN_CONTAINERD, False),
    ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n  runtime_type = '
     '"io.containerd.runc.v2"\n  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
     '    SystemdCgroup = true\n', True),
], ids=["no runtimes named", "runc with its options"])
def test_containerd_runtimes_block(text, has_runc):
    tables = node_config.node_runtimes((DEPLOY / "containerd/quark.toml").read_text(), install.QUARK_HOME)
    new = node_config.with_runtimes(text, tables, "config.toml")
    assert new.startswith(text.rstrip("\n"))
    runtimes = tomllib.loads(new)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    # a config that names runtimes keeps its own runc; one that names none gets containerd's default
    assert runtimes["runc"] == ({"runtime_type": "io.containerd.runc.v2", "options": {"SystemdCgroup": True}}
                                if has_runc else {"runtime_type": "io.containerd.runc.v2"})
    assert node_config.with_runtimes(new, tables, "config.toml") == new          # again: the same
    newer = node_config.with_runtimes(new, tables.replace("/opt/quark/bin/quark", "/opt/quark/bin/quark2"), "c")
    assert newer.count(node_config.BEGIN) == 1 and "/opt/quark/bin/quark2" in newer   # the block replaced


@pytest.mark.parametrize("text, expected", [
    ("version = = 2", "config.toml: not valid TOML"),
    ('[plugins.cri]\n', "config.toml: version 1: quark's runtimes are written for version 2"),
    ('version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.quark]\n  runtime_type = "x"\n',
     "config.toml: already configures the runtime 'quark'"),
], ids=["invalid TOML", "version 1", "a runtime named quark already"])
def test_containerd_config_it_cannot_edit_is_refused_by_name(text, expected):
    tables = node_config.node_runtimes((DEPLOY / "containerd/quark.toml").read_text(), install.QUARK_HOME)
    with pytest.raises(node_config.InstallError, match=expected):
        node_config.with_runtimes(text, tables, "config.toml")


@pytest.mark.parametrize("text, expected", [
    ("{", "net.conf: not valid JSON"),
    (json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "bridge"}), "net.conf: not a conflist"),
    (json.dumps({**NETWORK, "cniVersion": "0.3.1"}), "net.conf: cniVersion '0.3.1': quark-cni chains into"),
])
def test_a_network_quark_cni_cannot_join_is_refused_by_name(text, expected):
    with pytest.raises(node_config.InstallError, match=expected):
        node_config.with_quark_cni(text, "net.conf")


def test_quark_processes_and_stopping_idle_factories(tmp_path):
    """Uninstall refuses while a program from the payload runs, and ends the sandbox factories
    (they outlive their last container for a while) before it removes anything."""
    home = tmp_path / "opt-quark"
    (home / "bin").mkdir(parents=True)
    shutil.copy2(sys.executable, home / "bin/python3")   # a program running from `home`
    code = "import time; time.sleep(60)"
    plain = subprocess.Popen([str(home / "bin/python3"), "-c", code])
    factory = subprocess.Popen([str(home / "bin/python3"), "-m", "qvisor.factory", "--dir", str(tmp_path / "f")],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        time.sleep(0.5)
        running = {int(p.split()[0]): p for p in node_processes.quark_processes(str(home))}
        assert {plain.pid, factory.pid} <= set(running) and node_processes.FACTORY not in running[plain.pid]
        assert all(node_processes.FACTORY in p for pid, p in running.items() if pid != plain.pid)   # it, its workers
        node_processes.stop_factories(str(home))
        assert factory.wait(10) is not None and plain.poll() is None
        assert [int(p.split()[0]) for p in node_processes.quark_processes(str(home))] == [plain.pid]
    finally:
        for p in (plain, factory):
            p.kill()
            p.wait()


def test_label_node_takes_the_label_off_on_uninstall(kube):
    api, kubeconfig = kube
    install.label_node("node-a", kubeconfig)
    install.label_node("node-a", kubeconfig, remove=True)
    assert api.objects["nodes"][("", "node-a")]["metadata"]["labels"] == {"kubernetes.io/hostname": "node-a"}
    install.label_node("node-x", kubeconfig, remove=True)   # no such node: nothing to take off


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
    with pytest.raises(node_config.InstallError) as e:
        install.label_node("node-x", kubeconfig)
    assert str(e.value) == f"{what}: the API server answered 404 Not Found"
    api.forbid("nodes")
    with pytest.raises(node_config.InstallError) as e:
        install.label_node("node-a", kubeconfig)
    assert str(e.value) == f"{what.replace('node-x', 'node-a')}: the API server answered 403 Forbidden"
    assert install.NODE_LABEL[0] not in api.objects["nodes"][("", "node-a")]["metadata"]["labels"]


def test_the_init_containers_run_the_images_payload_which_has_the_kubernetes_client():
    """The image holds the payload at /opt/quark (deploy/image.py); the installer and tsord run with
    its Python, which has the kubernetes client label_node and the route source import."""
    from deploy import payload
    for ds, verb in (("quark-node", []), ("quark-cleanup", ["--uninstall"])):
        init = manifests()[f"DaemonSet/{ds}"].spec.template.spec.init_containers[0]
        assert init.command[:1 + len(verb)] == ["/opt/quark/bin/quark-install", *verb]
    assert manifests()["DaemonSet/quark-node"].spec.template.spec.containers[0].command[0] == "/opt/quark/bin/tsord"
    assert {"bin/quark-install", "bin/tsord"} <= set(payload.PROGRAMS)
    assert "k8s" in payload.EXTRAS
    from deploy import image
    assert image.PAYLOAD_DIR == "opt/quark" and f"{image.REPOSITORY}:" in \
        manifests()["DaemonSet/quark-node"].spec.template.spec.containers[0].image


def test_the_version_is_written_in_one_place_and_a_payload_is_stamped_with_its_own(tmp_path):
    """pyproject's version is qlib/version.py's; `quark --version` and a sandbox's state say it; a
    payload (and so a node image) stamped V says V, and a version with other characters is refused."""
    from deploy import payload
    from qlib.version import VERSION
    from qvisor import cli
    from qvisor.state import ContainerState
    assert tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"] == VERSION
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        cli.build_parser().parse_args(["--version"])
    assert out.getvalue().startswith(f"quark {VERSION} ")
    assert "version" in {f.name for f in dataclasses.fields(ContainerState)}
    version_py = tmp_path / "version.py"
    version_py.write_text((DEPLOY.parent / "qlib/version.py").read_text())
    payload.stamp(str(version_py), "1.2.3.post1")
    assert 'VERSION = "1.2.3.post1"' in version_py.read_text() and 'OCI_SPEC = "1.0.2"' in version_py.read_text()
    with pytest.raises(payload.PayloadError, match="letters, digits"):
        payload.stamp(str(version_py), '1"; import os')
