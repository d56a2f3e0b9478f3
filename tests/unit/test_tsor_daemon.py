"""tsord in-process with sandboxes played by TsordClient on a real event loop: registration,
address claims, the local and tcp paths, fallback, malformed messages and tsord restarts."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest

from qvisor.eventloop import Loop
from tsor import protocol
from tsor.config import Config, HostPort
from tsor.daemon import Daemon
from tsor.errors import NotAllowed
from tsor.identity import Identity, ProcVerifier
from tsor.metrics import fetch, parse
from tsor.routes import Node, RouteTable
from tsor.sandbox import TsordClient
import ipaddress


class FakeVerifier:
    """Each sandbox name owns fixed addresses; the netns is the name's hash."""

    def __init__(self, owned: dict[str, set[str]]) -> None:
        self.owned = owned

    def verify(self, peer_pid, hello):
        if not set(hello.addrs) <= self.owned.get(hello.sandbox, set()):
            raise NotAllowed(f"{hello.addrs} not owned by {hello.sandbox}")
        return Identity(hello.sandbox, hello.pid, hash(hello.sandbox), frozenset(hello.addrs))


class StaticRoutes:
    def __init__(self, nodes):
        self.nodes = nodes

    def start(self, table: RouteTable) -> None:
        table.replace(self.nodes)

    def stop(self) -> None:
        pass


class Sandbox:
    """A supervisor's view: a TsordClient on a Loop; incoming connections land in .accepted."""

    def __init__(self, loop: Loop, path: str, name: str, addrs: list[str]) -> None:
        self.loop = loop
        self.accepted: list[tuple[socket.socket, protocol.Incoming]] = []
        self.ups = 0
        self.listens: list[protocol.Listen] = []
        self.client = TsordClient(loop, path, protocol.Hello(name, 1, addrs), self._incoming, self._up)

    def _up(self):
        self.ups += 1
        for m in self.listens:   # what SandboxNet does: announce its listeners again
            self.client.request(m, lambda r, fds: None)

    def _incoming(self, msg, fd):
        if msg.greet:
            os.write(fd, b"\x01")
        self.accepted.append((socket.socket(fileno=os.dup(fd)), msg))
        return True

    def call(self, message, timeout=5.0):
        if isinstance(message, protocol.Listen):
            self.listens.append(message)
        box = []
        self.client.request(message, lambda r, fds: box.append((r, fds)))
        deadline = time.monotonic() + timeout
        while not box and time.monotonic() < deadline:
            self.loop.run_once(0.01)
        assert box, f"no reply to {message}"
        return box[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def node(tmp_path):
    started = []

    def make(name="node-a", owned=None, nodes=(), listen=None, metrics=None):
        sock = str(tmp_path / f"{name}.sock")
        d = Daemon(Config(node=name, socket=sock, listen=listen, metrics=metrics),
                   verifier=FakeVerifier(owned or {}), route_source=StaticRoutes(list(nodes)))
        d.start()
        started.append(d)
        return d
    yield make
    for d in started:
        d.stop()


def test_local_path_gives_both_ends_of_one_socketpair(node):
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    loop = Loop()
    srv = Sandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"])
    cli = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])
    assert srv.client.open() and cli.client.open()
    r, _ = srv.call(protocol.Listen(77, "0.0.0.0", 8080))
    assert r["ok"]
    # (the server's incoming is answered from the same loop the client waits on)
    r, fds = cli.call(protocol.Connect(("10.0.0.1", 8080), 41000))
    assert r["path"] == "local" and r["src"] == ["10.0.0.2", 41000] and len(fds) == 1
    server_end, inc = srv.accepted[0]
    assert inc.peer == ("10.0.0.2", 41000) and inc.local == ("10.0.0.1", 8080) and inc.path == "local"
    client_end = socket.socket(fileno=fds[0])
    assert client_end.family == socket.AF_UNIX
    client_end.sendall(b"ping")
    assert server_end.recv(4) == b"ping"
    server_end.close()
    client_end.close()
    m = parse(d.metrics.render())
    assert m['tsor_connections_total{path="local"}'] == 1 and m['tsor_incoming_total{path="local"}'] == 1


def test_no_listener_or_unknown_destination_falls_back(node):
    d = node(owned={"cli": {"10.0.0.2"}})
    loop = Loop()
    cli = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])
    assert cli.client.open()
    for dst in [("10.0.0.1", 80), ("8.8.8.8", 53)]:
        r, fds = cli.call(protocol.Connect(dst, 1))
        assert r == {"re": r["re"], "path": "fallback"} and fds == []


