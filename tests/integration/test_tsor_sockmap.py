"""The sockmap local path's kernel side (tsor/sockmap.py), with real sockets in two pods of a testbed
node (network namespaces on a CNI bridge): which connections it carries, that what it carries skips
the pods' veths and arrives intact and in order, and that it outlives the tsord that set it up.

Whether bytes took the stack is read from the pod's veth counters: a carried connection's payload
never crosses eth0 (only its handshake and close do)."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time

import pytest

from qlib import procfs
from tests.support import testbed
from tsor import kernel_sockets, service_lb, sockmap
from tsor.sockopt_offload import cgroup2_root

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, bpf(2))"),
    pytest.mark.skipif(cgroup2_root() is None, reason="needs the unified cgroup hierarchy (cgroup2) mounted"),
]
MIB = 1 << 20


@pytest.fixture(scope="module")
def pods():
    root = cgroup2_root()
    if testbed.sockmap_skip_reason():
        pytest.skip(testbed.sockmap_skip_reason())
    bed = testbed.Testbed(prefix="qsm", octet=224)
    try:
        node = bed.node("a")
        yield bed, node.pod("one"), node.pod("two")
    finally:
        bed.close()
        sockmap.remove_attached(root)


@pytest.fixture
def path():
    p = sockmap.SockmapPath.open(cgroup2_root())
    try:
        yield p
    finally:
        p.remove()


def _socket_in(pod: testbed.Pod, family: int = socket.AF_INET) -> socket.socket:
    return kernel_sockets.socket_at(pod.netns_path, family)


def _cookie(pod: testbed.Pod) -> int:
    return kernel_sockets.netns_cookie(pod.netns_path, os.stat(pod.netns_path).st_ino)


def _opened(root: str, *carried: testbed.Pod) -> sockmap.SockmapPath:
    """A tsord's SockmapPath, the pods' addresses registered (their connections carried)."""
    path = sockmap.SockmapPath.open(root)
    for pod in carried:
        path.register(pod.ip, _cookie(pod))
    return path


def _end_key(path: sockmap.SockmapPath, pod: testbed.Pod) -> bytes:
    """The pairs map's key of the (one) end whose local address is `pod`'s."""
    return next(k for k in sockmap.bpf.map_keys(path.pairs, 16) if k[:4] == socket.inet_aton(pod.ip))


def _tx_bytes(pod: testbed.Pod) -> int:
    return int(testbed.sh("cat", "/sys/class/net/eth0/statistics/tx_bytes", netns=pod.netns).stdout)


class Pair:
    """A TCP connection from pod `a` to pod `b` (`client`, `server`: the two ends)."""

    def __init__(self, a: testbed.Pod, b: testbed.Pod, port: int) -> None:
        with _socket_in(b) as ls:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((b.ip, port))
            ls.listen(1)
            self.client = _socket_in(a)
            self.client.connect((b.ip, port))
            self.server, _ = ls.accept()

    def close(self) -> None:
        self.client.close()
        self.server.close()


def _send_recv(src: socket.socket, dst: socket.socket, data: bytes) -> bytes:
    """`data` written on `src` (another thread) and read back on `dst`."""
    t = threading.Thread(target=src.sendall, args=(data,))
    t.start()
    got = bytearray()
    while len(got) < len(data):
        chunk = dst.recv(len(data) - len(got))
        assert chunk, "the connection closed early"
        got += chunk
    t.join()
    return bytes(got)


def _pattern(n: int) -> bytes:
    return bytes((i * 7 + i // 251) & 0xFF for i in range(n))


def test_a_connection_between_two_registered_pods_skips_their_veths(pods, path):
    _, one, two = pods
    path.register(one.ip, _cookie(one))
    path.register(two.ip, _cookie(two))
    pair = Pair(one, two, 7101)
    try:
        assert path.connections() == 2
        data = _pattern(4 * MIB)
        before = _tx_bytes(one), _tx_bytes(two)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _send_recv(pair.server, pair.client, data[::-1]) == data[::-1]
        sent = _tx_bytes(one) - before[0], _tx_bytes(two) - before[1]
        assert max(sent) < 64 * 1024, f"payload crossed the veths: {sent} bytes"
        pair.client.shutdown(socket.SHUT_WR)            # half-close: the server reads EOF, can still send
        assert pair.server.recv(1) == b""
        assert _send_recv(pair.server, pair.client, b"after") == b"after"
    finally:
        pair.close()
    assert path.connections() == 0   # closed ends leave the map by themselves


def test_holds_tells_the_ends_the_kernel_moves_socket_to_socket(pods, path):
    """What a sockmap sandbox's supervisor asks tsord before it waits for a FIN's acknowledgement."""
    _, one, two = pods
    path.register(one.ip, _cookie(one))
    pair = Pair(one, two, 7111)            # two is not registered: neither end is carried
    try:
        assert not path.holds(*sockmap.end_of(pair.client)) and not path.holds(*sockmap.end_of(pair.server))
    finally:
        pair.close()
    path.register(two.ip, _cookie(two))
    pair = Pair(one, two, 7112)
    try:
        assert path.holds(*sockmap.end_of(pair.client)) and path.holds(*sockmap.end_of(pair.server))
        local, remote, cookie = sockmap.end_of(pair.client)
        assert not path.holds(local, remote, cookie + 1)          # the four-tuple alone is not enough
    finally:
        pair.close()


def test_unregistered_or_foreign_namespace_ends_take_the_stack(pods, path):
    _, one, two = pods
    path.register(one.ip, _cookie(one))
    pair = Pair(one, two, 7102)   # two's address is not a quark pod's
    try:
        assert path.connections() == 0
        before = _tx_bytes(one)
        data = _pattern(MIB)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _tx_bytes(one) - before >= len(data)
    finally:
        pair.close()
    # two's address registered for one's namespace (an address another pod claims): two's end is
    # not inserted, so nothing is redirected
    path.register(two.ip, _cookie(one))
    pair = Pair(one, two, 7103)
    try:
        assert path.connections() == 1
        before = _tx_bytes(one)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _tx_bytes(one) - before >= len(data)
    finally:
        pair.close()


def _ipv6_address(pod: testbed.Pod, addr: str) -> bool:
    """`addr`/64 on the pod's eth0 (no duplicate detection: usable at once); False if IPv6 is off."""
    return testbed.sh("ip", "-6", "addr", "replace", f"{addr}/64", "dev", "eth0", "nodad",
                      check=False, netns=pod.netns).returncode == 0


