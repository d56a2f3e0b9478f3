"""`quark tsor check`: the host's RDMA devices (pyverbs, here a stand-in module: this machine has
none) and the transport each peer node of tsor.yaml's route table would get, decided by tsord's own
choice (transport/rdma_link.py)."""
from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from qvisor.commands import tsor as cmd
from tests.support import fake_kube_api as k8s
from tsor import check
from tsor.errors import ConfigError
from tsor.transport.rdma_link import RdmaTransport, choose
from tsor.verbs import NoDevice, PortInfo
from tsor.verbs import pyverbs_provider as pv

GID = "fe80:0000:0000:0000:0202:c9ff:fe01:0203"


class FakeDevice:
    def __init__(self, active: bool, name: str = "mlx5_0") -> None:
        self.name, self.active, self.closed = name, active, False

    def port(self) -> PortInfo:
        return PortInfo(self.active, 0, bytes(16), 1024, 1 << 30)

    def close(self) -> None:
        self.closed = True


def no_device(port=None):
    raise NoDevice("the kernel lists none in /sys/class/infiniband")


def write_config(tmp_path, transport: str, secret: bool = True) -> str:
    (tmp_path / "secret").write_text("s" * 32)
    (tmp_path / "secret").chmod(0o600)
    (tmp_path / "routes.yaml").write_text("""nodes:
  - {name: node-a, address: 127.0.0.1:7470, pods: [10.1.0.0/24]}
  - {name: node-b, address: 127.0.0.1:7471, pods: [10.2.0.0/24]}
  - {name: node-c, address: 127.0.0.1:7472, pods: [10.3.0.0/24]}
  - {name: node-d, address: 127.0.0.1:7473, pods: [10.4.0.0/24]}
  - {name: node-e, address: 127.0.0.1:7474, pods: [10.5.0.0/24]}
  - {name: node-f, pods: [10.6.0.0/24]}
""")
    cfg = tmp_path / "tsor.yaml"
    cfg.write_text(f"node: node-a\nroutes: routes.yaml\ntransport: {transport}\n"
                   + ("cluster_secret_file: secret\n" if secret else ""))
    return str(cfg)


MAP = '{node-b: tcp, node-c: tcp, node-d: rdma, "*": auto}'


def test_check_opens_the_port_tsor_yaml_names(tmp_path, monkeypatch):
    """tsord and the check open the same port: tsor.yaml's `rdma:` reaches the provider."""
    path = write_config(tmp_path, "rdma")
    with open(path, "a") as f:
        f.write("rdma: {device: mlx5_1, port: 2, gid_index: 3}\n")
    asked = []
    monkeypatch.setattr(pv, "open_device", lambda *a: asked.append(a) or no_device())
    check.report(path, describe=lambda: [])
    assert asked == [("mlx5_1", 2, 3)]


def by_node(report: dict) -> dict[str, dict]:
    return {p["node"]: p for p in report["peers"]}


def test_per_node_transport_without_an_rdma_device(tmp_path):
    r = check.report(write_config(tmp_path, MAP), describe=lambda: no_device(), open_rdma=no_device)
    peers = by_node(r)
    assert "node-a" not in peers                     # this node is no peer of its own
    assert {n: (p["configured"], p["transport"]) for n, p in peers.items()} == {
        "node-b": ("tcp", "tcp"), "node-c": ("tcp", "tcp"), "node-d": ("rdma", "tcp"),
        "node-e": ("auto", "tcp"), "node-f": ("auto", "native")}
    assert peers["node-b"]["detail"] == "tcp: a kernel TCP connection for each connection"
    assert peers["node-d"]["detail"] == peers["node-e"]["detail"] == \
        "tcp: no RDMA device (the kernel lists none in /sys/class/infiniband)"
    assert r["rdma"] == {"devices": [], "error": "no RDMA device (the kernel lists none in /sys/class/infiniband)",
                         "pump": {"used": "compiled", "why": None}}   # make install built it
    assert r["transport"] == {"node-b": "tcp", "node-c": "tcp", "node-d": "rdma", "*": "auto"}


def test_auto_and_rdma_take_an_active_port_and_only_an_active_one(tmp_path):
    path = write_config(tmp_path, MAP)
    devs = []

    def opener(active):
        def open_rdma():
            devs.append(FakeDevice(active))
            return devs[-1]
        return open_rdma
    peers = by_node(check.report(path, describe=lambda: [], open_rdma=opener(True)))
    assert (peers["node-d"]["transport"], peers["node-e"]["transport"], peers["node-b"]["transport"]) == \
        ("rdma", "rdma", "tcp")
    assert "mlx5_0" in peers["node-e"]["detail"] and "else tcp" in peers["node-e"]["detail"]
    r = check.report(path, describe=lambda: [], open_rdma=opener(False))
    assert by_node(r)["node-e"]["transport"] == "tcp"
    assert r["rdma_port"] == {"device": None, "why_not": "no RDMA device (mlx5_0: port not active)"}
    assert len(devs) == 2 and all(d.closed for d in devs)   # asked once per report, and closed again


