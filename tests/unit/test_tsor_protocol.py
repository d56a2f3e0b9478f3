"""TSoR's wire format, route table and config: every malformed input is refused with a reason."""
from __future__ import annotations

import json
import os
import time

import pytest

from tsor import config, protocol, routes
from tsor.addr import as_family, parse_sockaddr, sockaddr, unmapped
from tsor.errors import ConfigError, ProtocolError


def test_round_trip_every_message():
    msgs = [protocol.Hello("c1", 42, ["10.0.0.1", "fd00::1"]), protocol.Listen(7, "0.0.0.0", 80, False),
            protocol.Unlisten(7), protocol.Connect(("10.0.0.2", 6379), 40000),
            protocol.Incoming(7, ("10.0.0.2", 40000), ("10.0.0.1", 80), "local", True)]
    for i, m in enumerate(msgs):
        mid, back = protocol.decode(protocol.encode(i, m))
        assert (mid, back) == (i, m)


def test_reply_decodes_as_dict():
    assert protocol.decode(protocol.reply(3, path="local", src=("10.0.0.1", 5))) == \
        (3, {"re": 3, "path": "local", "src": ["10.0.0.1", 5]})


@pytest.mark.parametrize("raw, says", [
    (b"\xff\xfe", "not JSON"), (b"[1]", "not an object"), (b'{"op": "connect"}', "id"),
    (b'{"op": "nope", "id": 1}', "unknown operation"),
    (b'{"op": "connect", "id": 1, "src_port": 1}', "missing field 'dst'"),
    (b'{"op": "connect", "id": 1, "dst": ["10.0.0.1"], "src_port": 1}', "dst"),
    (b'{"op": "connect", "id": 1, "dst": ["nope", 80], "src_port": 1}', "dst"),
    (b'{"op": "connect", "id": 1, "dst": ["10.0.0.1", 70000], "src_port": 1}', "dst"),
    (b'{"op": "connect", "id": 1, "dst": ["10.0.0.1", 80], "src_port": -1}', "src_port"),
    (b'{"op": "listen", "id": 1, "token": 1, "addr": "x", "port": 1}', "addr"),
    (b'{"op": "listen", "id": 1, "token": true, "addr": "::", "port": 1}', "token"),
    (b'{"op": "hello", "id": 1, "sandbox": "a", "pid": 1, "addrs": "10.0.0.1"}', "addrs"),
    (b'{"op": "incoming", "id": 1, "token": 1, "peer": ["::1", 1], "local": ["::1", 1], "path": "x"}', "path"),
])
def test_malformed_messages_are_refused_with_a_reason(raw, says):
    with pytest.raises(ProtocolError, match=says):
        protocol.decode(raw)


def test_error_in_a_known_request_carries_its_id():
    with pytest.raises(ProtocolError) as e:
        protocol.decode(b'{"op": "connect", "id": 9, "dst": 5, "src_port": 1}')
    assert e.value.mid == 9


@pytest.mark.parametrize("family, ep", [(2, ("10.1.2.3", 80)), (10, ("fd00::5", 443)),
                                        (10, ("::ffff:10.1.2.3", 8080))])
def test_sockaddr_round_trip(family, ep):
    assert parse_sockaddr(sockaddr(family, ep)) == (family, ep)


def test_ipv4_on_an_ipv6_socket_is_mapped():
    assert as_family("10.0.0.1", 10) == "::ffff:10.0.0.1"
    assert unmapped("::ffff:10.0.0.1") == "10.0.0.1"
    assert parse_sockaddr(sockaddr(10, ("10.0.0.1", 1)))[1] == ("::ffff:10.0.0.1", 1)


def test_route_table_longest_prefix(tmp_path):
    nodes = routes.parse({"nodes": [
        {"name": "a", "address": "192.168.0.1:7470", "pods": ["10.0.0.0/16"]},
        {"name": "b", "address": "192.168.0.2:7470", "pods": ["10.0.5.0/24", "fd00:1::/64"]}]}, "r.yaml")
    t = routes.RouteTable(nodes)
    assert t.lookup("10.0.1.1").name == "a"
    assert t.lookup("10.0.5.9").name == "b"
    assert t.lookup("::ffff:10.0.5.9").name == "b"
    assert t.lookup("fd00:1::9").name == "b"
    assert t.lookup("8.8.8.8") is None