def test_a_dual_stack_listeners_ipv4_mapped_connections_are_carried_and_ipv6_ones_are_not(pods, path):
    # a server listening on [::] with IPV6_V6ONLY off (busybox httpd, Go's and Java's servers by
    # default) accepts IPv4 clients on AF_INET6 sockets whose addresses are ::ffff:a.b.c.d
    _, one, two = pods
    path.register(one.ip, _cookie(one))
    path.register(two.ip, _cookie(two))
    with _socket_in(two, socket.AF_INET6) as ls:
        ls.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        ls.bind(("::", 7110))
        ls.listen(2)
        for family, dest in ((socket.AF_INET, two.ip), (socket.AF_INET6, f"::ffff:{two.ip}")):
            client = _socket_in(one, family)
            with client:
                client.connect((dest, 7110))
                server, peer = ls.accept()
                with server:
                    assert peer[0] == f"::ffff:{one.ip}"
                    assert path.connections() == 2
                    data = _pattern(2 * MIB)
                    before = _tx_bytes(one), _tx_bytes(two)
                    assert _send_recv(server, client, data) == data
                    assert _send_recv(client, server, data[::-1]) == data[::-1]
                    sent = _tx_bytes(one) - before[0], _tx_bytes(two) - before[1]
                    assert max(sent) < 64 * 1024, f"payload crossed the veths: {sent} bytes"
        if not (_ipv6_address(one, "fd00:5e:224::1") and _ipv6_address(two, "fd00:5e:224::2")):
            pytest.skip("IPv6 is off in the pods' namespaces")
        with _socket_in(one, socket.AF_INET6) as client:           # IPv6 proper: the stack
            client.connect(("fd00:5e:224::2", 7110))
            server, _ = ls.accept()
            with server:
                assert path.connections() == 0
                assert _send_recv(client, server, b"v6") == b"v6"


def test_loopback_inside_a_pod_is_not_carried(pods, path):
    _, one, _ = pods
    path.register(one.ip, _cookie(one))
    with _socket_in(one) as ls:
        ls.bind(("127.0.0.1", 7104))
        ls.listen(1)
        with _socket_in(one) as c:
            c.connect(("127.0.0.1", 7104))
            s, _ = ls.accept()
            with s:
                assert path.connections() == 0
                assert _send_recv(c, s, b"local") == b"local"


def test_the_first_message_decides_and_the_choice_sticks(pods, path):
    """An end whose first message found no peer in the map keeps taking the stack even once the peer
    is there: a later redirected message could otherwise be read before the earlier one."""
    _, one, two = pods
    path.register(one.ip, _cookie(one))
    path.register(two.ip, _cookie(two))
    pair = Pair(one, two, 7105)
    try:
        server_key = _end_key(path, two)
        assert sockmap.bpf.map_delete(path.pairs, server_key)     # as if its ACK were not processed yet
        before = _tx_bytes(one)
        assert _send_recv(pair.client, pair.server, b"first") == b"first"
        sockmap.bpf.map_update(path.pairs, server_key, pair.server.fileno().to_bytes(8, "little"))
        data = _pattern(MIB)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _tx_bytes(one) - before >= len(data), "the client's later messages were redirected"
        before = _tx_bytes(two)
        assert _send_recv(pair.server, pair.client, data) == data   # the other direction decided for itself
        assert _tx_bytes(two) - before < 64 * 1024
    finally:
        pair.close()