def test_a_map_without_star_defaults_to_auto_and_the_device_is_not_opened_when_no_peer_needs_it(tmp_path):
    def never():
        raise AssertionError("opened a device no peer needed")
    r = check.report(write_config(tmp_path, "tcp"), describe=lambda: [], open_rdma=never)
    assert {p["transport"] for p in r["peers"] if p["node"] != "node-f"} == {"tcp"}
    assert r["rdma_port"] is None
    r = check.report(write_config(tmp_path, "{node-b: tcp}"), describe=lambda: [], open_rdma=no_device)
    assert by_node(r)["node-c"]["configured"] == "auto" and by_node(r)["node-c"]["transport"] == "tcp"


def test_without_the_cluster_secret_every_peer_is_native(tmp_path):
    r = check.report(write_config(tmp_path, "rdma", secret=False), describe=lambda: [], open_rdma=no_device)
    assert {p["transport"] for p in r["peers"]} == {"native"}
    assert "cluster_secret_file" in by_node(r)["node-b"]["detail"]


def test_choose_is_what_tsord_uses():
    assert choose("softverbs", lambda: True) == "tcp"   # a name tsord has no provider for
    assert choose("softverbs", lambda: False, cabled="softverbs") == "softverbs"   # the tests' tsord
    assert choose("tcp", lambda: True) == "tcp"
    assert choose("auto", lambda: True) == choose("rdma", lambda: True) == "rdma"
    assert choose("auto", lambda: False) == choose("rdma", lambda: False) == "tcp"


def test_tsord_does_not_take_rdma_on_an_inactive_port():
    dev = FakeDevice(active=False)
    t = RdmaTransport("node-a", lambda *a: False, b"k" * 16, lambda n: "rdma", open_rdma=lambda: dev)
    try:
        assert t.rdma_device() is None and t.kind("node-b") is None
        assert dev.closed
    finally:
        t.close()


# ---- the devices, through a stand-in for pyverbs.device -----------------------------------------
class PyverbsError(Exception):
    pass


def fake_pyverbs(monkeypatch, devices: dict[str, list[dict]], sysfs=None):
    """devices: name -> per port {state, lid, active_mtu, link_layer, gids: {index: text or None or
    (text, type)}}; the GID tables (and a device's kind) are written under `sysfs`, as the kernel
    shows them in /sys/class/infiniband (an unpopulated entry reads zeros; its type, EINVAL)."""
    if sysfs is not None:
        monkeypatch.setattr(pv, "SYSFS", str(sysfs))
        for name, ports in devices.items():
            base = sysfs / name
            (base / "device").mkdir(parents=True)   # a bus device behind it: an adapter
            for num, p in enumerate(ports, 1):
                (base / f"ports/{num}/gids").mkdir(parents=True)
                (base / f"ports/{num}/gid_attrs/types").mkdir(parents=True)
                for i, g in p["gids"].items():
                    text, kind = g if isinstance(g, tuple) else (g, "RoCE v2" if p["link_layer"] == 2 else "")
                    (base / f"ports/{num}/gids/{i}").write_text((text or ":".join(["0000"] * 8)) + "\n")
                    if text is not None and kind:
                        (base / f"ports/{num}/gid_attrs/types/{i}").write_text(kind + "\n")
    class Context:
        def __init__(self, name):
            self.ports = devices[name]
            self.closed = False
            contexts.append(self)

        def query_device(self):
            return types.SimpleNamespace(phys_port_cnt=len(self.ports))

        def query_port(self, num):
            p = self.ports[num - 1]
            return types.SimpleNamespace(state=p["state"], lid=p["lid"], active_mtu=p["active_mtu"],
                                         link_layer=p["link_layer"], gid_tbl_len=len(p["gids"]))

        def close(self):
            self.closed = True
    contexts: list = []
    dev = types.ModuleType("pyverbs.device")
    dev.get_device_list = lambda: [types.SimpleNamespace(name=n.encode()) for n in devices]
    dev.Context = Context
    err = types.ModuleType("pyverbs.pyverbs_error")
    err.PyverbsError = PyverbsError
    monkeypatch.setitem(sys.modules, "pyverbs.device", dev)
    monkeypatch.setitem(sys.modules, "pyverbs.pyverbs_error", err)
    return contexts


def run_check(path: str, fmt: str, capsys) -> str:
    assert cmd.run(argparse.Namespace(tsor_verb="check", config=path, format=fmt)) == 0
    return capsys.readouterr().out


