"""A quark node in one guest of the two-guest RDMA lane, for the kernel-chosen remote path
(tsor/remote_path.py) between two real kernels: tests/support/testbed.py's node (a network
namespace with a bridge, quark pods and a tsord with `local_path: sockmap`, `transport: rdma`)
joined to the guest's wire by a veth, with routes to the other guest's node and pods over the wire.
Both guests' tsords share one routes file's content and one cluster secret; each opens the guest's
own soft-RoCE device, rxe0.

    guest a                                             guest b
    pod 10.219.1.x -- bridge -- node a 10.219.0.1       node b 10.219.0.2 -- bridge -- pod 10.219.2.x
                                 | veth                  | veth
                                root -- eth0 ===wire=== eth0 -- root
"""
from __future__ import annotations

import json
import os
import signal
import time

from tests.support import testbed
from tests.support.testbed import TSORD_PORT, sh

OCTET = 219
INDEX = {"a": 1, "b": 2}
SECRET = "pair-lane-" + "5a" * 16   # both guests' tsords prove the same one (a test's, on a private wire)
SERVER_PORT = 7700

# a quark pod's server, by a connection's first byte: b"E" echoes, b"S" hashes until the client's
# half-close and answers the hash (tests/pair/rdma_node.py's serve_app: what bench/pathprobe.py
# speaks), b"R" does the same but answers what accept() and the socket said about the two ends
SERVER = ("import hashlib, json, socket, threading\n"
          "l = socket.create_server(('0.0.0.0', %d), backlog=256)\n"
          "def serve(c, peer):\n"
          " first = c.recv(1); h = hashlib.sha256()\n"
          " while d := c.recv(1 << 16):\n"
          "  c.sendall(d) if first == b'E' else h.update(d)\n"
          " if first == b'S': c.sendall(h.hexdigest().encode())\n"
          " if first == b'R': c.sendall(json.dumps({'accept': peer, 'peer': c.getpeername(),"
          " 'sock': c.getsockname(), 'sha': h.hexdigest()}).encode())\n"
          " c.close()\n"
          "open('/out/server-ready', 'w').close()\n"
          "while True:\n"
          " c, peer = l.accept(); threading.Thread(target=serve, args=(c, peer)).start()\n") % SERVER_PORT


class PairNode:
    """This guest's node (role "a" or "b"); close() removes all of it."""

    def __init__(self, role: str, self_wire: str, peer_wire: str, kubeconfig: str | None = None) -> None:
        """kubeconfig: routes from that API server (tsor/routes_k8s.py: nodes, quark pods, Services,
        NetworkPolicies) instead of the routes file both guests share."""
        self.kubeconfig = kubeconfig
        other = "b" if role == "a" else "a"
        i, j = INDEX[role], INDEX[other]
        self.bed = testbed.Testbed(prefix=f"qr{role}", octet=OCTET)
        self.routes: list[list[str]] = []
        try:
            self.node = self.bed.node(role, index=i)
            ns, veth, gw = self.node.netns, f"qrw{i}", f"10.{OCTET}.254.{i}"
            self.node.address = f"10.{OCTET}.0.{i}"
            sh("sysctl", "-qw", "net.ipv4.ip_forward=1")
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "qrwn", "netns", ns)
            sh("ip", "addr", "add", f"{gw}/32", "dev", veth)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.node.address}/32", "dev", "qrwn")
            sh("ip", "-n", ns, "link", "set", "qrwn", "up")
            sh("ip", "-n", ns, "route", "add", gw, "dev", "qrwn")
            sh("ip", "-n", ns, "route", "add", "default", "via", gw)
            for route in ([f"{self.node.address}/32", "dev", veth], [self.node.subnet, "via", self.node.address],
                          [f"10.{OCTET}.0.{j}/32", "via", peer_wire], [f"10.{OCTET}.{j}.0/24", "via", peer_wire]):
                sh("ip", "route", "add", *route)
                self.routes.append(route)
            with open(self.bed.secret_file, "w") as f:
                f.write(SECRET)
            # both nodes, as every node's routes file says (Testbed's own lists only this guest's)
            nodes = [{"name": n, "pods": [f"10.{OCTET}.{k}.0/24"], "address": f"10.{OCTET}.0.{k}:{TSORD_PORT}"}
                     for n, k in sorted(INDEX.items())]
            with open(self.bed.routes_file, "w") as f:
                json.dump({"nodes": nodes}, f)
            self.start_tsord()
        except BaseException:
            self.close()
            raise

    def start_tsord(self) -> None:
        self.node.start_tsord(transport="rdma", local_path="sockmap", rdma={"device": "rxe0"},
                              kubeconfig=self.kubeconfig)

    def kill_tsord(self) -> None:
        """tsord dies (SIGKILL), its pump with it; nothing cleans up after it."""
        self.node.stop_tsord(signal.SIGKILL)

    def pod(self, name: str, program: str, args: list[str] = ()) -> testbed.Pod:
        """A quark pod running `program` (Python) detached."""
        pod = self.node.pod(name)
        self.bed.start("quark", name, self.bed.bundle(name, ["python3", "-c", program, *args], pod))
        return pod

    def out(self, name: str) -> str:
        return self.bed.out(name)

    def close(self) -> None:
        self.bed.close()
        for route in self.routes:
            sh("ip", "route", "del", *route, check=False)
        from tsor import service_lb, sockmap, sockopt_offload   # tsord leaves its programs attached
        root = sockopt_offload.cgroup2_root()
        if root is not None:
            sockmap.remove_attached(root)
            service_lb.remove_attached(root)


def wire() -> tuple[str, str]:
    return os.environ["QUARK_PAIR_SELF"], os.environ["QUARK_PAIR_PEER"]


def wait_for_b_pod() -> str:
    """Once guest b's server pod serves: its address. RuntimeError: b said why it did not start."""
    pair = os.environ["QUARK_PAIR_DIR"]
    deadline = time.monotonic() + 300
    while not os.path.exists(os.path.join(pair, "b-node")):
        if os.path.exists(os.path.join(pair, "b-node-failed")):
            with open(os.path.join(pair, "b-node-failed")) as f:
                raise RuntimeError(f"node b did not start: {f.read()}")
        if time.monotonic() > deadline:
            raise RuntimeError("node b's server pod never served")
        time.sleep(0.2)
    with open(os.path.join(pair, "b-node")) as f:
        return f.read().strip()


def wait_for_b(a: PairNode) -> str:
    """Once guest b's server pod serves and node a's link to b is up (the remote map follows within
    tsor/remote_path.py's RESYNC): that pod's address."""
    from tsor import remote_path
    from tsor.metrics import fetch, parse
    server_ip = wait_for_b_pod()

    def linked() -> bool:
        try:
            return any(k.startswith("tsor_rdma_links{") and 'node="b"' in k for k in parse(fetch(a.node.metrics)))
        except OSError:   # its metrics socket is bound just after its sandbox socket
            return False
    deadline = time.monotonic() + 120
    while not linked():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no rdma link to node b: {a.node.log()[-3000:]}")
        time.sleep(0.2)
    time.sleep(2 * remote_path.RESYNC)
    return server_ip