def test_connections_outlive_tsord_and_the_next_one_takes_over(pods):
    _, one, two = pods
    first = _opened(cgroup2_root(), one, two)
    pair = Pair(one, two, 7106)
    second = None
    try:
        assert _send_recv(pair.client, pair.server, b"x") == b"x"
        first.close()                          # tsord exits
        data = _pattern(MIB)
        before = _tx_bytes(one)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _tx_bytes(one) - before < 64 * 1024, "the connection lost its way when tsord went"
        second = sockmap.SockmapPath.open(cgroup2_root())   # the next tsord
        assert second.connections() == 2
        assert set(second.registered()) == {one.ip, two.ip}
        other = Pair(one, two, 7107)
        try:
            assert second.connections() == 4
            assert _send_recv(other.client, other.server, data) == data
        finally:
            other.close()
    finally:
        pair.close()
        if second is not None:
            second.remove()
        else:
            sockmap.remove_attached(cgroup2_root())



def test_a_tsord_taking_over_keeps_each_connections_way(pods):
    """The way each end chose on its first message (the rule that keeps bytes in order) lives in the
    socket storage map of the SK_MSG program that was attached when the end entered the sockhash:
    the kernel gives each end that program for its life, so a tsord taking over (which attaches a
    new program, with a new storage map, for the ends to come) leaves it in force, and a direction
    that went to the stack keeps going there after the restart."""
    _, one, two = pods
    root = cgroup2_root()
    first = _opened(root, one, two)
    pair = Pair(one, two, 7113)
    second = None
    try:
        server_key = _end_key(first, two)
        assert sockmap.bpf.map_delete(first.pairs, server_key)          # its ACK not processed yet, say
        assert _send_recv(pair.client, pair.server, b"first") == b"first"   # the client's way: the stack
        sockmap.bpf.map_update(first.pairs, server_key, pair.server.fileno().to_bytes(8, "little"))
        first.close()                                                   # tsord restarts
        second = sockmap.SockmapPath.open(root)
        data = _pattern(MIB)
        before = _tx_bytes(one)
        assert _send_recv(pair.client, pair.server, data) == data
        assert _tx_bytes(one) - before >= len(data), "the client's way was forgotten: its bytes were redirected"
        before = _tx_bytes(two)
        assert _send_recv(pair.server, pair.client, data) == data       # undecided before: redirected now
        assert _tx_bytes(two) - before < 64 * 1024
    finally:
        pair.close()
        if second is not None:
            second.remove()
        else:
            sockmap.remove_attached(root)


def test_a_socketpair_tsord_retires_the_programs_once_no_connection_needs_them(pods):
    """tsord switched back to the socketpair path: while a connection is carried the programs stay
    (its bytes in flight would be lost with the map) but carry no new one; once none is, they go."""
    _, one, two = pods
    root = cgroup2_root()
    first = _opened(root, one, two)
    pair = Pair(one, two, 7108)
    try:
        first.close()
        assert "left attached" in sockmap.retire(root)
        assert sockmap.attached_names(root) == {sockmap.OPS_NAME}
        later = Pair(one, two, 7109)            # not carried: the addresses are no longer registered
        try:
            before = _tx_bytes(one)
            assert _send_recv(later.client, later.server, _pattern(MIB)) == _pattern(MIB)
            assert _tx_bytes(one) - before >= MIB
        finally:
            later.close()
        before = _tx_bytes(one)
        assert _send_recv(pair.client, pair.server, _pattern(MIB)) == _pattern(MIB)
        assert _tx_bytes(one) - before < 64 * 1024   # the carried one still is
    finally:
        pair.close()
    assert "detached" in sockmap.retire(root)
    assert sockmap.attached_names(root) == set()


# ---- Services chosen at connect() (tsor/service_lb.py) -------------------------------------------------
VIP = "10.224.250.10"   # a ClusterIP of the bed's own range; pod one holds it on its lo (below)


@pytest.fixture
def lb(pods):
    """A tsord's ServiceLB with both pods' namespaces registered; pod one holds the ClusterIP on its
    loopback with a listener of its own there, so that a connect the programs leave alone reaches
    pod one itself (and nothing leaves the bed)."""
    _, one, two = pods
    testbed.sh("ip", "addr", "add", f"{VIP}/32", "dev", "lo", netns=one.netns)
    balancer = service_lb.ServiceLB.open(cgroup2_root())
    balancer.set_namespaces({_cookie(one), _cookie(two)})
    try:
        yield balancer
    finally:
        balancer.remove()
        testbed.sh("ip", "addr", "del", f"{VIP}/32", "dev", "lo", netns=one.netns)


