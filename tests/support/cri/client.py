"""A CRI v1 client over containerd's gRPC socket, calling what kubelet calls, in kubelet's order.

`CriClient.run_pod` / `create_container` build the requests kubelet builds for a plain pod (metadata,
log directory, cgroup parent, namespace options); `remove_all_pods` is kubelet's teardown
(StopPodSandbox, then RemovePodSandbox, which removes the pod's containers).
"""
from __future__ import annotations

import os
import uuid

import grpc

from tests.support.cri import cri_v1_pb2 as pb
from tests.support.cri import cri_v1_pb2_grpc as pb_grpc

TIMEOUT = 120.0   # seconds per call: a 2-core host shared with other test runs


class CriClient:
    """RuntimeService and ImageService stubs on one channel to a containerd socket."""

    def __init__(self, address: str, cgroup_parent: str = "/quark-cri-tests", log_root: str = "/tmp") -> None:
        self.channel = grpc.insecure_channel(f"unix://{address}")
        self.runtime = pb_grpc.RuntimeServiceStub(self.channel)
        self.image = pb_grpc.ImageServiceStub(self.channel)
        self.cgroup_parent = cgroup_parent
        self.log_root = log_root

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def call(self, name: str, request: object, timeout: float = TIMEOUT):
        """RuntimeService.NAME(request)."""
        return getattr(self.runtime, name)(request, timeout=timeout)

    def sandbox_config(self, name: str, *, annotations: dict[str, str] | None = None) -> pb.PodSandboxConfig:
        uid = uuid.uuid4().hex
        return pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, uid=uid, namespace="default", attempt=0),
            hostname=name, log_directory=f"{self.log_root}/{name}-{uid[:8]}",
            labels={"io.kubernetes.pod.name": name}, annotations=annotations or {},
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.cgroup_parent}/pod{uid}",
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD))))

    def run_pod(self, name: str, handler: str, **kw) -> tuple[str, pb.PodSandboxConfig]:
        """RunPodSandbox; answers (pod id, the config, which CreateContainer needs again)."""
        config = self.sandbox_config(name, **kw)
        os.makedirs(config.log_directory, exist_ok=True)
        resp = self.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config, runtime_handler=handler))
        return resp.pod_sandbox_id, config

    def create_container(self, pod_id: str, sandbox: pb.PodSandboxConfig, name: str, image: str,
                         command: list[str], *, tty: bool = False, stdin: bool = False,
                         envs: dict[str, str] | None = None, add_capabilities: list[str] | None = None) -> str:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name, attempt=0), image=pb.ImageSpec(image=image),
            command=command, log_path=f"{name}/0.log", tty=tty, stdin=stdin,
            envs=[pb.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
            labels={"io.kubernetes.container.name": name},
            linux=pb.LinuxContainerConfig(security_context=pb.LinuxContainerSecurityContext(
                namespace_options=pb.NamespaceOption(network=pb.POD, pid=pb.CONTAINER, ipc=pb.POD),
                capabilities=pb.Capability(add_capabilities=add_capabilities or []))))
        resp = self.call("CreateContainer", pb.CreateContainerRequest(
            pod_sandbox_id=pod_id, config=config, sandbox_config=sandbox))
        return resp.container_id

    def start_container(self, cid: str) -> None:
        self.call("StartContainer", pb.StartContainerRequest(container_id=cid))

    def container_status(self, cid: str) -> pb.ContainerStatus:
        return self.call("ContainerStatus", pb.ContainerStatusRequest(container_id=cid)).status

    def pod_status(self, pod_id: str, verbose: bool = False) -> pb.PodSandboxStatusResponse:
        return self.call("PodSandboxStatus", pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose))

    def exec_sync(self, cid: str, cmd: list[str], timeout: int = 60) -> pb.ExecSyncResponse:
        return self.call("ExecSync", pb.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=timeout),
                         timeout=timeout + 30)

    def list_containers(self, pod_id: str = "") -> list[pb.Container]:
        flt = pb.ContainerFilter(pod_sandbox_id=pod_id)
        return list(self.call("ListContainers", pb.ListContainersRequest(filter=flt)).containers)

    def list_pods(self) -> list[pb.PodSandbox]:
        return list(self.call("ListPodSandbox", pb.ListPodSandboxRequest()).items)

    def stop_pod(self, pod_id: str) -> None:
        self.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=pod_id))

    def remove_pod(self, pod_id: str) -> None:
        self.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def teardown_pod(self, pod_id: str) -> None:
        """kubelet's order: StopPodSandbox, then RemovePodSandbox."""
        self.stop_pod(pod_id)
        self.remove_pod(pod_id)

    def remove_all_pods(self) -> None:
        for pod in self.list_pods():
            self.teardown_pod(pod.id)


def log_text(config, name: str, root: str = "") -> str:
    """A container's CRI log (`<time> <stream> <F|P> <line>` per line) as the lines' text; `root`:
    where the filesystem containerd wrote it in is seen from here (a test node's /proc/PID/root)."""
    path = root + os.path.join(config.log_directory, name, "0.log")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(line.split(" ", 3)[3] + ("\n" if line.split(" ", 3)[2] == "F" else "")
                           for line in f.read().splitlines() if line.count(" ") >= 3)
    except FileNotFoundError:
        return ""
