"""The cgroup v2 lane's smoke test: on a cgroup2-only host (the qemu guest of `make test-cgroup2`),
`quark run` puts a busybox container in /sys/fs/cgroup/quark/<id> with its memory limit in
memory.max, and `quark delete` removes that cgroup."""
from __future__ import annotations

import os
import uuid

from tests.integration.conftest import edit_config

MiB = 1 << 20


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def test_memory_limit_in_the_containers_v2_cgroup(quark, bundle) -> None:
    # the lane's own promise first: a unified hierarchy, no v1 controller anywhere
    assert os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    assert "memory" in _read("/sys/fs/cgroup/cgroup.controllers").split()
    cid = f"smoke-{uuid.uuid4().hex[:8]}"
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s["linux"].setdefault("resources", {}).update(memory={"limit": 64 * MiB}))
    quark("run", "-d", "--bundle", b, cid)
    d = f"/sys/fs/cgroup/quark/{cid}"
    assert _read(f"{d}/memory.max") == str(64 * MiB)
    pid = quark.state(cid)["pid"]
    assert str(pid) in _read(f"{d}/cgroup.procs").split()
    assert _read(f"/proc/{pid}/cgroup") == f"0::/quark/{cid}"   # v2 only: one line, hierarchy 0
    quark("delete", "--force", cid)
    assert not os.path.exists(d)