def _listen(pod: testbed.Pod, ip: str, port: int) -> socket.socket:
    ls = _socket_in(pod)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((ip, port))
    ls.listen(64)
    return ls


def _dial(pod: testbed.Pod, ip: str, port: int) -> socket.socket:
    c = _socket_in(pod)
    c.settimeout(10)
    c.connect((ip, port))
    return c


def test_a_clusterip_is_balanced_at_connect_and_the_connection_carried(pods, path, lb):
    """A registered pod's connect() to a Service ClusterIP:port reaches an endpoint, chosen at random
    among the ready ones; the application sees the ClusterIP as its peer (getpeername), the server
    the client's own address (as after kube-proxy's DNAT); the connection is the two pods' own, so
    the sockmap path carries it (its payload skips the veths)."""
    _, one, two = pods
    for pod in (one, two):
        path.register(pod.ip, _cookie(pod))
    local, eps = _listen(one, VIP, 80), [_listen(two, two.ip, port) for port in (8080, 8081)]
    try:
        assert lb.sync({(VIP, 80): [(two.ip, 8080), (two.ip, 8081)]}) == 1
        assert lb.services() == {(VIP, 80): service_lb.Target(((two.ip, 8080), (two.ip, 8081)))}
        c = _dial(one, VIP, 80)
        try:
            assert c.getpeername() == (VIP, 80)
            server, peer = _ready(eps).accept()
            assert peer == c.getsockname() and peer[0] == one.ip
            assert server.getsockname()[0] == two.ip
            assert path.holds(c.getsockname(), server.getsockname(), _so_cookie(c))   # in the sockhash
            data = _pattern(4 * MIB)
            before = _tx_bytes(one)
            assert _send_recv(c, server, data) == data and _send_recv(server, c, data[::-1]) == data[::-1]
            assert _tx_bytes(one) - before < 64 * 1024, "the payload crossed the client pod's veth"
            server.close()
        finally:
            c.close()
        # random among the endpoints: 40 connects reach both (all one: 2 ** -39)
        reached = set()
        for _ in range(40):
            with _dial(one, VIP, 80):
                conn, _ = _ready(eps).accept()
                reached.add(conn.getsockname()[1])
                conn.close()
        assert reached == {8080, 8081}
        assert not _readable(local, 0.2)   # nothing went to the ClusterIP itself
    finally:
        for ls in (local, *eps):
            ls.close()


def test_a_service_with_no_ready_endpoint_refuses_and_others_are_left_alone(pods, lb):
    """No ready endpoint: ECONNREFUSED, as kube-proxy's REJECT answers. Left to the node as they
    are: another port of the ClusterIP, a namespace tsord did not register, a Service taken out
    of the maps, and every socket once the programs are removed."""
    _, one, two = pods
    local, other = _listen(one, VIP, 80), _listen(one, VIP, 81)
    ep = _listen(two, two.ip, 8080)
    try:
        lb.sync({(VIP, 80): []})
        with pytest.raises(ConnectionRefusedError):
            _dial(one, VIP, 80)
        with _dial(one, VIP, 81) as c:         # not a Service port: its own address
            assert c.getpeername() == (VIP, 81) and _readable(other)
            other.accept()[0].close()
        lb.sync({(VIP, 80): [(two.ip, 8080)]})
        lb.set_namespaces({_cookie(two)})      # pod one's sockets are not a quark pod's now
        with _dial(one, VIP, 80) as c:
            assert _readable(local) and not _readable(ep, 0.2)
            local.accept()[0].close()
        lb.set_namespaces({_cookie(one), _cookie(two)})
        with _dial(one, VIP, 80) as c:
            assert _readable(ep) and c.getpeername() == (VIP, 80)
            ep.accept()[0].close()
        assert lb.sync({}) == 1 and lb.services() == {}
        with _dial(one, VIP, 80) as c:
            assert _readable(local)
            local.accept()[0].close()
    finally:
        for ls in (local, other, ep):
            ls.close()


