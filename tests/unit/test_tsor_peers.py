"""Direct channels between supervisors (tsor/peers.py) with tsord in-process: the first connect to a
listener goes through tsord and brings a route; the next ones go supervisor to supervisor, until
tsord's route generation changes, the listener refuses, or either side loses tsord."""
from __future__ import annotations

import os
import socket
import time

from qlib.eventloop import Loop
from tests.unit.test_tsor_daemon import node  # noqa: F401 (fixture)
from tsor import protocol
from tsor.metrics import parse
from tsor.peers import PeerLinks
from tsor.sandbox import TsordClient


class DirectSandbox:
    """A supervisor's TSoR side as SandboxNet wires it (TsordClient + PeerLinks), with listeners
    kept as tokens -> (ip, port) and incoming connections landing in .accepted."""

    def __init__(self, loop: Loop, path: str, name: str, addrs: list[str]) -> None:
        self.loop, self.addrs = loop, addrs
        self.accepted: list[tuple[socket.socket, protocol.Incoming]] = []
        self.listening: dict[int, tuple[str, int]] = {}
        self.client = TsordClient(loop, path, protocol.Hello(name, 1, addrs, direct=True), self._incoming,
                                  self._up, self.peers_serve, self._down)
        self.peers = PeerLinks(loop, addrs, self._incoming, self.client.notify)

    def peers_serve(self, msg, fd):
        return self.peers.serve(msg, fd)

    def _up(self):
        self.peers.registered(self.client.take_generation())
        for token, (ip, port) in self.listening.items():
            self.client.request(protocol.Listen(token, ip, port), lambda r, fds: None)

    def _down(self):
        self.peers.flush_tally()
        self.peers.reset()

    def _incoming(self, msg, fd):
        if msg.token not in self.listening:
            return False
        self.accepted.append((socket.socket(fileno=os.dup(fd)), msg))
        return True

    def register(self) -> None:
        self.client.start()
        self.run(lambda: self.client.up)

    def listen(self, token: int, ip: str, port: int) -> None:
        self.listening[token] = (ip, port)
        box = []
        self.client.request(protocol.Listen(token, ip, port), lambda r, fds: box.append(r))
        self.run(lambda: box)

    def connect(self, dst, src_port: int) -> tuple[dict | None, socket.socket | None]:
        """SandboxNet.connect's way: a route if one holds, else tsord (whose answer may bring one)."""
        box = []

        def on_reply(reply, fds):
            box.append((reply, socket.socket(fileno=fds[0]) if fds else None))
        if not self.peers.connect(dst, src_port, on_reply):
            def answered(reply, fds):
                if reply is not None and reply.get("direct") is not None and reply.get("path") == "local":
                    self.peers.adopt(dst, reply, fds)
                    fds = fds[:1]
                on_reply(reply, fds)
            self.client.request(protocol.Connect(dst, src_port), answered)
        self.run(lambda: box)
        return box[0]

    def run(self, cond, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond() and time.monotonic() < deadline:
            self.loop.run_once(0.01)
        assert cond(), "timed out"


def pair(node):
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    loop = Loop()
    srv, cli = DirectSandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"]), DirectSandbox(loop, d.cfg.socket, "cli",
                                                                                      ["10.0.0.2"])
    srv.register()
    cli.register()
    srv.listen(7, "0.0.0.0", 8080)
    return d, srv, cli


def tsord_connects(d) -> int:
    return int(sum(d.metrics.connections.values()))


