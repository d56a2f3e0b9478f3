"""The rdma transport's ring protocol end to end: two engines ("nodes") joined by one RC QP, on a pair
of softverbs devices cabled by a real socketpair, and (the `nodes` fixture's halves marked
rdma_device: the RDMA lane runs them on soft-RoCE) on a real verbs device whose port loops the two
nodes' QPs back to each other: both nodes the Python engine ("pyverbs"), or node A the Python
engine and node B the compiled pump (transport/rdma_pump.c, "compiled"): the two speak one wire
protocol, and the bad input node A sends is the compiled pump's to catch. Applications hold real
socketpair ends."""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import queue
import socket
import threading
import time

import pytest

from tests.support.rdma import device_or_skip
from tests.support import softverbs
from tsor.transport.rdma import GREETING, RdmaEngine, RingConfig, _socketpair
from tsor.transport.rdma_pump import PumpEngine
from tsor.verbs import pyverbs_provider

RING = 16 * 1024
SRC, DST = ("10.1.0.1", 40000), ("10.2.0.1", 80)


class Nodes:
    """Node A (clients) and node B (servers): an engine each, one link between them."""

    def __init__(self, cfg: RingConfig, provider: str = "softverbs") -> None:
        self.provider = provider
        self.accepted: dict[int, tuple] = {}     # by source port
        self.cond = threading.Condition()
        self.down: queue.Queue = queue.Queue()
        self.refuse = False
        # the listener's side writes GREETING on its end (as tsord's supervisors do), then: "silent"
        # never answers, "answer" answers as well, "eof" closes the end instead of greeting
        self.greet: str | None = None
        self.a = RdmaEngine(self._accept, cfg, self.down.put)
        self.b = (PumpEngine if provider == "compiled" else RdmaEngine)(self._accept, cfg, self.down.put)
        self.devices = []
        self.la, self.lb = self.new_links()

    def _accept(self, link, src, dst, app, answer) -> bool:
        if self.refuse:
            app.close()
            answer(False)
            return False
        if self.greet == "eof":
            app.close()
            return True
        if self.greet:
            app.sendall(GREETING)
        with self.cond:
            self.accepted[src[1]] = (src, dst, app)
            self.cond.notify_all()
        if self.greet != "silent":
            answer(True)
        return self.greet is not None

    def new_links(self):
        """A fresh QP pair (over a fresh cable), as a new set-up exchange between tsords builds."""
        if self.provider in ("pyverbs", "compiled"):
            da, db = pyverbs_provider.open_device(), pyverbs_provider.open_device()
        else:
            ca, cb = socket.socketpair()
            da, db = softverbs.open_device(ca, "sva"), softverbs.open_device(cb, "svb")
        self.devices += [da, db]
        la, lb = self.a.add_link("node-b", da), self.b.add_link("node-a", db)
        self.a.connect(la, lb.info)
        self.b.connect(lb, la.info)
        return la, lb

    def open(self, la=None, port: int = SRC[1]) -> tuple[socket.socket, socket.socket]:
        client = self.a.open(la or self.la, (SRC[0], port), DST, 5)
        assert client is not None, "the connection was not set up"
        with self.cond:
            assert self.cond.wait_for(lambda: port in self.accepted, 5)
            src, dst, server = self.accepted.pop(port)
        assert (src, dst) == ((SRC[0], port), DST)
        client.settimeout(20)
        server.settimeout(20)
        return client, server

    def channels(self, engine, link) -> int:
        return link.connections if isinstance(engine, PumpEngine) else engine.call(lambda: len(link.channels))

    def pump_ends_sndbuf(self) -> int:
        """The send buffers of node B's pump ends of its connections."""
        if isinstance(self.b, PumpEngine):   # the C pump's ends are set up as rdma.py's are
            with contextlib.closing(_socketpair()[0]) as probe:
                return self.lb.connections * probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        return sum(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                   for s in self.b.call(lambda: [ch.sock for ch in self.lb.channels.values()]))

    def close(self) -> None:
        for engine, link in ((self.a, self.la), (self.b, self.lb)):
            with contextlib.suppress(Exception):
                engine.close_link(link)
        self.a.close()
        self.b.close()
        for d in self.devices:
            d.close()