@pytest.mark.parametrize("raw, field", [
    ({}, "nodes"), ({"nodes": [{"address": "1.2.3.4:5"}]}, "nodes[0].name"),
    ({"nodes": [{"name": "a", "address": "nohost"}]}, "nodes[0].address"),
    ({"nodes": [{"name": "a", "pods": ["10.0.0.0/33"]}]}, "nodes[0].pods[0]"),
])
def test_bad_route_files_name_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        routes.parse(raw, "r.yaml")


def test_route_file_reload_keeps_old_routes_on_a_bad_edit(tmp_path):
    f = tmp_path / "routes.yaml"
    f.write_text(json.dumps({"nodes": [{"name": "a", "pods": ["10.0.0.0/24"]}]}))
    seen = []
    src = routes.StaticFile(str(f), interval=3600, on_reload=seen.append)
    table = routes.RouteTable()
    src.start(table)
    try:
        assert table.lookup("10.0.0.1").name == "a"
        f.write_text(json.dumps({"nodes": [{"name": "b", "pods": ["10.0.0.0/24", "10.9.0.0/24"]}]}))
        os.utime(f, (time.time() + 5, time.time() + 5))
        src.check()
        assert table.lookup("10.9.0.1").name == "b" and seen
        f.write_text("nodes: [ {name: c, pods: [bogus]} ]")
        os.utime(f, (time.time() + 10, time.time() + 10))
        src.check()
        assert table.lookup("10.9.0.1").name == "b"
    finally:
        src.stop()


def test_config_parses_and_names_bad_fields(tmp_path):
    f = tmp_path / "tsor.yaml"
    f.write_text("node: n1\nsocket: /run/x.sock\nlisten: 10.0.0.1:7470\nmetrics: unix:/run/m.sock\n"
                 "routes: routes.yaml\ninsecure_no_auth: true\n")
    c = config.load(str(f))
    assert (c.node, c.socket, str(c.listen), c.metrics) == ("n1", "/run/x.sock", "10.0.0.1:7470", "/run/m.sock")
    assert c.routes == str(tmp_path / "routes.yaml")
    assert c.sockopt_offload   # tsord joins quark's socket cgroup unless told not to
    f.write_text("sockopt_offload: false\n")
    assert not config.load(str(f)).sockopt_offload
    assert c.local_path == "socketpair"
    f.write_text("local_path: sockmap\n")
    assert config.load(str(f)).local_path == "sockmap"
    assert c.rdma == config.RdmaPort()   # the provider's own choice of device, port and GID
    f.write_text("rdma: {device: mlx5_1, port: 2, gid_index: 3}\n")
    assert config.load(str(f)).rdma == config.RdmaPort("mlx5_1", 2, 3)
    assert c.rdma.pump == "compiled"   # transport/rdma_pump.c; python: transport/rdma.py's engine
    f.write_text("rdma: {pump: python}\n")
    assert config.load(str(f)).rdma.pump == "python"
    assert c.rdma.pump_port == 7471   # the remote path's pump listener (tsor/remote_path.py)
    f.write_text("rdma: {pump_port: 9000}\n")
    assert config.load(str(f)).rdma.pump_port == 9000
    for text, field in [("rdma: rxe0", "rdma"), ("rdma: {pump: c}", "rdma.pump"), ("rdma: {gid: 3}", "rdma.gid"), ("rdma: {port: 0}", "rdma.port"),
                        ("rdma: {gid_index: -1}", "rdma.gid_index"), ("rdma: {device: ''}", "rdma.device"),
                        ("rdma: {pump_port: 0}", "rdma.pump_port"), ("rdma: {pump_port: true}", "rdma.pump_port"),
                        ("socket: rel.sock", "socket"), ("listen: 7470", "listen"),
                        ("bogus: 1", "bogus"), ("metrics: localhost:x", "metrics"), ("- 1", "mapping"),
                        ("sockopt_offload: maybe", "sockopt_offload"), ("local_path: rdma", "local_path")]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=field):
            config.load(str(f))
