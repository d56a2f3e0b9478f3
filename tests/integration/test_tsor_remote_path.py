"""The kernel's side of the remote leg (tsor/remote_path.py, tsor/bpf/service_lb.bpf.c) on this host:
a registered pod's connect() to a pod of a node this node has a link to is dialled at the pump's
listener, with the kernel's own handshake; the sock_ops program notes where it was going; the client's
getpeername() answers what it dialled; a server pod's accept() answers the client pod the far pump
names; NetworkPolicy's verdicts decide, per route generation, and a missing one sends the connect
native. The pump's listener here is a plain socket of the test in the node's namespace (the pump
itself, on an RDMA device, runs in the RDMA lane: tests/unit/test_rdma_pump_listener.py).

Pod `two` plays the pod of the other node: the remote map names its address."""
from __future__ import annotations

import os
import select
import socket
import struct

import pytest

from qlib import bpf
from tests.support import testbed
from tsor import kernel_sockets, remote_path, service_lb
from tsor.sockopt_offload import cgroup2_root

PUMP_PORT = 7471
LINK = 5
VIP = "10.226.250.10"


@pytest.fixture(scope="module")
def bed():
    if testbed.sockmap_skip_reason():
        pytest.skip(testbed.sockmap_skip_reason())
    b = testbed.Testbed(prefix="qrp", octet=226)
    try:
        node = b.node("a")
        one, two = node.pod("one"), node.pod("two")
        gateway = node.subnet.replace(".0/24", ".1")
        pump = kernel_sockets.socket_at(f"/var/run/netns/{node.netns}")
        pump.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        pump.bind((gateway, PUMP_PORT))
        pump.listen(64)
        yield b, node, one, two, gateway, pump
        pump.close()
    finally:
        b.close()
        service_lb.remove_attached(cgroup2_root())


def _cookie(pod: testbed.Pod) -> int:
    return kernel_sockets.netns_cookie(pod.netns_path, os.stat(pod.netns_path).st_ino)


@pytest.fixture
def lb(bed):
    _, _, one, two, _, _ = bed
    balancer = service_lb.ServiceLB.open(cgroup2_root())
    balancer.set_namespaces({_cookie(one), _cookie(two)})
    _listening(balancer, bed[5])
    try:
        yield balancer
    finally:
        balancer.remove()


def _listening(lb, listener: socket.socket) -> None:
    """What tsord does for the pump: its listening socket into the pump map."""
    bpf.map_update(lb.maps[service_lb.PUMP_MAP], struct.pack("=I", 0), struct.pack("=Q", listener.fileno()))


def _config(lb, generation: int, policy: bool) -> None:
    bpf.map_update(lb.maps[service_lb.CONFIG_MAP], struct.pack("=I", 0), struct.pack("=II", generation, int(policy)))


def _route(lb, net: str, gateway: str, room: int = 1000) -> None:
    bpf.map_update(lb.maps[service_lb.REMOTE_MAP], remote_path.remote_key(net),
                   remote_path.remote_value((gateway, PUMP_PORT), LINK))
    _set_room(lb, room)


def _set_room(lb, room: int) -> None:
    """What the pump would write: how many more connections its link LINK can take."""
    bpf.map_update(lb.maps[service_lb.ROOM_MAP], struct.pack("=I", LINK), struct.pack("=i", room))


def _room(lb) -> int:
    return struct.unpack("=i", bpf.map_lookup(lb.maps[service_lb.ROOM_MAP], struct.pack("=I", LINK), 4))[0]


def _listen(pod: testbed.Pod, port: int) -> socket.socket:
    ls = kernel_sockets.socket_at(pod.netns_path)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((pod.ip, port))
    ls.listen(16)
    return ls


def _dial(pod: testbed.Pod, ip: str, port: int) -> socket.socket:
    c = kernel_sockets.socket_at(pod.netns_path)
    c.settimeout(10)
    c.connect((ip, port))
    return c


def _readable(ls: socket.socket, timeout: float = 2.0) -> bool:
    return bool(select.select([ls], [], [], timeout)[0])


def _note(lb, client: tuple[str, int]) -> tuple[str, int, int] | None:
    """The conns map's note for a client's address: (target ip, port, link)."""
    raw = bpf.map_lookup(lb.maps[service_lb.CONNS_MAP], socket.inet_aton(client[0]) + struct.pack("!H", client[1])
                         + b"\0\0", 8)
    if raw is None:
        return None
    return socket.inet_ntoa(raw[:4]), struct.unpack("!H", raw[4:6])[0], struct.unpack("=H", raw[6:8])[0]


def test_a_connect_to_another_nodes_pod_is_dialled_at_the_pump_and_answers_what_it_dialled(bed, lb):
    _, _, one, two, gateway, pump = bed
    _config(lb, 1, policy=False)
    _route(lb, f"{two.ip}/32", gateway)
    server = _listen(two, 8080)
    try:
        c = _dial(one, two.ip, 8080)
        with c:
            assert _readable(pump), "the connect did not reach the pump's listener"
            conn, peer = pump.accept()
            with conn:
                assert peer == c.getsockname() and peer[0] == one.ip     # the client's own address
                assert c.getpeername() == (two.ip, 8080)                 # what it dialled
                assert _note(lb, peer) == (two.ip, 8080, LINK)           # where the pump sends it
                conn.sendall(b"pumped")
                assert c.recv(10) == b"pumped"
        assert not _readable(server, 0.2), "the pod itself was dialled"
        # a Service's endpoint on that node: balanced first, then to the pump; its peer is the ClusterIP
        lb.sync({(VIP, 80): [(two.ip, 8080)]})
        with _dial(one, VIP, 80) as c:
            assert _readable(pump)
            conn, peer = pump.accept()
            conn.close()
            assert c.getpeername() == (VIP, 80)
            assert _note(lb, peer) == (two.ip, 8080, LINK)
        # an address the remote map does not name is untouched
        bpf.map_delete(lb.maps[service_lb.REMOTE_MAP], remote_path.remote_key(f"{two.ip}/32"))
        with _dial(one, two.ip, 8080) as c:
            assert _readable(server)
            server.accept()[0].close()
            assert c.getpeername() == (two.ip, 8080)
        assert not _readable(pump, 0.2)
    finally:
        server.close()