def local_counts(d, sandboxes, want: int) -> tuple[float, float]:
    """tsord's local-path counters once the sandboxes' tallies (sent now) reached it (or 5 s)."""
    for sb in sandboxes:
        sb.peers.flush_tally()
    deadline = time.monotonic() + 5
    while True:
        m = parse(d.metrics.render())
        got = m['tsor_connections_total{path="local"}'], m['tsor_incoming_total{path="local"}']
        if got == (want, want) or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def at_eof(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False


def echo(srv, client_end, peer):
    sock, inc = srv.accepted.pop()
    assert inc.peer == peer and inc.local == ("10.0.0.1", 8080) and inc.path == "local"
    client_end.sendall(b"ping")
    assert sock.recv(4) == b"ping"
    sock.close()
    client_end.close()


def test_after_the_first_connect_through_tsord_the_next_go_straight_to_the_listener(node):
    d, srv, cli = pair(node)
    asked = []
    original = d._connect
    d._connect = lambda *a: (asked.append(a[2]), original(*a))   # connect requests tsord served
    for i in range(5):
        reply, end = cli.connect(("10.0.0.1", 8080), 41000 + i)
        assert reply["path"] == "local" and reply["src"] == ["10.0.0.2", 41000 + i]
        srv.run(lambda: srv.accepted)
        echo(srv, end, ("10.0.0.2", 41000 + i))
    assert len(asked) == 1, "only the first connect may ask tsord"
    assert local_counts(d, [srv, cli], 5) == (5, 5)   # tallies: tsord's counters still count every connection


def test_a_route_generation_change_sends_the_next_connect_to_tsord_again(node):
    d, srv, cli = pair(node)
    cli.connect(("10.0.0.1", 8080), 41000)[1].close()
    assert ("10.0.0.1", 8080) in cli.peers.routes
    d.routes.sync(pods=[])   # any change of the routes or policies (here: a relist) bumps the generation
    before = tsord_connects(d)
    reply, end = cli.connect(("10.0.0.1", 8080), 41001)
    assert reply["path"] == "local" and tsord_connects(d) == before + 1
    end.close()


def test_a_closed_listener_refuses_and_the_route_is_dropped(node):
    d, srv, cli = pair(node)
    cli.connect(("10.0.0.1", 8080), 41000)[1].close()
    srv.accepted.clear()
    del srv.listening[7]   # the application closed its listener; tsord not told yet
    reply, end = cli.connect(("10.0.0.1", 8080), 41001)
    assert reply["path"] == "local"     # the offer went out before the refusal could come back
    cli.run(lambda: ("10.0.0.1", 8080) not in cli.peers.routes)
    assert at_eof(end)                  # the listener's side closed: end of file, as a dropped TCP accept
    end.close()
    srv.client.request(protocol.Unlisten(7), lambda r, fds: None)
    srv.run(lambda: ("10.0.0.1", 8080) not in d.listeners)
    reply, end = cli.connect(("10.0.0.1", 8080), 41002)
    assert reply["path"] == "fallback" and end is None   # tsord: nothing listens (the native connect refuses)


def test_only_the_listening_sandboxes_checks_pass_an_offer(node):
    """The listening supervisor takes offers on a channel only from the client's own addresses, to
    its own addresses, for a listener it has (SandboxNet also checks the listener covers the port)."""
    d, srv, cli = pair(node)
    cli.connect(("10.0.0.1", 8080), 41000)[1].close()
    route = cli.peers.routes[("10.0.0.1", 8080)]
    srv.accepted.clear()
    for peer, local, token in [(("10.0.0.9", 1), ("10.0.0.1", 8080), 7),    # not the client's address
                               (("10.0.0.2", 1), ("10.0.0.5", 8080), 7),    # not the server's address
                               (("10.0.0.2", 1), ("10.0.0.1", 8080), 99)]:  # no such listener
        ours, theirs = socket.socketpair()
        assert route.channel.offer(protocol.Incoming(token, peer, local, "local"), theirs.fileno())
        theirs.close()
        srv.run(lambda: at_eof(ours))   # refused: the listening side closed its end
        ours.close()
    assert srv.accepted == []


def test_losing_tsord_drops_every_route_and_channel(node):
    d, srv, cli = pair(node)
    cli.connect(("10.0.0.1", 8080), 41000)[1].close()
    assert cli.peers.routes and cli.peers.channels and srv.peers.served
    d.stop()
    cli.run(lambda: not cli.client.up and not cli.peers.routes and not cli.peers.channels)
    srv.run(lambda: not srv.peers.served)


def test_a_service_clusterip_is_never_cached(node):
    """tsord picks a Service's endpoint per connect, so only pod addresses get a route."""
    from tsor.routes import ServicePort
    d, srv, cli = pair(node)
    d.routes.services = {("10.96.0.10", 80): ServicePort("default", "web", "")}
    d.routes.endpoints = lambda sp, family, node: [("10.0.0.1", 8080)]
    for i in range(2):
        reply, end = cli.connect(("10.96.0.10", 80), 41000 + i)
        assert reply["path"] == "local" and "direct" not in reply
        end.close()
    assert cli.peers.routes == {}


def test_a_sandbox_that_does_not_say_direct_gets_no_route(node):
    from tests.unit.test_tsor_daemon import Sandbox
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    loop = Loop()
    srv = DirectSandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"])
    srv.register()
    srv.listen(7, "0.0.0.0", 8080)
    old = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])   # a supervisor started before this version
    assert old.register()
    r, fds = old.call(protocol.Connect(("10.0.0.1", 8080), 41000))
    assert r["path"] == "local" and "direct" not in r and len(fds) == 1
    os.close(fds[0])


def test_no_offer_reaches_the_listener_when_the_connect_went_native_after_all(node):
    """The application's end is handed over before the offer is sent; if the trapped connect was
    answered natively instead (its fd changed meanwhile), the listener must not get a connection."""
    d, srv, cli = pair(node)
    cli.connect(("10.0.0.1", 8080), 41000)[1].close()
    srv.run(lambda: srv.accepted)
    srv.accepted.clear()
    taken = []

    def not_taken(reply, fds):
        taken.append(reply)
        os.close(fds[0])
        return False
    assert cli.peers.connect(("10.0.0.1", 8080), 41001, not_taken)
    deadline = time.monotonic() + 0.3   # time for an offer to arrive, had one been sent
    while time.monotonic() < deadline:
        srv.loop.run_once(0.01)
    assert taken and srv.accepted == []
    reply, end = cli.connect(("10.0.0.1", 8080), 41002)   # the route still holds
    srv.run(lambda: srv.accepted)
    echo(srv, end, ("10.0.0.2", 41002))


def test_a_fallback_answer_holds_until_the_route_generation_moves(node):
    d, srv, cli = pair(node)
    dst = ("10.0.0.9", 80)                       # no listener, no route: tsord says native
    reply, end = cli.connect(dst, 41000)
    assert reply["path"] == "fallback" and end is None
    assert reply["native"] == cli.peers.generation.value
    cli.peers.remember_native(dst, reply["native"])
    before = tsord_connects(d)
    assert all(cli.peers.known_native(dst) for _ in range(3))   # answered here, tsord not asked
    assert not cli.peers.known_native(("10.0.0.9", 81))        # (only that port)
    cli.peers.flush_tally()
    cli.run(lambda: tsord_connects(d) == before + 3)           # ... but counted as fallback there
    assert d.metrics.connections["fallback"] == 4
    srv.listen(8, "0.0.0.0", 9090)               # any listener registering bumps the generation
    assert not cli.peers.known_native(dst) and dst not in cli.peers.native


def test_a_listener_address_is_never_answered_native(node):
    d, srv, cli = pair(node)
    reply, end = cli.connect(("10.0.0.1", 8080), 41000)        # the local path
    assert reply["path"] == "local" and "native" not in reply
    end.close()