def test_a_sandbox_cannot_claim_or_listen_on_another_sandboxes_address(node):
    d = node(owned={"a": {"10.0.0.1"}, "b": {"10.0.0.2"}})
    loop = Loop()
    thief = Sandbox(loop, d.cfg.socket, "b", ["10.0.0.1"])
    assert not thief.client.open()
    b = Sandbox(loop, d.cfg.socket, "b", ["10.0.0.2"])
    assert b.client.open()
    r, _ = b.call(protocol.Listen(1, "10.0.0.1", 80))
    assert "not an address of sandbox b" in r["error"]
    assert (("10.0.0.1", 80)) not in d.listeners
    assert parse(d.metrics.render())["tsor_refused_total"] == 2


def test_same_address_from_two_netns_is_refused(node):
    d = node(owned={"a": {"10.0.0.1"}, "a2": {"10.0.0.1"}})
    loop = Loop()
    assert Sandbox(loop, d.cfg.socket, "a", ["10.0.0.1"]).client.open()
    assert not Sandbox(loop, d.cfg.socket, "a2", ["10.0.0.1"]).client.open()


def test_malformed_messages_fail_that_request_and_tsord_keeps_serving(node):
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    loop = Loop()
    srv = Sandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"])
    assert srv.client.open()
    srv.call(protocol.Listen(5, "10.0.0.1", 80))
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    bad.connect(d.cfg.socket)
    bad.settimeout(5)
    for junk in [b"garbage", b'{"op":"connect","id":4,"dst":"x","src_port":1}', b"x" * 70000,
                 b'{"op":"listen","id":5,"token":1,"addr":"10.0.0.1","port":80}']:
        try:
            bad.send(junk)
        except OSError:
            pass
    replies = [protocol.decode(bad.recv(65536))[1] for _ in range(3)]
    assert all("error" in r for r in replies)
    assert replies[1]["re"] == 4
    cli = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])
    assert cli.client.open()
    r, fds = cli.call(protocol.Connect(("10.0.0.1", 80), 2))
    assert r["path"] == "local"
    for fd in fds:
        os.close(fd)
    assert parse(d.metrics.render())["tsor_protocol_errors_total"] >= 2
    bad.close()


def test_tcp_path_between_two_tsords(node):
    pa, pb = free_port(), free_port()
    nodes = [Node("node-a", HostPort("127.0.0.1", pa), (ipaddress.ip_network("10.1.0.0/24"),)),
             Node("node-b", HostPort("127.0.0.1", pb), (ipaddress.ip_network("10.2.0.0/24"),))]
    a = node("node-a", {"cli": {"10.1.0.5"}}, nodes, HostPort("127.0.0.1", pa))
    b = node("node-b", {"srv": {"10.2.0.7"}}, nodes, HostPort("127.0.0.1", pb))
    loop = Loop()
    srv = Sandbox(loop, b.cfg.socket, "srv", ["10.2.0.7"])
    cli = Sandbox(loop, a.cfg.socket, "cli", ["10.1.0.5"])
    assert srv.client.open() and cli.client.open()
    srv.call(protocol.Listen(9, "0.0.0.0", 5201))
    r, fds = cli.call(protocol.Connect(("10.2.0.7", 5201), 33333))
    assert r["path"] == "tcp", r
    c = socket.socket(fileno=fds[0])
    assert c.family == socket.AF_INET and c.type == socket.SOCK_STREAM
    s, inc = srv.accepted[0]
    assert inc.peer == ("10.1.0.5", 33333) and inc.path == "tcp"
    c.sendall(b"hello")
    assert s.recv(5) == b"hello"
    s.sendall(b"back")
    assert c.recv(4) == b"back"
    c.close()
    s.close()
    # no listener on node b: the client falls back
    r, fds = cli.call(protocol.Connect(("10.2.0.7", 9999), 33334))
    assert r["path"] == "fallback" and not fds