def test_the_nodes_filters_decide_a_service_connection_by_its_endpoint(pods, path, lb):
    """NetworkPolicy is never bypassed: the connection a ClusterIP connect becomes is the two pods'
    own, made by the kernel's TCP through their veths, so the node's packet filters see the client
    pod and the endpoint and decide it (here a REJECT in the endpoint pod's namespace, the stand-in
    for a policy's enforcement: the connect is refused, as after kube-proxy's DNAT), and once the
    rule goes the same Service connects and is carried."""
    _, one, two = pods
    for pod in (one, two):
        path.register(pod.ip, _cookie(pod))
    ep = _listen(two, two.ip, 8080)
    rule = ["INPUT", "-p", "tcp", "-s", one.ip, "--dport", "8080", "-j", "REJECT", "--reject-with", "tcp-reset"]
    try:
        lb.sync({(VIP, 80): [(two.ip, 8080)]})
        testbed.sh("iptables", "-w", "-A", *rule, netns=two.netns)
        try:
            with pytest.raises(ConnectionRefusedError):
                _dial(one, VIP, 80)
            assert not _readable(ep, 0.2)
        finally:
            testbed.sh("iptables", "-w", "-D", *rule, netns=two.netns)
        with _dial(one, VIP, 80) as c:
            server, _ = _ready([ep]).accept()
            assert path.holds(c.getsockname(), server.getsockname(), _so_cookie(c))
            assert _send_recv(c, server, b"allowed") == b"allowed"
            server.close()
    finally:
        ep.close()


def test_client_ip_affinity_keeps_a_pod_on_its_endpoint_until_it_goes_or_times_out(pods, lb):
    """sessionAffinity: ClientIP: a pod's connects reach the endpoint it had (kube-proxy's
    stickiness, the pod standing for its address); an endpoint that left frees it, and so does the
    timeout since its last connect."""
    _, one, two = pods
    eps = [_listen(two, two.ip, port) for port in (8080, 8081)]
    both = ((two.ip, 8080), (two.ip, 8081))

    def reached() -> int:
        with _dial(one, VIP, 80):
            conn, _ = _ready(eps).accept()
            port = conn.getsockname()[1]
            conn.close()
            return port
    try:
        lb.sync({(VIP, 80): service_lb.Target(both, 30)})
        first = reached()
        assert {reached() for _ in range(20)} == {first}   # without affinity: both, but for 2 ** -20
        other = ({8080, 8081} - {first}).pop()
        lb.sync({(VIP, 80): service_lb.Target(((two.ip, other),), 30)})   # its endpoint left
        assert reached() == other
        # the timeout: a remembered endpoint last used longer ago than it is chosen afresh
        lb.sync({(VIP, 80): service_lb.Target(both, 1)})
        key = struct.pack("=Q", _cookie(one)) + socket.inet_aton(VIP) + struct.pack("!H", 80) + b"\0\0"

        def remember(port: int, age_s: float) -> None:
            value = struct.pack("=Q", time.monotonic_ns() - int(age_s * 1e9)) + socket.inet_aton(two.ip) + \
                struct.pack("!H", port) + struct.pack("=H", port - 8080)
            sockmap.bpf.map_update(lb.maps[service_lb.STICKY_MAP], key, value)
        for _ in range(5):
            remember(8081, 0)
            assert reached() == 8081                       # remembered, within the timeout
        seen = set()
        for _ in range(20):
            remember(8081, 2)                              # remembered 2 s ago: past the 1 s
            seen.add(reached())
        assert seen == {8080, 8081}
    finally:
        for ls in eps:
            ls.close()


def test_the_next_tsord_takes_the_programs_and_their_services_over(pods):
    """tsord exits: the programs stay attached and go on balancing by the last state; the next one
    finds them by name (no second copy attached), reads back what the maps hold and changes only
    what differs."""
    _, one, two = pods
    root = cgroup2_root()
    testbed.sh("ip", "addr", "add", f"{VIP}/32", "dev", "lo", netns=one.netns)
    ep = _listen(two, two.ip, 8080)
    second = None
    try:
        first = service_lb.ServiceLB.open(root)
        first.set_namespaces({_cookie(one)})
        first.sync({(VIP, 80): [(two.ip, 8080)], ("10.224.250.11", 443): []})
        first.close()                                   # tsord exits
        with _dial(one, VIP, 80) as c:
            assert _readable(ep) and c.getpeername() == (VIP, 80)
            ep.accept()[0].close()
        second = service_lb.ServiceLB.open(root)        # the next tsord
        assert service_lb.attached_names(root) == set(service_lb.ATTACH)
        assert second.services() == {(VIP, 80): service_lb.Target(((two.ip, 8080),)),
                                     ("10.224.250.11", 443): service_lb.Target(())}
        assert second.sync({(VIP, 80): [(two.ip, 8080)]}) == 1   # only the Service that went
        with _dial(one, VIP, 80) as c:
            assert _readable(ep)
            ep.accept()[0].close()
    finally:
        ep.close()
        if second is not None:
            second.remove()
        else:
            service_lb.remove_attached(root)
        testbed.sh("ip", "addr", "del", f"{VIP}/32", "dev", "lo", netns=one.netns)
    assert service_lb.remove_attached(root) == 0


