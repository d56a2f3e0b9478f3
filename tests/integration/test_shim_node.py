"""One shim for the node (`shim: {scope: node}` in quark's host configuration), driven as containerd
drives it: `containerd-shim-quark-v1 ... start` in a bundle, then ttrpc on the address it prints.

Containers of different pods get the same shim; the shim goes only once it has served nothing and
answered nothing for NODE_IDLE_S after a Shutdown; a `start` that finds it, however close to that
moment, gets a shim that answers containerd's next call; a value the setting cannot take is refused
at `start`, naming the field, with no shim and no socket left. Through containerd's CRI:
tests/integration/test_cri_node_shim.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import empty_pb2

from shim import paths
from shim.pb import shim_pb2 as pb
from shim.serve import NODE_IDLE_S
from shim.service import SERVICE
from shim.ttrpc import Client, socket_path
from tests.support.processes import alive, wait_gone

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the shim's socket lives under /run/containerd/s")]

SHIM = os.path.join(os.path.dirname(sys.executable), "containerd-shim-quark-v1")
REPO = Path(__file__).resolve().parents[2]


class Node:
    """Bundles and `start`s against one made-up containerd address (no containerd: nothing is created)."""

    def __init__(self, tmp_path, scope: str = "node") -> None:
        self.tmp = tmp_path
        self.config = tmp_path / "config.yaml"
        self.config.write_text(f"shim:\n  scope: {scope}\n")
        self.containerd = str(tmp_path / "no-containerd.sock")
        self.env = dict(os.environ, QUARK_CONFIG=str(self.config), TTRPC_ADDRESS=self.containerd + ".ttrpc")
        self.pids: set[int] = set()

    def bundle(self, cid: str, pod: str) -> str:
        b = self.tmp / cid
        b.mkdir()
        (b / "config.json").write_text(json.dumps({"annotations": {paths.SANDBOX_ANNOTATION: pod}}))
        return str(b)

    def start(self, cid: str, pod: str = "", code: str | None = None) -> tuple[str, int]:
        """containerd's `start` of the shim; `code`: a directory holding another installation of
        quark's packages to run it from (as after an upgrade)."""
        bundle = self.bundle(cid, pod or cid)
        argv, env = [SHIM], self.env
        if code:
            argv, env = [sys.executable, "-m", "shim.main"], dict(self.env, PYTHONPATH=code)
        p = subprocess.run([*argv, "-namespace", "t", "-address", self.containerd, "-id", cid, "start"],
                           cwd=bundle, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        pid = int(open(os.path.join(bundle, "shim.pid")).read())
        self.pids.add(pid)
        return p.stdout, pid

    def close(self) -> None:
        for pid in self.pids:
            if alive(pid):
                os.kill(pid, 9)
            wait_gone(pid)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def call(address: str, method: str, req, resp_type):
    c = Client(socket_path(address), timeout=10)
    try:
        return c.call(SERVICE, method, req, resp_type)
    finally:
        c.close()


def test_containers_of_different_pods_are_served_by_the_nodes_one_shim(node):
    a, pid_a = node.start("a1", pod="pod-a")
    b, pid_b = node.start("b1", pod="pod-b")
    c, pid_c = node.start("lone")
    assert a == b == c and pid_a == pid_b == pid_c
    assert a == paths.socket_address(node.containerd, "t", paths.node_group())
    assert call(a, "Connect", pb.ConnectRequest(id="b1"), pb.ConnectResponse).shim_pid == pid_a
    assert os.readlink(f"/proc/{pid_a}/cwd") == "/"   # it holds none of the bundles it outlives


def test_a_quark_installed_beside_makes_a_node_shim_of_its_own_and_leaves_the_old_one_serving(node, tmp_path):
    """After an upgrade the new quark's `start` does not join the node's shim of the old one (which
    would run the old code for every new pod): it makes its own, and the old one serves on."""
    old, old_pid = node.start("before", pod="pod-a")
    upgraded = tmp_path / "upgraded"
    for pkg in ("shim", "qlib", "qvisor", "qkernel", "tsor"):
        shutil.copytree(REPO / pkg, upgraded / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    new, new_pid = node.start("after", pod="pod-b", code=str(upgraded))
    assert new != old and new_pid != old_pid
    assert new == paths.socket_address(node.containerd, "t", paths.node_group(str(upgraded)))
    assert open(f"/proc/{new_pid}/cmdline", "rb").read().split(b"\0")[:3] == [sys.executable.encode(), b"-m", b"shim.main"]
    assert call(old, "Connect", pb.ConnectRequest(id="before"), pb.ConnectResponse).shim_pid == old_pid
    assert call(new, "Connect", pb.ConnectRequest(id="after"), pb.ConnectResponse).shim_pid == new_pid
    again, again_pid = node.start("after2", pod="pod-c", code=str(upgraded))
    assert (again, again_pid) == (new, new_pid)


def test_a_pods_shim_is_still_one_per_pod_by_default(tmp_path):
    n = Node(tmp_path, scope="pod")
    try:
        a, pid_a = n.start("a1", pod="pod-a")
        a2, pid_a2 = n.start("a2", pod="pod-a")
        b, pid_b = n.start("b1", pod="pod-b")
        assert a == a2 and pid_a == pid_a2
        assert b != a and pid_b != pid_a
    finally:
        for address in {a, b}:
            call(address, "Shutdown", pb.ShutdownRequest(), empty_pb2.Empty)
        n.close()


def test_the_nodes_shim_exits_once_idle_and_a_start_at_any_moment_finds_one_that_answers(node):
    address, first = node.start("c0")
    # a Shutdown while it serves nothing starts its way out; starts around the moment it would go
    # (before, at and after NODE_IDLE_S) each get a shim that answers containerd's next call
    for i, after in enumerate((NODE_IDLE_S - 0.3, NODE_IDLE_S, NODE_IDLE_S + 0.5)):
        call(address, "Shutdown", pb.ShutdownRequest(), empty_pb2.Empty)
        time.sleep(after)
        again, pid = node.start(f"c{i + 1}")
        assert again == address
        assert call(address, "Connect", pb.ConnectRequest(id=f"c{i + 1}"), pb.ConnectResponse).shim_pid == pid
    call(address, "Shutdown", pb.ShutdownRequest(), empty_pb2.Empty)
    time.sleep(NODE_IDLE_S / 2)
    assert alive(pid), "the node's shim went before it was idle for NODE_IDLE_S"
    wait_gone(pid, timeout=NODE_IDLE_S + 10)
    assert not os.path.exists(socket_path(address)), "the node's shim left its socket"


def test_a_shutdown_now_does_not_end_a_node_shim_that_another_start_found(node):
    address, pid = node.start("n1", pod="pod-a")
    node.start("n2", pod="pod-b")
    # containerd's Shutdown names one container; the node's shim goes only on its idle rule
    call(address, "Shutdown", pb.ShutdownRequest(id="n1", now=True), empty_pb2.Empty)
    time.sleep(0.5)
    assert call(address, "Connect", pb.ConnectRequest(id="n2"), pb.ConnectResponse).shim_pid == pid


@pytest.mark.parametrize("text, why", [("shim:\n  scope: cluster\n", "shim.scope"),
                                       ("shim:\n  scopes: node\n", "shim.scopes"),
                                       ("shim: node\n", "shim")])
def test_a_shim_scope_quark_cannot_take_is_refused_at_start_naming_the_field(node, text, why):
    node.config.write_text(text)
    bundle = node.bundle("bad", "bad")
    p = subprocess.run([SHIM, "-namespace", "t", "-address", node.containerd, "-id", "bad", "start"],
                       cwd=bundle, env=node.env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert f"{node.config}: {why}:" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(bundle, "shim.pid"))
    for group in (paths.node_group(), "bad"):
        assert not os.path.exists(socket_path(paths.socket_address(node.containerd, "t", group)))