V4 = "0000:0000:0000:0000:0000:ffff:0ad3:0001"


def test_check_reports_each_device_and_port(tmp_path, monkeypatch, capsys):
    zero = ":".join(["0000"] * 8)
    contexts = fake_pyverbs(monkeypatch, {
        "mlx5_0": [{"state": 4, "lid": 0, "active_mtu": 3, "link_layer": 2,
                    "gids": {0: (GID, "IB/RoCE v1"), 1: zero, 2: None, 3: (V4, "IB/RoCE v1"), 4: (V4, "RoCE v2")}},
                   {"state": 1, "lid": 7, "active_mtu": 5, "link_layer": 1, "gids": {0: zero}}],
        "mlx5_1": [{"state": 2, "lid": 9, "active_mtu": 1, "link_layer": 0, "gids": {}}]}, tmp_path / "sys")
    monkeypatch.setattr(check, "open_pyverbs", no_device)
    out = json.loads(run_check(write_config(tmp_path, "tcp"), "json", capsys))
    assert out["rdma"]["error"] is None
    assert out["rdma"]["devices"] == [
        {"name": "mlx5_0", "kind": "hardware", "ports": [
            {"port": 1, "state": "ACTIVE", "lid": 0, "mtu": 1024, "link_layer": "Ethernet",
             "gids": [{"index": 0, "gid": GID, "type": "IB/RoCE v1"}, {"index": 3, "gid": V4, "type": "IB/RoCE v1"},
                      {"index": 4, "gid": V4, "type": "RoCE v2"}], "default_gid": 4},
            {"port": 2, "state": "DOWN", "lid": 7, "mtu": 4096, "link_layer": "InfiniBand", "gids": [],
             "default_gid": 0}]},
        {"name": "mlx5_1", "kind": "hardware", "ports": [
            {"port": 1, "state": "INIT", "lid": 9, "mtu": 256, "link_layer": "InfiniBand", "gids": [],
             "default_gid": 0}]}]
    assert all(c.closed for c in contexts) and len(contexts) == 2
    table = run_check(write_config(tmp_path, "tcp"), "table", capsys)
    assert "mlx5_0 port 1: ACTIVE, Ethernet, LID 0, active MTU 1024" in table
    assert f"GID[0] {GID} IB/RoCE v1\n" in table and f"GID[4] {V4} RoCE v2  <- used" in table
    assert "mlx5_1 port 1: INIT, InfiniBand, LID 9, active MTU 256" in table


def test_check_says_no_rdma_device_plainly(tmp_path, monkeypatch, capsys):
    fake_pyverbs(monkeypatch, {})
    monkeypatch.setattr(check, "open_pyverbs", no_device)
    path = write_config(tmp_path, MAP)
    table = run_check(path, "table", capsys)
    assert table.splitlines()[0] == \
        "RDMA devices (pyverbs): none: no RDMA device (the kernel lists none in /sys/class/infiniband)"
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in table.splitlines() if line.startswith("node-")}
    assert rows["node-b"][:2] == ["tcp", "tcp"] and rows["node-e"][:2] == ["auto", "tcp"]
    assert rows["node-f"][:2] == ["auto", "native"]
    out = json.loads(run_check(path, "json", capsys))
    assert out["rdma"]["devices"] == [] and out["rdma"]["error"].startswith("no RDMA device")


def test_check_says_when_pyverbs_is_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)   # None in sys.modules: ImportError
    monkeypatch.setattr(check, "open_pyverbs", no_device)
    out = json.loads(run_check(write_config(tmp_path, "tcp"), "json", capsys))
    assert out["rdma"]["error"].startswith("no RDMA device (pyverbs is not installed")


def test_a_bad_config_names_the_file_and_the_field(tmp_path, capsys):
    path = write_config(tmp_path, "{node-b: rdmaa}")
    with pytest.raises(ConfigError, match=r"tsor\.yaml: transport\.node-b: expected one of auto, rdma, tcp, got .rdmaa."):
        cmd.run(argparse.Namespace(tsor_verb="check", config=path, format="table"))
    path = write_config(tmp_path, "tcp")
    (tmp_path / "routes.yaml").write_text("nodes:\n  - {name: node-b, address: nowhere}\n")
    with pytest.raises(ConfigError, match=r"routes\.yaml: nodes\[0\]\.address"):
        cmd.run(argparse.Namespace(tsor_verb="check", config=path, format="json"))