def test_a_pod_accepts_the_far_pumps_connection_as_from_the_client_pod(bed, lb):
    _, node, one, two, gateway, _ = bed
    server = _listen(two, 8081)
    far = kernel_sockets.socket_at(f"/var/run/netns/{node.netns}")
    try:
        far.bind((gateway, 0))
        key = remote_path.peer_key((two.ip, 8081), far.getsockname())
        bpf.map_update(lb.maps[service_lb.PEERS_MAP], key, service_lb.endpoint_value(("10.9.8.7", 4242)))
        far.connect((two.ip, 8081))
        conn, peer = server.accept()
        with conn:
            assert peer == ("10.9.8.7", 4242)
            assert conn.getpeername() == ("10.9.8.7", 4242)
            assert conn.getsockname() == (two.ip, 8081)
        # without the entry: the pump's own address, as the kernel sees it
        bpf.map_delete(lb.maps[service_lb.PEERS_MAP], key)
        with kernel_sockets.socket_at(f"/var/run/netns/{node.netns}") as plain:
            plain.connect((two.ip, 8081))
            conn, peer = server.accept()
            conn.close()
            assert peer == plain.getsockname() and peer[0] == gateway
    finally:
        far.close()
        server.close()


def test_networkpolicy_verdicts_decide_per_generation_and_a_missing_one_is_native_and_asked_for(bed, lb):
    _, _, one, two, gateway, pump = bed
    _config(lb, 7, policy=True)
    _route(lb, f"{two.ip}/32", gateway)
    server = _listen(two, 8082)
    decided = []

    def decide(src: str, dst: tuple[str, int]) -> bool:
        decided.append((src, dst))
        return allow

    rp = remote_path.RemotePath(lb, (gateway, PUMP_PORT), dict, lambda: generation, lambda: object(),
                                {_cookie(one): one.ip}.get, decide, listener=pump)
    rp._stop.set()   # this test turns the wheel itself
    rp._thread.join()

    def lands() -> str:
        with _dial(one, two.ip, 8082):
            if _readable(server, 1.0):
                server.accept()[0].close()
                return "native"
            assert _readable(pump, 1.0)
            pump.accept()[0].close()
            return "pump"
    try:
        generation, allow = 7, True
        assert lands() == "native"                       # no verdict yet: the node's filters decide
        assert rp.answer_misses() == 1 and decided == [(one.ip, (two.ip, 8082))]
        assert lands() == "pump"                         # allowed, this generation
        assert rp.answer_misses() == 0
        _config(lb, 8, policy=True)                      # the routes or policies changed
        generation, allow = 8, False
        assert lands() == "native"
        assert rp.answer_misses() == 1
        assert lands() == "native"                       # denied: the filters decide, every time
        assert rp.answer_misses() == 0
    finally:
        server.close()


def test_a_link_with_no_room_leaves_connects_native_and_each_pumped_one_takes_room(bed, lb):
    _, _, one, two, gateway, pump = bed
    _config(lb, 1, policy=False)
    _route(lb, f"{two.ip}/32", gateway, room=2)
    server = _listen(two, 8083)
    try:
        for expect, left in (("pump", 1), ("pump", 0), ("native", 0)):
            with _dial(one, two.ip, 8083):
                ready = select.select([server, pump], [], [], 2.0)[0]
                assert ready == ([pump] if expect == "pump" else [server])
                ready[0].accept()[0].close()
            assert _room(lb) == left
    finally:
        server.close()


def test_once_the_pumps_listener_closes_connects_are_native_not_refused(bed, lb):
    """tsord gone (its pump and listener with it): the kernel takes the listener out of the pump map,
    and a connect to another node's pod goes to the pod, not to a port nobody listens on."""
    _, node, one, two, gateway, _ = bed
    _config(lb, 1, policy=False)
    server = _listen(two, 8084)
    other = kernel_sockets.socket_at(f"/var/run/netns/{node.netns}")
    try:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind((gateway, PUMP_PORT + 1))
        other.listen(16)
        bpf.map_update(lb.maps[service_lb.REMOTE_MAP], remote_path.remote_key(f"{two.ip}/32"),
                       remote_path.remote_value((gateway, PUMP_PORT + 1), LINK))
        _set_room(lb, 100)
        _listening(lb, other)
        with _dial(one, two.ip, 8084):
            assert _readable(other)
            other.accept()[0].close()
        other.close()
        with _dial(one, two.ip, 8084) as c:
            assert _readable(server)
            server.accept()[0].close()
            assert c.getpeername() == (two.ip, 8084)
    finally:
        other.close()
        server.close()
