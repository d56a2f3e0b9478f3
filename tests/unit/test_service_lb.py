"""Which Service ports the connect-time balancer (tsor/service_lb.py) takes from tsord's route
table, with which endpoints; and the byte layouts its maps share with tsor/bpf/service_lb.bpf.c.
The programs themselves run in tests/integration/test_tsor_sockmap.py."""
from __future__ import annotations

import socket
import struct

from tsor import service_lb
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
    raw = service_lb._endpoint(("10.1.0.7", 8080))
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