# ---- peers from the Kubernetes route source, against the API stand-in ----------------------------
def write_k8s_config(tmp_path, server: str) -> str:
    (tmp_path / "secret").write_text("s" * 32)
    (tmp_path / "secret").chmod(0o600)
    k8s.write_kubeconfig(str(tmp_path / "kubeconfig"), server)
    cfg = tmp_path / "tsor.yaml"
    cfg.write_text(f"node: node-a\ntransport: {MAP}\ncluster_secret_file: secret\n"
                   "kubernetes: {kubeconfig: kubeconfig, tsord_port: 7000}\n")
    return str(cfg)


def test_with_a_kubernetes_source_the_peers_are_the_nodes_the_api_server_lists(tmp_path, capsys):
    api = k8s.FakeKubeAPI()
    try:
        for name, ip in (("node-a", "10.99.0.1"), ("node-b", "10.99.0.2"), ("node-e", "10.99.0.5")):
            api.put("nodes", k8s.node(name, ip, []))
        no_ip = k8s.node("node-f", "10.99.0.6", [])
        no_ip["status"]["addresses"] = [{"type": "Hostname", "address": "node-f"}]
        api.put("nodes", no_ip)
        path = write_k8s_config(tmp_path, api.url)
        r = check.report(path, describe=lambda: [], open_rdma=no_device)
        assert [p["node"] for p in r["peers"]] == ["node-b", "node-e", "node-f"]   # not this node itself
        peers = by_node(r)
        assert (peers["node-b"]["address"], peers["node-b"]["transport"]) == ("10.99.0.2:7000", "tcp")
        assert (peers["node-e"]["configured"], peers["node-e"]["transport"]) == ("auto", "tcp")
        assert peers["node-f"]["transport"] == "native" and peers["node-f"]["address"] is None
        assert api.lists("nodes") == 1 and api.lists("pods") == 0 and api.watches("nodes") == []
        table = run_check(path, "table", capsys)
        assert "node-b " in table and "no peer nodes" not in table
    finally:
        api.stop()


def test_an_api_server_that_cannot_be_reached_is_one_clear_line(tmp_path):
    api = k8s.FakeKubeAPI()
    api.stop()   # its port, now closed
    path = write_k8s_config(tmp_path, api.url)
    with pytest.raises(ConfigError) as e:
        cmd.run(argparse.Namespace(tsor_verb="check", config=path, format="table"))
    assert str(e.value) == (f"{path}: kubernetes: cannot list the Nodes from the API server at {api.url}: "
                            "Connection refused")


def test_port_report_values():
    attr = types.SimpleNamespace(state=5, lid=3, active_mtu=2, link_layer=7)
    assert pv.port_report(1, attr, [(0, GID, "")]) == pv.PortReport(1, "ACTIVE_DEFER", 3, 512, "link layer 7",
                                                                     ((0, GID, ""),), 0)


def test_software_devices_are_named_as_such(tmp_path, monkeypatch):
    """`quark tsor check` says when the "RNIC" is the kernel's software stand-in (rxe, siw): what sysfs
    shows for each (a netdev in `parent`, no bus device; siw's node type is an RNIC)."""
    monkeypatch.setattr(pv, "SYSFS", str(tmp_path))
    for name, node_type, parent in (("rxe0", "1: CA", True), ("siw0", "4: RNIC", True), ("mlx5_0", "1: CA", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "node_type").write_text(node_type + "\n")
        if parent:
            (tmp_path / name / "parent").write_text("eth0\n")
        else:
            (tmp_path / name / "device").mkdir()
    assert [pv.device_kind(n) for n in ("rxe0", "siw0", "mlx5_0")] == [
        "software RoCE (rxe)", "software iWARP (siw)", "hardware"]


def test_check_says_which_pump_rdma_links_get(tmp_path, monkeypatch, capsys):
    """The compiled pump where it is built; the Python one, with the reason, where tsor.yaml asks for
    it or the library is missing or older than its source (what tsord itself decides: pump_for)."""
    from tsor.transport import rdma_pump
    fake_pyverbs(monkeypatch, {})
    monkeypatch.setattr(check, "open_pyverbs", no_device)
    path = write_config(tmp_path, "rdma")
    assert "rdma pump: compiled (tsor/transport/rdma_pump.c)" in run_check(path, "table", capsys).splitlines()
    with open(path, "a") as f:
        f.write("rdma: {pump: python}\n")
    assert json.loads(run_check(path, "json", capsys))["rdma"]["pump"] == \
        {"used": "python", "why": "rdma.pump: python in tsor.yaml"}
    monkeypatch.setattr(rdma_pump, "LIBRARY", str(tmp_path / "missing.so"))
    write_config(tmp_path, "rdma")   # pump: compiled (the default) again, but nothing built
    line = next(x for x in run_check(path, "table", capsys).splitlines() if x.startswith("rdma pump:"))
    assert line == f"rdma pump: python ({tmp_path / 'missing.so'} is not built (make install))"
