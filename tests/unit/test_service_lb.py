"""Which Service ports the connect-time balancer (tsor/service_lb.py) takes from tsord's route
table, with which endpoints; the byte layouts its maps share with tsor/bpf/service_lb.bpf.c; and
what is done when the maps (its own, and the sockmap path's address map) are full. The programs
themselves run in tests/integration/test_tsor_sockmap.py."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct

import pytest

from qlib import bpf
from tsor import service_lb, sockmap
from tsor.routes import EndpointSlice, RouteTable, ServicePort


def table() -> RouteTable:
    t = RouteTable()
    t.sync(services={
        ("default", "web"): {("10.96.0.10", 80): ServicePort("default", "web", "http"),
                             ("10.96.0.10", 443): ServicePort("default", "web", "https")},
        ("default", "sticky"): {("10.96.0.11", 80): ServicePort("default", "sticky", "", client_affinity=True)},
        ("default", "here"): {("10.96.0.12", 80): ServicePort("default", "here", "", node_local=True)},
        ("default", "v6"): {("fd00::10", 80): ServicePort("default", "v6", "")},
        ("default", "idle"): {("10.96.0.13", 80): ServicePort("default", "idle", "")},
    }, slices={
        ("default", "web-1"): EndpointSlice("default", "web", socket.AF_INET, (("http", 8080, "TCP"), ("https", 8443, "TCP")),
                                            (("10.1.0.7", True, "a"), ("10.1.0.8", False, "a"), ("10.2.0.9", True, "b"))),
        ("default", "web-2"): EndpointSlice("default", "web", socket.AF_INET, (("http", 8080, "TCP"),),
                                            (("10.1.0.7", True, "a"),)),   # the same endpoint in two slices: once
        ("default", "sticky-1"): EndpointSlice("default", "sticky", socket.AF_INET, (("", 80, "TCP"),),
                                               (("10.1.0.7", True, "a"),)),
        ("default", "here-1"): EndpointSlice("default", "here", socket.AF_INET, (("", 80, "TCP"),),
                                             (("10.1.0.7", True, "a"), ("10.2.0.9", True, "b"))),
        ("default", "v6-1"): EndpointSlice("default", "v6", socket.AF_INET6, (("", 80, "TCP"),),
                                           (("fd00::7", True, "a"),)),
        ("default", "idle-1"): EndpointSlice("default", "idle", socket.AF_INET, (("", 80, "TCP"),),
                                             (("10.1.0.7", False, "a"),)),
    })
    return t


def test_the_balanced_service_ports_and_their_ready_endpoints():
    T = service_lb.Target
    assert service_lb.wanted(table(), "a") == {
        # the ready ones (another node's too: routed as any pod address), each once
        ("10.96.0.10", 80): T((("10.1.0.7", 8080), ("10.2.0.9", 8080))),
        ("10.96.0.10", 443): T((("10.1.0.7", 8443), ("10.2.0.9", 8443))),
        ("10.96.0.11", 80): T((("10.1.0.7", 80),), 10800),   # ClientIP affinity, its default timeout
        ("10.96.0.12", 80): T((("10.1.0.7", 80),)),   # internalTrafficPolicy: Local: this node's only
        ("10.96.0.13", 80): T(()),                     # no ready endpoint: kept, to refuse the connect
        # IPv6 ClusterIPs: the node's NAT
    }


def test_the_map_layouts_match_the_c_structs():
    # struct service_key {u32 ip4; u16 port (network order, as the context's user_port); u16 pad}
    assert service_lb._service_key("10.96.0.10", 80) == socket.inet_aton("10.96.0.10") + b"\x00\x50\0\0"
    # struct backend_key {u32 ip4; u16 port; u16 index (host order)}
    assert service_lb._backend_key("10.96.0.10", 80, 3) == socket.inet_aton("10.96.0.10") + b"\x00\x50" + \
        struct.pack("=H", 3)
    # struct endpoint {u32 ip4; u16 port (network order: written into user_port as it is); u16 pad}
    raw = service_lb.endpoint_value(("10.1.0.7", 8080))
    assert raw == socket.inet_aton("10.1.0.7") + b"\x1f\x90\0\0" and service_lb._parse_endpoint(raw) == ("10.1.0.7", 8080)
    assert len(service_lb.CONNECT_NAME) <= 15 and len(service_lb.PEER_NAME) <= 15   # BPF_OBJ_NAME_LEN - 1
    assert all(len(name) <= 15 for name in service_lb.MAPS)


def test_a_services_affinity_timeout_is_read_as_the_api_gives_it():
    from tests.support import fake_kube_api as k8s
    from tsor.routes_k8s import service_entry
    sticky = service_entry(k8s.service("s", "10.96.0.20", [(None, 80, 8080)], affinity="ClientIP", affinity_seconds=30))
    assert sticky[("10.96.0.20", 80)].client_affinity and sticky[("10.96.0.20", 80)].affinity_seconds == 30
    default = service_entry(k8s.service("s", "10.96.0.20", [(None, 80, 8080)], affinity="ClientIP"))
    assert default[("10.96.0.20", 80)].affinity_seconds == 10800   # the API's default


# ---- maps full: what has no room is left to the node, counted, logged once ---------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creating BPF maps: bpf(2))")


@contextlib.contextmanager
def small_maps(services: int, backends: int, addresses: int = 4):
    """Hash maps with the key and value sizes of the programs' (the C file's structs), and room
    for only this many entries."""
    fds = {service_lb.SERVICES_MAP: bpf.map_create(bpf.MAP_TYPE_HASH, 8, 8, services, bpf.F_NO_PREALLOC),
           service_lb.BACKENDS_MAP: bpf.map_create(bpf.MAP_TYPE_HASH, 8, 8, backends, bpf.F_NO_PREALLOC),
           service_lb.NETNS_MAP: bpf.map_create(bpf.MAP_TYPE_HASH, 8, 1, 16, bpf.F_NO_PREALLOC),
           "addrs": bpf.map_create(bpf.MAP_TYPE_HASH, 4, 8, addresses, bpf.F_NO_PREALLOC)}
    try:
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _eps(n: int, base: int) -> tuple:
    return tuple((f"10.1.{base}.{i}", 8080) for i in range(1, n + 1))


@needs_root
def test_service_ports_with_no_room_are_left_to_the_node_whole_counted_and_logged_once(caplog):
    T = service_lb.Target
    caplog.set_level(logging.INFO, logger="tsor")
    with small_maps(services=4, backends=8) as maps:
        lb = service_lb.ServiceLB(-1, {}, maps)
        want = {("10.96.0.1", 80): T(_eps(3, 1)), ("10.96.0.2", 80): T(_eps(3, 2)), ("10.96.0.3", 80): T(_eps(3, 3))}
        lb.sync(want)
        # two fit (6 of 8 endpoints); the third would need 9: it is out of the maps whole (none of its
        # endpoints stays behind), so its connects meet the node's NAT, not part of its endpoints
        held = lb.services()
        assert len(held) == 2 and all(want[k] == v for k, v in held.items())
        left = (set(want) - set(held)).pop()
        assert lb.left_to_node() == 1 and lb.service_ports() == 2
        assert len(bpf.map_keys(maps[service_lb.BACKENDS_MAP], 8)) == 6
        lb.sync(want)   # again: no room yet, no second warning
        assert [r.message for r in caplog.records if r.levelno == logging.WARNING] == [
            f"service_lb: the maps are full: 1 Service ports (e.g. {left[0]}:{left[1]}) are left to the node's NAT "
            "(kube-proxy) until there is room"]
        # a Service goes: the one left out is written at the next sync
        del want[next(iter(held))]
        lb.sync(want)
        assert lb.services() == want and lb.left_to_node() == 0
        assert "service_lb: every Service port is in the maps again" in caplog.messages
        # a Service that grows past the room left goes out whole too, and comes back when it shrinks
        grown = {**want, left: T(_eps(6, 9))}
        lb.sync(grown)
        assert left not in lb.services() and lb.left_to_node() == 1
        assert len(bpf.map_keys(maps[service_lb.BACKENDS_MAP], 8)) == 3
        lb.sync(want)
        assert lb.services() == want and lb.left_to_node() == 0


@needs_root
def test_pod_addresses_with_no_room_in_the_sockmap_path_take_the_stack_counted_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="tsor")
    with small_maps(services=1, backends=1, addresses=2) as maps:
        path = sockmap.SockmapPath(-1, -1, -1, maps["addrs"], -1, -1)
        reg = sockmap.Registrar(path)
        ns = ("/proc/self/ns/net", os.stat("/proc/self/ns/net").st_ino)
        reg.sync({"10.1.0.1": ns, "10.1.0.2": ns, "10.1.0.3": ns})
        assert len(path.registered()) == 2 and len(reg.left_native) == 1
        reg.sync({"10.1.0.1": ns, "10.1.0.2": ns, "10.1.0.3": ns})
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        reg.sync({"10.1.0.3": ns, "10.1.0.4": ns})   # two gone: both that are wanted now fit
        assert set(path.registered()) == {"10.1.0.3", "10.1.0.4"} and reg.left_native == set()
        assert "sockmap: every registered pod address is carried again" in caplog.messages