def _readable(ls: socket.socket, timeout: float = 2.0) -> bool:
    """Has the listener a connection waiting (within `timeout`)?"""
    import select
    return bool(select.select([ls], [], [], timeout)[0])


def _ready(listeners: list[socket.socket]) -> socket.socket:
    import select
    ready = select.select(listeners, [], [], 5)[0]
    assert ready, "no endpoint got the connection"
    return ready[0]


def _so_cookie(s: socket.socket) -> int:
    return struct.unpack("Q", s.getsockopt(socket.SOL_SOCKET, sockmap.SO_COOKIE, 8))[0]


# ---- quark containers with tsord's local_path: sockmap ----------------------------------------------
ECHO_SERVER = r"""
import os, socket, sys, threading
tag, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind((ip, port)); l.listen(16)
open(f"/out/{tag}-ready", "w").close()
def serve(s):
    while True:
        d = s.recv(1 << 16)
        if not d:
            break
        s.sendall(d)
    s.close()
while True:
    s, _ = l.accept()
    threading.Thread(target=serve, args=(s,), daemon=True).start()
"""
ECHO_CLIENT = r"""
import json, os, socket, struct, sys, threading, time
tag, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def wait(name):
    while not os.path.exists(f"/out/{tag}-{name}"):
        time.sleep(0.02)
data = bytes(range(256)) * (16 << 10)   # 4 MiB
wait("go")
c = socket.create_connection((ip, port))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
cork = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
t = threading.Thread(target=c.sendall, args=(data,)); t.start()
got = bytearray()
while len(got) < len(data):
    chunk = c.recv(1 << 16)
    if not chunk:
        break
    got += chunk
t.join()
info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
with open(f"/out/{tag}-result.tmp", "w") as f:
    json.dump({"intact": bytes(got) == data, "peer": list(c.getpeername()), "cork": cork,
               "state": info[0], "rtt_us": struct.unpack_from("I", info, 68)[0]}, f)
os.rename(f"/out/{tag}-result.tmp", f"/out/{tag}-result")
wait("close")
c.close()
"""


