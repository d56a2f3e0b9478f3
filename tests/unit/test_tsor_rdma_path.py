"""tsord's rdma path between two tsords in-process, over softverbs (the tsords' own authenticated TCP
connection is the cable), with sandboxes played by TsordClient as in test_tsor_daemon; the
`transport` setting; fallback to tcp where a peer does not take rdma."""
from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import threading
import time

import pytest

from qlib.eventloop import Loop
from tests.unit.test_rdma_ring import echo_and_close
from tests.unit.test_tsor_daemon import SECRET, Sandbox, free_port, node  # noqa: F401 (node: a fixture)
from tsor import protocol
from tsor.config import HostPort, load
from tsor.daemon import Daemon
from tsor.errors import ConfigError
from tsor.metrics import parse
from tsor.routes import Node


def two_nodes(node, transport_a, transport_b):
    pa, pb = free_port(), free_port()
    nodes = [Node("node-a", HostPort("127.0.0.1", pa), (ipaddress.ip_network("10.1.0.0/24"),)),
             Node("node-b", HostPort("127.0.0.1", pb), (ipaddress.ip_network("10.2.0.0/24"),))]
    a = node("node-a", {"cli": {"10.1.0.5"}}, nodes, HostPort("127.0.0.1", pa),
             metrics=str(node.dir / "node-a-metrics.sock"), transport=transport_a)
    b = node("node-b", {"srv": {"10.2.0.7"}}, nodes, HostPort("127.0.0.1", pb),
             metrics=str(node.dir / "node-b-metrics.sock"), transport=transport_b)
    loop = Loop()
    srv = Sandbox(loop, b.cfg.socket, "srv", ["10.2.0.7"])
    cli = Sandbox(loop, a.cfg.socket, "cli", ["10.1.0.5"])
    assert srv.register() and cli.register()
    srv.call(protocol.Listen(9, "0.0.0.0", 5201))
    return a, b, srv, cli


def connect(cli, srv, port: int):
    r, fds = cli.call(protocol.Connect(("10.2.0.7", 5201), port))
    if not fds:
        return r, None, None
    c = socket.socket(fileno=fds[0])
    s, inc = srv.accepted[-1]
    assert inc.peer == ("10.1.0.5", port)
    c.settimeout(10)
    s.settimeout(10)
    return r, c, (s, inc)


SOFT = (("*", "softverbs"),)


def test_rdma_path_over_softverbs_between_two_tsords(node):
    a, b, srv, cli = two_nodes(node, SOFT, SOFT)
    r, c, (s, inc) = connect(cli, srv, 40001)
    assert r["path"] == "rdma" and inc.path == "rdma", r
    assert c.family == socket.AF_UNIX     # the application's end of the pump
    data = os.urandom(3 << 20)
    t = threading.Thread(target=lambda: (c.sendall(data), c.shutdown(socket.SHUT_WR)), daemon=True)
    t.start()
    got = bytearray()
    while chunk := s.recv(1 << 20):
        got += chunk
    t.join()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    s.sendall(b"bye")
    s.close()
    assert c.recv(3) == b"bye" and c.recv(1) == b""
    # one link carries every connection between the two nodes
    r2, c2, (s2, _) = connect(cli, srv, 40002)
    assert r2["path"] == "rdma"
    assert a.rdma.status()["node-b"]["connections"] >= 1 and list(b.rdma.status()) == ["node-a"]
    assert a.rdma.status()["node-b"]["provider"] == "softverbs"
    c2.close()
    s2.close()
    # node b counts a connection once its listener's supervisor has answered the offer, which may
    # come after the connection is already in use (the greeting accepts it first)
    deadline = time.monotonic() + 5
    while parse(b.metrics.render())['tsor_incoming_total{path="rdma"}'] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    ma, mb = parse(a.metrics.render()), parse(b.metrics.render())
    assert ma['tsor_connections_total{path="rdma"}'] == 2 and mb['tsor_incoming_total{path="rdma"}'] == 2
    # no listener on node b: the peer refuses, the client connects natively
    r, fds = cli.call(protocol.Connect(("10.2.0.7", 9999), 40003))
    assert r["path"] == "fallback" and not fds


