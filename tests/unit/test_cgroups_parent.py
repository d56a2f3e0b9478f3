"""A cgroup's parent: where a Kubernetes container's pod is (the supervisor's idle check reads it)."""
from __future__ import annotations

from qvisor.cgroups.v1 import V1Cgroup
from qvisor.cgroups.v2 import V2Cgroup


def test_a_containers_parent_is_its_pods_cgroup_and_the_top_has_none():
    mounts = {"cpuacct": "/sys/fs/cgroup/cpu,cpuacct", "memory": "/sys/fs/cgroup/memory"}
    c1 = V1Cgroup("/kubepods/burstable/pod7/abc", mounts)
    assert c1.parent().path == "/kubepods/burstable/pod7" and c1.parent().mounts is mounts
    c2 = V2Cgroup("/kubepods.slice/kubepods-pod7.slice/cri-containerd-abc.scope", root="/sys/fs/cgroup")
    assert c2.parent().dir == "/sys/fs/cgroup/kubepods.slice/kubepods-pod7.slice"
    assert V1Cgroup("/quark", mounts).parent() is None and V2Cgroup("/quark", root="/r").parent() is None