@pytest.fixture(params=["softverbs", pytest.param("pyverbs", marks=pytest.mark.rdma_device),
                        pytest.param("compiled", marks=pytest.mark.rdma_device)])
def nodes(request):
    if request.param != "softverbs":
        device_or_skip().close()
    n = Nodes(RingConfig(ring=RING, slots=512), request.param)
    try:
        yield n
    finally:
        n.close()


def drain(sock: socket.socket) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    while chunk := sock.recv(1 << 20):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def send_and_shut(sock: socket.socket, data: bytes) -> threading.Thread:
    def run() -> None:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def echo_and_close(client: socket.socket, server: socket.socket) -> None:
    """A message each way, then the client's close reaches the server as end of file."""
    client.sendall(b"ping")
    assert server.recv(4) == b"ping"
    server.sendall(b"pong")
    assert client.recv(4) == b"pong"
    client.close()
    assert server.recv(1) == b""
    server.close()


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("size", [1, 4095, RING + 1, 3 * RING + 17, 1 << 20, 64 << 20])
def test_stream_arrives_intact(nodes, size):
    if nodes.provider != "softverbs" and size > 1 << 20:
        # these 16 KiB rings move ~1 MB/s over rxe under TCG (the socket's 20 s timeout); 64 MiB over
        # real verbs is test_tsor_rdma.py's stream between two tsords, with the transport's own rings
        pytest.skip("64 MiB on 16 KiB rings: too slow for the emulated lane; covered by test_tsor_rdma.py")
    client, server = nodes.open()
    data = os.urandom(min(size, 1 << 20)) * max(1, size >> 20)
    t = send_and_shut(client, data)
    assert drain(server) == (len(data), hashlib.sha256(data).hexdigest())
    t.join()
    back = data[:size // 3 + 1]
    t = send_and_shut(server, back)
    assert drain(client) == (len(back), hashlib.sha256(back).hexdigest())
    t.join()
    client.close()
    server.close()
    wait_for(lambda: nodes.channels(nodes.a, nodes.la) == 0 and nodes.channels(nodes.b, nodes.lb) == 0)


def test_streams_with_softverbs_rings_arrive_intact():
    """tsord's rings over softverbs (2 MiB, writes of up to 1 MiB: the device reads them straight
    into the ring) carry streams both ways at once, intact."""
    n = Nodes(softverbs.RING)
    try:
        pairs = [n.open(port=30000 + i) for i in range(2)]
        data = [os.urandom(1 << 20) * 24, os.urandom(3 << 20) + b"tail"]
        threads = [send_and_shut(c, d) for (c, _), d in zip(pairs, data)]
        back = send_and_shut(pairs[0][1], data[1])
        assert [drain(s) for _, s in pairs] == [(len(d), hashlib.sha256(d).hexdigest()) for d in data]
        assert drain(pairs[0][0]) == (len(data[1]), hashlib.sha256(data[1]).hexdigest())
        for t in (*threads, back):
            t.join()
    finally:
        n.close()


def region_rss(addr: int) -> int:
    """Resident bytes of this process's mapping that starts at addr (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == addr
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at {addr:#x}")


def test_a_finished_connections_ring_pages_are_given_back():
    ring = 256 << 10
    n = Nodes(RingConfig(ring=ring, slots=16))
    try:
        for i in range(3):
            client, server = n.open(port=31000 + i)
            data = os.urandom(4 * ring)
            t = send_and_shut(client, data)
            assert drain(server)[0] == len(data)
            t.join()
            if i == 0:   # while it is open, its slot's pages are in use
                assert region_rss(n.la.tx_mr.addr) > ring and region_rss(n.lb.rx_mr.addr) > ring
            server.close()
            client.close()
        wait_for(lambda: n.channels(n.a, n.la) == 0 and n.channels(n.b, n.lb) == 0)
        # what stays: the control channel's slot
        for link in (n.la, n.lb):
            assert region_rss(link.tx_mr.addr) <= ring and region_rss(link.rx_mr.addr) <= ring
    finally:
        n.close()


def fill(sock: socket.socket, data: bytes = b"x" * (64 << 20)) -> int:
    """Write until the writer has been held back for half a second; how much it took."""
    sock.setblocking(False)
    written, stalled_since = 0, None
    while written < len(data):
        try:
            written += sock.send(data[written:written + 65536])
            stalled_since = None
        except BlockingIOError:
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > 0.5:
                break
            time.sleep(0.005)
    return written


def test_slow_reader_holds_the_writer_back(nodes):
    client, server = nodes.open()
    data = os.urandom(8 << 20)
    written = fill(client, data)
    bufs = sum(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in (client, server)) + nodes.pump_ends_sndbuf()
    # what is out: the client's socket buffer, one ring, the buffer of the server-side pump's end (it
    # sends into the server's end); nothing else grows
    assert written < bufs + RING + (256 << 10), f"{written} bytes taken while the reader reads nothing"
    out = nodes.a.call(lambda: [ch.tx_sent - ch.tx_acked for ch in nodes.la.channels.values()])
    assert out and max(out) <= RING
    client.setblocking(True)
    client.settimeout(20)
    t = send_and_shut(client, data[written:])
    time.sleep(0.2)
    assert drain(server) == (len(data), hashlib.sha256(data).hexdigest())
    t.join()


def test_200_channels_on_one_qp(nodes):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        pairs = list(pool.map(lambda i: nodes.open(port=20000 + i), range(200)))
    assert nodes.channels(nodes.a, nodes.la) == 200 == nodes.channels(nodes.b, nodes.lb)
    payloads = [os.urandom(40000 + i) for i in range(200)]   # each more than two rings
    for (client, _), p in zip(pairs, payloads):
        client.sendall(p)              # fits the socket buffers: all 200 flow at once
        client.shutdown(socket.SHUT_WR)
    for (_, server), p in zip(pairs, payloads):
        assert drain(server) == (len(p), hashlib.sha256(p).hexdigest())
        server.sendall(p[::-1])
        server.close()
    for (client, _), p in zip(pairs, payloads):
        assert drain(client) == (len(p), hashlib.sha256(p[::-1]).hexdigest())
        client.close()
    wait_for(lambda: nodes.channels(nodes.a, nodes.la) == 0 and nodes.channels(nodes.b, nodes.lb) == 0)


def test_half_close_leaves_the_other_direction_open(nodes):
    client, server = nodes.open()
    client.sendall(b"request")
    client.shutdown(socket.SHUT_WR)
    assert drain(server) == (7, hashlib.sha256(b"request").hexdigest())   # FIN arrived after the data
    reply = os.urandom(1 << 20)
    t = send_and_shut(server, reply)   # the server -> client direction still flows
    assert drain(client) == (len(reply), hashlib.sha256(reply).hexdigest())
    t.join()
    wait_for(lambda: nodes.channels(nodes.a, nodes.la) == 0 and nodes.channels(nodes.b, nodes.lb) == 0)


def test_refused_connection(nodes):
    nodes.refuse = True
    assert nodes.a.open(nodes.la, SRC, DST, 5) is None
    assert nodes.channels(nodes.a, nodes.la) == 0


@pytest.mark.parametrize("greet", ["silent", "answer"])
def test_the_listeners_greeting_accepts_and_stays_out_of_the_stream(nodes, greet):
    """With the greeting, ACCEPT goes out once the byte is in (no answer needed), the byte is read
    out of the stream whether or not the answer came first, and the connection works both ways."""
    nodes.greet = greet
    for port in range(41000, 41020):
        echo_and_close(*nodes.open(port=port))


def test_end_of_file_instead_of_the_greeting_refuses(nodes):
    nodes.greet = "eof"
    t0 = time.monotonic()
    assert nodes.a.open(nodes.la, SRC, DST, 5) is None
    assert time.monotonic() - t0 < 2          # refused, not timed out
    wait_for(lambda: nodes.channels(nodes.b, nodes.lb) == 0)


def test_reset_of_one_channel_leaves_the_others_alone(nodes):
    pairs = [nodes.open(port=30000 + i) for i in range(3)]
    victim_client, victim_server = pairs[1]
    writer_error: list = []

    def flood() -> None:
        try:
            victim_client.sendall(os.urandom(4 << 20))
        except OSError as e:
            writer_error.append(e)
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    victim_server.recv(1)
    victim_server.close()              # unread data in its queue: the connection is reset
    t.join(10)
    assert writer_error and isinstance(writer_error[0], (BrokenPipeError, ConnectionResetError))
    with pytest.raises(ConnectionResetError):
        victim_client.recv(1)
    for client, server in (pairs[0], pairs[2]):
        data = os.urandom(300000)
        w = send_and_shut(client, data)
        assert drain(server) == (len(data), hashlib.sha256(data).hexdigest())
        w.join()
    wait_for(lambda: nodes.channels(nodes.a, nodes.la) == 2 and nodes.channels(nodes.b, nodes.lb) == 2)


def test_qp_error_resets_its_channels_and_a_new_qp_carries_new_ones(nodes):
    pairs = [nodes.open(port=31000 + i) for i in range(3)]
    for client, _ in pairs:            # the servers read nothing: the clients' data waits at the pump
        fill(client)
    downs: set = set()

    def went_down(link) -> None:
        while link not in downs:
            downs.add(nodes.down.get(timeout=5))
    nodes.a.call(nodes.la.qp.to_error)
    went_down(nodes.la)
    for client, _ in pairs:
        client.settimeout(5)
        with pytest.raises(ConnectionResetError):
            client.recv(1)
    # node B learns on its next write into the dead QP (a credit it returned may have been that
    # write already; a tsord would also be told by its peer): softverbs fails that write at once, an
    # RNIC once its retries run out; rxe (6.1, in the RDMA lane) did not fail it within 5 s, so there
    # B's side is left to what tells a tsord (the set-up connection, its lifeline, ending)
    with contextlib.suppress(OSError):
        pairs[0][1].sendall(b"reply")
    if nodes.provider == "softverbs":
        went_down(nodes.lb)
    else:
        nodes.b.close_link(nodes.lb)   # as node B's tsord does when the set-up connection ends
    for _, server in pairs:
        server.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            while server.recv(1 << 20):
                pass                   # the stream ends short of what was sent
    assert nodes.a.open(nodes.la, SRC, DST, 1) is None   # a down link takes no new connections
    nodes.a.close_link(nodes.la)
    nodes.b.close_link(nodes.lb)
    nodes.la, nodes.lb = nodes.new_links()
    client, server = nodes.open()
    data = os.urandom(200000)
    t = send_and_shut(client, data)
    assert drain(server) == (len(data), hashlib.sha256(data).hexdigest())
    t.join()


def test_a_slot_is_not_reused_while_the_acceptor_still_delivers_its_last_bytes():
    """The opener is done with a connection once its bytes and FIN are in the peer's ring; the
    acceptor may still be handing them to a slow reader. The slot comes back to the opener only
    with the acceptor's RELEASE: new connections meanwhile take other slots, and nothing is lost."""
    n = Nodes(RingConfig(ring=RING, slots=6))   # two or three slots per side
    try:
        client, server = n.open(port=33000)
        # a small socket buffer on the acceptor's pump end: most of the bytes stay in its ring
        n.b.call(lambda: [ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                          for ch in n.lb.channels.values()])
        data = os.urandom(RING - 1)   # less than a ring: the opener sends it all, and its FIN, unacknowledged
        send_and_shut(client, data).join(5)
        server.shutdown(socket.SHUT_WR)             # the reader answers FIN before reading anything
        assert client.recv(1) == b""
        wait_for(lambda: n.channels(n.a, n.la) == 0)   # over on the opener's side
        assert n.channels(n.b, n.lb) == 1              # not on the acceptor's: bytes wait in its ring
        for i in range(6):                             # more connections than slots: each done in turn
            c, s = n.open(port=33001 + i)
            s.sendall(b"pong")
            c.shutdown(socket.SHUT_WR)
            assert c.recv(4) == b"pong" and s.recv(1) == b""
            c.close()
            s.close()
            # the opener may take this slot again only after the acceptor's RELEASE, which trails
            # the close: wait for it, or a link of two slots a side is (correctly) full
            wait_for(lambda: n.channels(n.a, n.la) == 0 and n.a.call(lambda: len(n.la.unreleased)) == 1)
        assert drain(server) == (len(data), hashlib.sha256(data).hexdigest())
        server.close()
        client.close()
        wait_for(lambda: n.a.call(lambda: not n.la.unreleased))   # released once delivered
    finally:
        n.close()


# ---- bad input from the peer: the link is reset and counted, the engine and its other links go on --
def assert_reset(app: socket.socket) -> None:
    """The application's end of a connection whose link was reset: writing fails (EPIPE or ECONNRESET)."""
    app.settimeout(5)
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        app.sendall(b"x" * (1 << 20))
        app.recv(1)


def _peer_broke_it(nodes, inject) -> None:
    """`inject(link, ch)` runs in node A's loop with one of A's open channels on the first link and
    sends node B something the protocol forbids. B must reset that link (its connections fail),
    count it, and keep carrying a second link's connections."""
    la2, lb2 = nodes.new_links()
    victim_client, victim_server = nodes.open(port=32000)
    other_client, other_server = nodes.open(la2, port=32001)
    victim_server.sendall(b"queued for the client")   # data on its way: a reset, not an end of file
    assert victim_client.recv(6) == b"queued"
    nodes.a.call(lambda: inject(nodes.la, next(iter(nodes.la.channels.values()))))
    assert nodes.down.get(timeout=5) is nodes.lb
    assert nodes.b.resets == {"protocol": 1}
    assert_reset(victim_server)
    assert nodes.b.open(nodes.lb, DST, SRC, 1) is None   # a reset link takes no new connections
    echo_and_close(other_client, other_server)          # the other link is untouched
    for engine, link in ((nodes.a, la2), (nodes.b, lb2)):
        engine.close_link(link)


def test_a_control_record_for_a_slot_out_of_range_resets_the_link(nodes):
    from tsor.transport import rdma

    def inject(link, ch):
        link._ctl(rdma.CREDIT, 9999, 0, 1)
        link._flush_ctl()
    _peer_broke_it(nodes, inject)


def test_an_oversized_control_record_resets_the_link(nodes):
    from tsor.transport import rdma

    def inject(link, ch):   # a header that announces a payload of 60000 bytes: nobody waits for it
        link.ctl_out.append(rdma._CTL.pack(rdma.OPEN, 1, 1, 0, 0, 60000))
        link._flush_ctl()
    _peer_broke_it(nodes, inject)


def test_a_write_past_a_channels_ring_resets_the_link(nodes):
    def inject(link, ch):   # a write that runs off the end of the channel's ring into the next slot's
        link._post(ch, ch.base + ch.tx_sent % RING, RING + 8, ch.slot)
    _peer_broke_it(nodes, inject)


def test_a_credit_for_bytes_never_sent_resets_the_link(nodes):
    from tsor.transport import rdma

    def inject(link, ch):
        link._ctl(rdma.CREDIT, ch.slot, ch.gen, ch.rx_head + (1 << 20))
        link._flush_ctl()
    _peer_broke_it(nodes, inject)


def starve(silent_engine, silent_link, writer: socket.socket) -> None:
    """The silent node stops reporting anything (its reposted receive WRs among it); the writer's
    application then writes one byte at a time, more writes than the silent node's 64 receive WRs."""
    silent_engine.call(lambda: setattr(silent_link, "_flush_ctl", lambda: None))
    writer.setblocking(False)
    with contextlib.suppress(OSError):
        for _ in range(200):
            writer.send(b"x")
            time.sleep(0.002)


def test_a_peer_that_grants_no_link_credits_is_reset(monkeypatch):
    """Node B stops reporting its reposted receive WRs (and everything else): node A's budget runs
    out while its client still writes, and after STALL_SECONDS A resets the link."""
    from tsor.transport import rdma
    monkeypatch.setattr(rdma, "STALL_SECONDS", 0.5)
    monkeypatch.setattr(rdma, "STALL_CHECK", 0.1)
    nodes = Nodes(RingConfig(ring=RING, slots=64, rq_depth=64))
    try:
        client, server = nodes.open()
        starve(nodes.b, nodes.lb, client)
        assert nodes.down.get(timeout=5) is nodes.la
        assert nodes.a.resets == {"stalled": 1}
        assert_reset(client)
        server.close()
        nodes.a.close_link(nodes.la)
        nodes.b.close_link(nodes.lb)
        nodes.la, nodes.lb = nodes.new_links()
        echo_and_close(*nodes.open(port=32100))
    finally:
        nodes.close()


def test_both_nodes_open_connections_at_once(nodes):
    """Each node opens slots of its own parity, so both may open at the same moment on one link."""
    results: dict = {}

    def dial(engine, link, base) -> None:
        results[base] = [engine.open(link, (SRC[0], base + i), DST, 10) for i in range(20)]
    ts = [threading.Thread(target=dial, args=args) for args in ((nodes.a, nodes.la, 33000), (nodes.b, nodes.lb, 34000))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    with nodes.cond:
        assert nodes.cond.wait_for(lambda: len(nodes.accepted) == 40, 10)
    for base in (33000, 34000):
        for i, client in enumerate(results[base]):
            assert client is not None
            _, _, server = nodes.accepted.pop(base + i)
            echo_and_close(client, server)


# ---- the compiled pump (transport/rdma_pump.c) on a real device ------------------------------------
@pytest.fixture
def compiled():
    device_or_skip().close()
    n = Nodes(RingConfig(ring=RING, slots=64, rq_depth=64), "compiled")
    try:
        yield n
    finally:
        n.close()


@pytest.mark.rdma_device
def test_python_threads_run_while_the_compiled_pump_waits_and_works(compiled):
    """The pump's thread waits on its completion channel and moves bytes without the GIL: a Python
    thread that ticks every millisecond is never held up (pyverbs' get_cq_event, which holds the
    GIL, stopped every other thread for as long as it waited)."""
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    t = threading.Thread(target=tick, daemon=True)
    t.start()
    client, server = compiled.open()
    time.sleep(1.0)                    # idle: the pump waits on the armed channel
    data = os.urandom(4 << 20)
    w = send_and_shut(server, data)    # busy: node B's pump moves 4 MiB to node A
    assert drain(client) == (len(data), hashlib.sha256(data).hexdigest())
    w.join()
    stop.set()
    t.join()
    assert len(gaps) > 200 and max(gaps) < 0.25, f"longest pause {max(gaps):.3f} s"


@pytest.mark.rdma_device
def test_the_compiled_pump_resets_a_peer_that_grants_no_link_credits(compiled):
    """Node A (the Python engine) stops reporting its reposted receive WRs: the compiled pump's
    budget runs out while its application still writes, and after its 10 s it resets the link."""
    client, server = compiled.open()
    starve(compiled.a, compiled.la, server)
    assert compiled.down.get(timeout=20) is compiled.lb
    assert compiled.b.resets == {"stalled": 1}
    assert_reset(server)