def _untrapped_echo(bed: testbed.Testbed, tag: str) -> dict:
    """ECHO_CLIENT `tag` told to go while its supervisor is stopped: its result, which it can only
    reach if none of its calls is trapped (a trapped call would wait for that supervisor)."""
    sup = procfs.parent_pid(json.loads(bed.quark("state", tag).stdout)["pid"])
    os.kill(sup, signal.SIGSTOP)
    try:
        open(bed.out(f"{tag}-go"), "w").close()
        deadline = time.monotonic() + 20
        while not os.path.exists(bed.out(f"{tag}-result")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(bed.out(f"{tag}-result")), "the client waited: a socket call was trapped"
    finally:
        os.kill(sup, signal.SIGCONT)
    with open(bed.out(f"{tag}-result")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def sockmap_bed(pods):
    """A node whose tsord runs local_path: sockmap, an echo server in a quark container."""
    from tests.integration.test_tsor import needs_tsor_in_qkernel
    needs_tsor_in_qkernel()
    bed = testbed.Testbed(prefix="qsq", octet=225)
    try:
        node = bed.node("a")
        node.start_tsord(local_path="sockmap")
        srv = node.pod("srv")
        bed.start("quark", "srv", bed.bundle("srv", ["python3", "-c", ECHO_SERVER, "srv", srv.ip, "7200"], srv))
        testbed.wait_file(bed.out("srv-ready"))
        bed.node_a, bed.srv = node, srv
        yield bed
    finally:
        bed.close()
        sockmap.remove_attached(cgroup2_root())


def test_quark_pods_talk_through_the_kernel_with_no_trapped_call(sockmap_bed):
    """The client exchanges 4 MiB with the server while its supervisor is stopped: nothing it does
    is trapped (a trapped call would wait for that supervisor). The connection is carried socket to
    socket (in the map; the payload never crosses the client pod's veth), and what the application
    sees of its socket is the kernel's own TCP (TCP_CORK kept, TCP_INFO with a measured RTT)."""
    bed, node = sockmap_bed, sockmap_bed.node_a
    pod = node.pod("cli")
    bed.start("quark", "cli", bed.bundle("cli", ["python3", "-c", ECHO_CLIENT, "cli", bed.srv.ip, "7200"], pod))
    assert testbed.wait_metric(node, "tsor_sandboxes", 2) >= 2, node.log()   # both registered: in the map
    before = _tx_bytes(pod)
    res = _untrapped_echo(bed, "cli")
    assert res["intact"]
    assert res["peer"] == [bed.srv.ip, 7200]
    assert (res["cork"], res["state"]) == (1, 1)       # TCP_CORK read back; TCP_ESTABLISHED
    assert res["rtt_us"] > 0                           # the kernel measured it: not an emulated record
    assert testbed.metric(node, "tsor_sockmap_ends") == 2, node.log()   # the client's end and the server's
    assert _tx_bytes(pod) - before < 256 * 1024, "the payload crossed the client pod's veth"
    open(bed.out("cli-close"), "w").close()
    bed.stop("quark", "cli")
    deadline = time.monotonic() + 10
    while testbed.metric(node, "tsor_sockmap_ends") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert testbed.metric(node, "tsor_sockmap_ends") == 0      # closed ends leave the map


def test_a_sandbox_of_a_socketpair_tsord_still_traps(sockmap_bed):
    """The marker beside tsord's socket is what tells a sandbox: without it (tsord's default local
    path) the same client's calls wait for its stopped supervisor."""
    bed = sockmap_bed
    node = bed.node_b = bed.node("b")
    node.start_tsord()
    pod = node.pod("cli2")
    assert not os.path.exists(node.socket + ".local-path")
    bed.start("quark", "cli2", bed.bundle("cli2", ["python3", "-c", ECHO_CLIENT, "cli2", pod.ip, "7201"], pod))
    sup = procfs.parent_pid(json.loads(bed.quark("state", "cli2").stdout)["pid"])
    os.kill(sup, signal.SIGSTOP)
    try:
        open(bed.out("cli2-go"), "w").close()
        time.sleep(2)
        assert not os.path.exists(bed.out("cli2-result"))
    finally:
        os.kill(sup, signal.SIGCONT)
        bed.stop("quark", "cli2")


HALF_CLOSE_SERVER = r"""
import socket, sys, threading
ip, port = sys.argv[1], int(sys.argv[2])
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind((ip, port)); l.listen(64)
open("/out/hc-ready", "w").close()
while True:
    s, _ = l.accept()
    got = bytearray()
    while True:
        d = s.recv(1 << 16)
        if not d:
            break
        got += d
    try:
        s.sendall(bytes(got))
    except OSError:
        pass   # the client gave up on this one (its read failed): on to the next
    s.close()
"""
HALF_CLOSE_CLIENT = r"""
import errno, json, os, socket, sys
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {"intact": 0, "eagain_before_reply": 0, "eagain_after_reply": 0, "other": []}
for i in range(n):
    size = 5 if i % 2 == 0 else 100_000
    c = socket.create_connection((ip, port))
    c.sendall(b"q" * size)
    c.shutdown(socket.SHUT_WR)
    got = bytearray()
    try:
        while True:
            d = c.recv(1 << 16)
            if not d:
                break
            got += d
        if len(got) == size:
            out["intact"] += 1
        else:
            out["other"].append(f"{len(got)} of {size} bytes")
    except OSError as e:
        if e.errno != errno.EAGAIN:
            out["other"].append(repr(e))
        else:
            out["eagain_before_reply" if len(got) < size else "eagain_after_reply"] += 1
    c.close()
with open("/out/hc-result.tmp", "w") as f:
    json.dump(out, f)
os.rename("/out/hc-result.tmp", "/out/hc-result")
"""


def test_a_blocking_read_after_half_close_gets_the_reply_then_eof(sockmap_bed):
    """send, shutdown(SHUT_WR), then read until EOF, 1000 times between two quark pods: every reply
    whole, then EOF. The kernel's sockmap receive path answers a blocking read EAGAIN when the
    acknowledgement of the reader's own FIN wakes it; the supervisor's shutdown waits for that
    acknowledgement so it comes before the read (it hit about 1 exchange in 100 without)."""
    bed, node = sockmap_bed, sockmap_bed.node_a
    srv, cli = node.pod("hcs"), node.pod("hcc")
    bed.start("quark", "hcs", bed.bundle("hcs", ["python3", "-c", HALF_CLOSE_SERVER, srv.ip, "7210"], srv))
    try:
        testbed.wait_file(bed.out("hc-ready"))
        bed.start("quark", "hcc", bed.bundle("hcc", ["python3", "-c", HALF_CLOSE_CLIENT, srv.ip, "7210", "1000"], cli))
        try:
            testbed.wait_file(bed.out("hc-result"), timeout=100)
            with open(bed.out("hc-result")) as f:
                res = json.load(f)
            assert res == {"intact": 1000, "eagain_before_reply": 0, "eagain_after_reply": 0, "other": []}
        finally:
            bed.stop("quark", "hcc")
    finally:
        bed.stop("quark", "hcs")


# ---- a Service ClusterIP from the API, dialled by a quark pod, on the sockmap path ------------------
REFUSED_CLIENT = r"""
import errno, socket, sys
try:
    socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=10)
    said = "connected"
except OSError as e:
    said = errno.errorcode.get(e.errno, str(e))
open(f"/out/{sys.argv[1]}-said", "w").write(said)
"""


@pytest.fixture(scope="module")
def service_bed(pods):
    """A node whose tsord runs local_path: sockmap with its routes, Services included, from the API
    stand-in (served in the node's namespace), and an echo server in a quark container."""
    from tests.integration.test_tsor import needs_tsor_in_qkernel
    from tests.support import fake_kube_api as k8s
    needs_tsor_in_qkernel()
    bed = testbed.Testbed(prefix="qsv", octet=226)
    api = None
    try:
        node = bed.node("a")
        listener = kernel_sockets.socket_at(f"/var/run/netns/{node.netns}")
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        api = k8s.FakeKubeAPI(listener)
        api.put("nodes", k8s.node("a", "10.226.0.1", [node.subnet]))
        node.start_tsord(local_path="sockmap", kubeconfig=k8s.write_kubeconfig(
            os.path.join(bed.dir, "kc-a"), f"http://127.0.0.1:{api.port}"))
        testbed.wait_file(node.metrics)
        srv = node.pod("srv")
        api.put("pods", k8s.pod("srv", [srv.ip], "a"))
        bed.start("quark", "srv", bed.bundle("srv", ["python3", "-c", ECHO_SERVER, "srv", srv.ip, "7200"], srv))
        testbed.wait_file(bed.out("srv-ready"))
        bed.node_a, bed.srv, bed.api, bed.k8s = node, srv, api, k8s
        yield bed
    finally:
        if api is not None:
            api.stop()
        bed.close()
        sockmap.remove_attached(cgroup2_root())   # (the Service programs too)


def test_a_quark_pod_dials_a_service_with_no_trapped_call_and_its_connection_is_carried(service_bed):
    """The route source's Service reaches the programs' maps; the client dials its ClusterIP with its
    supervisor stopped (no call of its is trapped), reaches the server pod, sees the ClusterIP as
    its peer, and the connection is spliced socket to socket (the payload skips the veth)."""
    bed, node, api, k8s = service_bed, service_bed.node_a, service_bed.api, service_bed.k8s
    vip = "10.226.250.10"
    api.put("services", k8s.service("echo", vip, [("echo", 80, 7200)]))
    api.put("endpointslices", k8s.endpoint_slice("echo-1", "echo", [(bed.srv.ip, True, "a")], [("echo", 7200)]))
    assert testbed.wait_metric(node, "tsor_service_ports", 1) == 1, node.log()
    pod = node.pod("cli")
    api.put("pods", k8s.pod("cli", [pod.ip], "a"))
    bed.start("quark", "cli", bed.bundle("cli", ["python3", "-c", ECHO_CLIENT, "cli", vip, "80"], pod))
    assert testbed.wait_metric(node, "tsor_sandboxes", 2) >= 2, node.log()
    before = _tx_bytes(pod)
    res = _untrapped_echo(bed, "cli")
    assert res["intact"] and res["peer"] == [vip, 80]
    assert testbed.metric(node, "tsor_sockmap_ends") == 2, node.log()
    assert _tx_bytes(pod) - before < 256 * 1024, "the payload crossed the client pod's veth"
    open(bed.out("cli-close"), "w").close()
    bed.stop("quark", "cli")


def test_a_service_whose_endpoints_are_not_ready_refuses_a_quark_pods_connect(service_bed):
    bed, node, api, k8s = service_bed, service_bed.node_a, service_bed.api, service_bed.k8s
    vip = "10.226.250.11"
    api.put("services", k8s.service("idle", vip, [(None, 80, 7200)]))
    api.put("endpointslices", k8s.endpoint_slice("idle-1", "idle", [(bed.srv.ip, False, "a")], [(None, 7200)]))
    assert testbed.wait_metric(node, "tsor_service_ports", 2) == 2, node.log()
    pod = node.pod("cli2")
    r = bed.run("quark", "cli2", bed.bundle("cli2", ["python3", "-c", REFUSED_CLIENT, "cli2", vip, "80"], pod))
    assert r.returncode == 0, r.stderr
    with open(bed.out("cli2-said")) as f:
        assert f.read() == "ECONNREFUSED"
    # ready now: the same connect goes through
    api.put("endpointslices", k8s.endpoint_slice("idle-1", "idle", [(bed.srv.ip, True, "a")], [(None, 7200)]))
    assert testbed.wait_metric(node, "tsor_service_endpoints", 2) == 2, node.log()
    r = bed.run("quark", "cli3", bed.bundle("cli3", ["python3", "-c", REFUSED_CLIENT, "cli3", vip, "80"], pod))
    assert r.returncode == 0, r.stderr
    with open(bed.out("cli3-said")) as f:
        assert f.read() == "connected"
