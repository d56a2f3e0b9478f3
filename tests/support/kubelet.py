"""A DaemonSet's pod run on a test node the way kubelet runs it, through CRI; not a kubelet.

No kubelet or API server runs here, so a test that must show a manifest's pod working (the node
image's DaemonSets: tests/integration/test_node_image.py) gives its pod template to `PodRunner`,
which makes the CRI calls kubelet makes for it, from the manifest's own fields:

  RunPodSandbox     the pod's namespaces (hostNetwork, hostPID), privileged when any container is,
                    a cgroup parent under /kubepods, the log directory under /var/log/pods
  volumes           hostPath (DirectoryOrCreate made on the node, Directory required), configMap and
                    secret written as files under the node's /var/lib/kubelet/pods/UID (defaultMode;
                    a secret 0644 unless told), `subPath` mounts of one file, mountPropagation, and the
                    service account's token, ca.crt and namespace at
                    /var/run/secrets/kubernetes.io/serviceaccount (automountServiceAccountToken)
  env               value and fieldRef (spec.nodeName, metadata.name, metadata.namespace), and the
                    API server's KUBERNETES_SERVICE_HOST and _PORT, as kubelet injects them
  initContainers    created and started one after another, each waited for and required to exit 0
                    (kubelet would restart a failed one; a test wants its log instead), CRI calls
                    retried while containerd restarts under them (the installer restarts it)
  containers        created and started; `resources.requests.cpu` as CPU shares
  delete            StopPodSandbox and RemovePodSandbox, then the pod's directory

What the manifest asks that this does not do is refused by name (`KubeletError`), so a template
cannot silently run differently here than on a node.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from tests.support.cri import cri_v1_pb2 as pb
from tests.support.cri.client import CriClient, log_text

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
PODS_DIR = "/var/lib/kubelet/pods"
PROPAGATION = {None: pb.PROPAGATION_PRIVATE, "None": pb.PROPAGATION_PRIVATE,
               "HostToContainer": pb.PROPAGATION_HOST_TO_CONTAINER, "Bidirectional": pb.PROPAGATION_BIDIRECTIONAL}
POD_FIELDS = {"serviceAccountName", "hostNetwork", "hostPID", "dnsPolicy", "priorityClassName", "tolerations",
              "nodeSelector", "initContainers", "containers", "volumes", "automountServiceAccountToken"}
CONTAINER_FIELDS = {"name", "image", "command", "args", "env", "securityContext", "resources", "volumeMounts"}


class KubeletError(Exception):
    pass


@dataclass
class Pod:
    name: str
    namespace: str
    uid: str
    id: str                        # the sandbox's, from RunPodSandbox
    config: pb.PodSandboxConfig
    containers: dict[str, str] = field(default_factory=dict)   # name -> container id

    @property
    def directory(self) -> str:
        return f"{PODS_DIR}/{self.uid}"


def load_manifests(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def daemonset_template(docs: list[dict], name: str) -> tuple[dict, dict]:
    """(the DaemonSet named `name`, its pod template)."""
    for d in docs:
        if d.get("kind") == "DaemonSet" and d["metadata"]["name"] == name:
            return d, d["spec"]["template"]
    raise KubeletError(f"no DaemonSet {name!r}")


class PodRunner:
    """Runs pod templates on `node` (tests/support/fresh_node.FreshNode) through its containerd.

    `objects`: the ConfigMaps and Secrets the templates name, {("ConfigMap"|"Secret", namespace,
    name): {key: text}}. `api`: (host, port) of the API server as the pods see it, and
    `service_account`: a directory on this host holding token, ca.crt, namespace
    (tests/support/fake_kube_api.write_service_account)."""

    def __init__(self, node, cri: CriClient, node_name: str, objects: dict[tuple[str, str, str], dict[str, str]],
                 api: tuple[str, int] | None = None, service_account: str | None = None) -> None:
        self.node, self.cri, self.node_name = node, cri, node_name
        self.objects, self.api, self.service_account = objects, api, service_account

    # ---- CRI calls, through containerd restarts ---------------------------------------------------
    def call(self, name: str, request: object, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.cri.call(name, request)
            except grpc.RpcError as e:
                # containerd restarting (the installer restarts it): its socket gone, then its CRI
                # plugin still loading
                restarting = e.code() == grpc.StatusCode.UNAVAILABLE or (
                    e.code() == grpc.StatusCode.UNKNOWN and "not initialized yet" in (e.details() or ""))
                if not restarting or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # ---- the pod ---------------------------------------------------------------------------------
    def run(self, template: dict, name: str, namespace: str, image: str | None = None,
            init_timeout: float = 300) -> Pod:
        """The pod of `template`: sandbox, init containers run to completion, containers started.
        `image` replaces every container's image (the DaemonSet updated to a new tag)."""
        spec = template["spec"]
        unknown = set(spec) - POD_FIELDS
        if unknown:
            raise KubeletError(f"pod spec fields this stand-in does not run: {sorted(unknown)}")
        containers = spec.get("initContainers", []) + spec["containers"]
        for c in containers:
            if set(c) - CONTAINER_FIELDS:
                raise KubeletError(f"container {c['name']}: fields not run here: {sorted(set(c) - CONTAINER_FIELDS)}")
        uid = str(uuid.uuid4())
        privileged = any(c.get("securityContext", {}).get("privileged") for c in containers)
        ns = pb.NamespaceOption(network=pb.NODE if spec.get("hostNetwork") else pb.POD,
                                pid=pb.NODE if spec.get("hostPID") else pb.CONTAINER, ipc=pb.POD)
        labels = {**template["metadata"].get("labels", {}), "io.kubernetes.pod.name": name,
                  "io.kubernetes.pod.namespace": namespace, "io.kubernetes.pod.uid": uid}
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            log_directory=f"/var/log/pods/{namespace}_{name}_{uid}", labels=labels,
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=f"/kubepods/pod{uid}",
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns, privileged=privileged)))
        self.node.path(config.log_directory).mkdir(parents=True, exist_ok=True)
        volumes = self._volumes(spec, uid, namespace)
        resp = self.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config))
        pod = Pod(name, namespace, uid, resp.pod_sandbox_id, config)
        try:
            for c in spec.get("initContainers", []):
                cid = self._start(pod, c, ns, volumes, image, spec)
                st = self._wait_exited(cid, init_timeout)
                if st.exit_code != 0:
                    raise KubeletError(f"init container {c['name']} exited {st.exit_code}: {st.message}\n"
                                       f"{self.log(pod, c['name'])}")
            for c in spec["containers"]:
                self._start(pod, c, ns, volumes, image, spec)
        except BaseException:
            self.delete(pod)
            raise
        return pod

    def delete(self, pod: Pod) -> None:
        """kubelet's teardown of a deleted pod: StopPodSandbox (the containers get SIGTERM, then
        SIGKILL), RemovePodSandbox, the pod's volumes."""
        self.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod.id))
        self.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod.id))
        self.node.run(["rm", "-rf", pod.directory])

    def log(self, pod: Pod, container: str) -> str:
        return log_text(pod.config, container, root=f"/proc/{self.node.pid}/root")

    def status(self, cid: str) -> pb.ContainerStatus:
        return self.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid)).status

    # ---- parts -----------------------------------------------------------------------------------
    def _start(self, pod: Pod, c: dict, ns: pb.NamespaceOption, volumes: dict[str, tuple[str, bool]],
               image: str | None, spec: dict) -> str:
        mounts = []
        for m in c.get("volumeMounts", []):
            host, read_only = volumes[m["name"]]
            if m.get("subPath"):
                host = os.path.join(host, m["subPath"])
            mounts.append(pb.Mount(container_path=m["mountPath"], host_path=host,
                                   readonly=m.get("readOnly", False) or read_only,
                                   propagation=PROPAGATION[m.get("mountPropagation")]))
        if self.service_account and spec.get("automountServiceAccountToken", True):
            mounts.append(pb.Mount(container_path=SERVICE_ACCOUNT_DIR, host_path=volumes["\0serviceaccount"][0],
                                   readonly=True))
        envs = [pb.KeyValue(key=k, value=v) for k, v in self._env(pod, c)]
        security = c.get("securityContext", {})
        if set(security) - {"privileged"}:
            raise KubeletError(f"container {c['name']}: securityContext fields not run here: {sorted(security)}")
        requests = c.get("resources", {}).get("requests", {})
        shares = max(2, _milli(requests["cpu"]) * 1024 // 1000) if "cpu" in requests else 2
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=c["name"], attempt=0), image=pb.ImageSpec(image=image or c["image"]),
            command=c.get("command", []), args=c.get("args", []), envs=envs, mounts=mounts,
            log_path=f"{c['name']}/0.log", labels={"io.kubernetes.container.name": c["name"]},
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(cpu_shares=shares),
                security_context=pb.LinuxContainerSecurityContext(
                    namespace_options=ns, privileged=bool(security.get("privileged")))))
        cid = self.call("CreateContainer", pb.CreateContainerRequest(
            pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config)).container_id
        self.call("StartContainer", pb.StartContainerRequest(container_id=cid))
        pod.containers[c["name"]] = cid
        return cid

    def _wait_exited(self, cid: str, timeout: float) -> pb.ContainerStatus:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(cid)
            if st.state == pb.CONTAINER_EXITED:
                return st
            if time.monotonic() > deadline:
                raise KubeletError(f"container {cid[:12]} still {pb.ContainerState.Name(st.state)} after {timeout} s")
            time.sleep(0.2)

    def _env(self, pod: Pod, c: dict) -> list[tuple[str, str]]:
        out = []
        if self.api:
            out += [("KUBERNETES_SERVICE_HOST", self.api[0]), ("KUBERNETES_SERVICE_PORT", str(self.api[1]))]
        fields = {"spec.nodeName": self.node_name, "metadata.name": pod.name, "metadata.namespace": pod.namespace}
        for e in c.get("env", []):
            if "value" in e:
                out.append((e["name"], str(e["value"])))
            elif "fieldRef" in e.get("valueFrom", {}) and e["valueFrom"]["fieldRef"]["fieldPath"] in fields:
                out.append((e["name"], fields[e["valueFrom"]["fieldRef"]["fieldPath"]]))
            else:
                raise KubeletError(f"container {c['name']}: env {e['name']}: not a source run here: {e}")
        return out

    def _volumes(self, spec: dict, uid: str, namespace: str) -> dict[str, tuple[str, bool]]:
        """Each volume's directory on the node (made or written now) and whether it is read-only."""
        out: dict[str, tuple[str, bool]] = {}
        base = f"{PODS_DIR}/{uid}/volumes"
        for v in spec.get("volumes", []):
            if "hostPath" in v:
                path, kind = v["hostPath"]["path"], v["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    self.node.run(["mkdir", "-p", "-m", "0755", path])
                elif kind == "Directory" and self.node.run(["test", "-d", path], check=False).returncode != 0:
                    raise KubeletError(f"volume {v['name']}: hostPath {path} is not a directory on the node")
                elif kind not in ("", "Directory", "DirectoryOrCreate"):
                    raise KubeletError(f"volume {v['name']}: hostPath type {kind!r} not run here")
                out[v["name"]] = (path, False)
            elif "configMap" in v or "secret" in v:
                kind = "ConfigMap" if "configMap" in v else "Secret"
                src = v["configMap"] if kind == "ConfigMap" else v["secret"]
                ref = src["name"] if kind == "ConfigMap" else src["secretName"]
                data = self.objects.get((kind, namespace, ref))
                if data is None:
                    raise KubeletError(f"volume {v['name']}: {kind} {namespace}/{ref} not given")
                d = f"{base}/kubernetes.io~{kind.lower()}/{v['name']}"
                self._write_files(d, data, src.get("defaultMode", 0o644))
                out[v["name"]] = (d, True)
            else:
                raise KubeletError(f"volume {v['name']}: not a kind run here: {sorted(v)}")
        if self.service_account:
            d = f"{base}/kubernetes.io~projected/kube-api-access"
            self._write_files(d, {n: Path(self.service_account, n).read_text()
                                  for n in ("token", "ca.crt", "namespace")}, 0o644)
            out["\0serviceaccount"] = (d, True)
        return out

    def _write_files(self, directory: str, data: dict[str, str], mode: int) -> None:
        target = self.node.path(directory)
        target.mkdir(parents=True, exist_ok=True)
        for key, text in data.items():
            (target / key).write_text(text)
            (target / key).chmod(mode)


def _milli(cpu: str | int) -> int:
    s = str(cpu)
    return int(s[:-1]) if s.endswith("m") else int(float(s) * 1000)