def test_tcp_transport_refuses_sources_not_of_the_calling_node(node):
    pb = free_port()
    nodes = [Node("node-b", HostPort("127.0.0.1", pb), (ipaddress.ip_network("10.2.0.0/24"),)),
             Node("node-x", HostPort("192.0.2.1", 1), (ipaddress.ip_network("10.9.0.0/24"),))]
    b = node("node-b", {"srv": {"10.2.0.7"}}, nodes, HostPort("127.0.0.1", pb))
    loop = Loop()
    srv = Sandbox(loop, b.cfg.socket, "srv", ["10.2.0.7"])
    assert srv.client.open()
    srv.call(protocol.Listen(9, "0.0.0.0", 80))
    import json, struct
    with socket.create_connection(("127.0.0.1", pb), timeout=5) as s:
        h = json.dumps({"src": ["10.9.0.1", 5], "dst": ["10.2.0.7", 80]}).encode()
        s.sendall(struct.pack("!I", len(h)) + h)
        assert s.recv(1) in (b"", b"\x00")
    assert not srv.accepted


def test_clients_fall_back_while_tsord_is_down_and_reregister_when_back(node, tmp_path):
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    loop = Loop()
    srv = Sandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"])
    cli = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])
    srv.client.start()
    cli.client.start()
    assert srv.client.up and cli.client.up
    srv.call(protocol.Listen(5, "10.0.0.1", 80))
    r, fds = cli.call(protocol.Connect(("10.0.0.1", 80), 1))
    established = (socket.socket(fileno=fds[0]), srv.accepted[0][0])
    d.stop()
    deadline = time.monotonic() + 5
    while (srv.client.up or cli.client.up) and time.monotonic() < deadline:
        loop.run_once(0.05)
    r, fds = cli.call(protocol.Connect(("10.0.0.1", 80), 2))
    assert r is None and fds == []
    established[0].sendall(b"still here")
    assert established[1].recv(10) == b"still here"
    d2 = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}})
    deadline = time.monotonic() + 5
    while not (srv.client.up and cli.client.up) and time.monotonic() < deadline:
        loop.run_once(0.05)
    assert srv.ups == 2 and cli.ups == 2
    loop.run_once(0.1)   # the listener is announced again on reconnect
    r, fds = cli.call(protocol.Connect(("10.0.0.1", 80), 3))
    assert r["path"] == "local"
    for fd in fds:
        os.close(fd)
    for s in established:
        s.close()


def test_metrics_endpoint_serves_prometheus_text(node, tmp_path):
    d = node(owned={}, metrics=str(tmp_path / "m.sock"))
    text = fetch(str(tmp_path / "m.sock"))
    assert "# TYPE tsor_connections_total counter" in text
    assert parse(text)['tsor_connections_total{path="local"}'] == 0
    port = free_port()
    d2 = node("n2", metrics=HostPort("127.0.0.1", port))
    assert "tsor_sandboxes 0" in fetch(HostPort("127.0.0.1", port))


def test_proc_verifier_refuses_foreign_pids_and_the_host_netns():
    v = ProcVerifier()
    with pytest.raises(NotAllowed, match="not a process of the sandbox"):
        v.verify(os.getpid(), protocol.Hello("x", 1, []))
    with pytest.raises(NotAllowed, match="node's network namespace"):
        v.verify(os.getppid(), protocol.Hello("x", os.getpid(), []))


def test_quark_tsor_status_prints_the_counters(node, tmp_path, capsys):
    import argparse
    from qvisor.commands import tsor as cmd
    m = str(tmp_path / "m.sock")
    d = node(owned={"srv": {"10.0.0.1"}, "cli": {"10.0.0.2"}}, metrics=m)
    loop = Loop()
    srv = Sandbox(loop, d.cfg.socket, "srv", ["10.0.0.1"])
    cli = Sandbox(loop, d.cfg.socket, "cli", ["10.0.0.2"])
    assert srv.client.open() and cli.client.open()
    srv.call(protocol.Listen(1, "10.0.0.1", 80))
    for port in (80, 81):
        _, fds = cli.call(protocol.Connect(("10.0.0.1", port), 5))
        for fd in fds:
            os.close(fd)
    assert cmd.run(argparse.Namespace(metrics=f"unix:{m}", config="", format="json")) == 0
    out = json.loads(capsys.readouterr().out)
    by_path = {r["path"]: r for r in out["paths"]}
    assert by_path["local"]["connections"] == 1 and by_path["fallback"]["connections"] == 1
    assert out["sandboxes"] == 2 and out["listeners"] == 1
    assert cmd.run(argparse.Namespace(metrics=f"unix:{m}", config="", format="table")) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:2] == ["PATH", "CONNECTIONS"]