def status(d: Daemon, fmt: str, capsys) -> str:
    import argparse

    from qvisor.commands import tsor as cmd
    assert cmd.run(argparse.Namespace(tsor_verb="status", metrics=f"unix:{d.cfg.metrics}", config="",
                                      format=fmt)) == 0
    return capsys.readouterr().out


def rdma_bytes(d: Daemon) -> tuple[float, float]:
    m = parse(d.metrics.render())
    return tuple(m[f'tsor_bytes_total{{direction="{d}",path="rdma"}}'] for d in ("sent", "received"))


def test_rdma_bytes_are_counted_exactly_and_quark_tsor_status_shows_them_and_the_link(node, capsys):
    a, b, srv, cli = two_nodes(node, SOFT, SOFT)
    r, c, (s, _) = connect(cli, srv, 40051)
    assert r["path"] == "rdma"
    up, down = (1 << 20) + 4321, 777
    t = threading.Thread(target=lambda: c.sendall(os.urandom(up)), daemon=True)
    t.start()
    got = 0
    while got < up:
        got += len(s.recv(1 << 20))
    t.join()
    s.sendall(b"r" * down)
    assert len(c.recv(down, socket.MSG_WAITALL)) == down
    deadline = time.monotonic() + 5      # the pump counts just after the bytes moved
    while (rdma_bytes(a), rdma_bytes(b)) != ((up, down), (down, up)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rdma_bytes(a) == (up, down) and rdma_bytes(b) == (down, up)   # application bytes, no protocol
    out = json.loads(status(a, "json", capsys))
    row = {p["path"]: p for p in out["paths"]}["rdma"]
    assert (row["connections"], row["bytes_sent"], row["bytes_received"]) == (1, up, down)
    assert out["rdma_links"] == [{"node": "node-b", "provider": "softverbs", "device": "softverbs-node-b",
                                  "pump": "python", "connections": 1}]
    assert {p["path"]: p for p in json.loads(status(b, "json", capsys))["paths"]}["rdma"]["incoming"] == 1
    table = status(a, "table", capsys).splitlines()
    assert next(line for line in table if line.startswith("rdma ")).split()[:5] == \
        ["rdma", "1", "0", str(up), str(down)]
    assert table[-1] == "rdma link to node node-b: rdma on softverbs-node-b (softverbs, python pump), 1 connections"
    c.close()
    s.close()


def test_a_peer_that_does_not_take_softverbs_gets_tcp(node):
    a, b, srv, cli = two_nodes(node, SOFT, (("*", "tcp"),))
    r, c, (s, inc) = connect(cli, srv, 40011)
    assert r["path"] == "tcp" and inc.path == "tcp"
    assert c.family == socket.AF_INET
    c.close()
    s.close()
    assert a.rdma.status() == {} == b.rdma.status()


def test_auto_without_an_rdma_device_is_tcp(node):
    a, _, srv, cli = two_nodes(node, (("*", "auto"),), (("*", "auto"),))
    r, c, (s, _) = connect(cli, srv, 40021)
    assert r["path"] == "tcp"
    assert a.rdma.rdma_device() is None      # this host has no RNIC
    c.close()
    s.close()


def test_connections_one_after_another_carry_no_greeting_byte(node):
    """tsord offers rdma connections from the engine's thread and the supervisor's greeting accepts
    them there: whichever of greeting and answer comes first, the byte never reaches either side."""
    a, b, srv, cli = two_nodes(node, SOFT, SOFT)
    for i in range(20):
        r, c, (s, inc) = connect(cli, srv, 41000 + i)
        assert r["path"] == "rdma" and inc.greet
        echo_and_close(c, s)
    assert parse(b.metrics.render())['tsor_incoming_total{path="rdma"}'] == 20


def test_a_restarted_peer_tsord_resets_the_links_connections_and_new_ones_work(node):
    a, b, srv, cli = two_nodes(node, SOFT, SOFT)
    r, c, (s, _) = connect(cli, srv, 40031)
    assert r["path"] == "rdma"
    c.setblocking(False)          # fill the path: the server reads nothing
    stalled_since = None
    while stalled_since is None or time.monotonic() - stalled_since < 0.5:
        try:
            c.send(b"x" * 65536)
            stalled_since = None
        except BlockingIOError:
            stalled_since = stalled_since or time.monotonic()
            time.sleep(0.01)
    c.settimeout(5)
    b.rdma.close()                # node b's tsord loses its links (as when it dies)
    deadline = time.monotonic() + 5
    while "node-b" in a.rdma.status() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "node-b" not in a.rdma.status()
    with pytest.raises(ConnectionResetError):   # the pump's end went with data still queued
        c.recv(1)
    # counted: node a's link failed under it (its QP's peer went), which is not a peer breaking the protocol
    resets = {k: v for k, v in parse(a.metrics.render()).items() if k.startswith("tsor_rdma_link_resets_total")}
    assert resets == {'tsor_rdma_link_resets_total{reason="verbs"}': 1}
    # node b comes back (a fresh rdma transport in the same tsord); node a sets up a new link
    from tsor.transport.rdma_link import RdmaTransport
    b.rdma = RdmaTransport("node-b", b.deliver, b.cfg.node_key, b.cfg.transport_for, cabled=b.cabled)
    b.remote.rdma_setup = b.rdma.serve
    a.rdma._failed.clear()
    r, c2, (s2, _) = connect(cli, srv, 40032)
    assert r["path"] == "rdma"
    c2.sendall(b"again")
    assert s2.recv(5) == b"again"
    for x in (c, s, c2, s2):
        x.close()


def test_transport_setting(tmp_path):
    f = tmp_path / "tsor.yaml"
    f.write_text("node: a\nsocket: /run/x.sock\ntransport: rdma\n")
    assert load(str(f)).transport_for("any") == "rdma"
    f.write_text("node: a\nsocket: /run/x.sock\ntransport: {node-b: rdma, '*': tcp}\n")
    cfg = load(str(f))
    assert (cfg.transport_for("node-b"), cfg.transport_for("node-c")) == ("rdma", "tcp")
    # the software provider is the tests' (tests/support/softverbs_tsord.py): tsord refuses it
    f.write_text("node: a\nsocket: /run/x.sock\ntransport: softverbs\n")
    with pytest.raises(ConfigError, match=r"transport: expected one of auto, rdma, tcp, got 'softverbs'"):
        load(str(f))
    assert load(str(f), ("auto", "rdma", "tcp", "softverbs")).transport_for("any") == "softverbs"
    f.write_text("node: a\nsocket: /run/x.sock\n")
    assert load(str(f)).transport_for("node-b") == "auto"
    f.write_text("node: a\nsocket: /run/x.sock\ntransport: {node-b: infiniband}\n")
    with pytest.raises(ConfigError) as e:
        load(str(f))
    assert "transport.node-b" in str(e.value) and "auto, rdma, tcp" in str(e.value)
    f.write_text("node: a\nsocket: /run/x.sock\ntransport: fast\n")
    with pytest.raises(ConfigError) as e:
        load(str(f))
    assert ": transport:" in str(e.value)


def test_rdma_set_up_only_from_the_named_nodes_address(node):
    """A peer must name a node of the route table whose address it connects from, and prove the
    cluster secret, before it gets a QP."""
    from tsor.transport import tcp
    _, b, _, _ = two_nodes(node, SOFT, SOFT)
    to_b = Node("node-b", b.cfg.listen, ())
    assert tcp.dial(to_b, SECRET, {"rdma": "softverbs", "node": "node-c"}) is None     # not a node
    b.routes.replace(list(b.routes.nodes.values()) + [Node("node-c", HostPort("10.9.9.9", 1), ())])
    assert tcp.dial(to_b, SECRET, {"rdma": "softverbs", "node": "node-c"}) is None     # not from there
    assert tcp.dial(to_b, b"another cluster's secret", {"rdma": "softverbs", "node": "node-a"}) is None
    s = tcp.dial(to_b, SECRET, {"rdma": "softverbs", "node": "node-a"})
    assert s is not None    # the real node: its set-up goes on
    s.close()
    assert b.rdma.status() == {}
