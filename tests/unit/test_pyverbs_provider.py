"""The pyverbs provider: its decisions (constants from both pyverbs layouts, QP transition attributes
and masks, GIDs, immediate byte order) without a device; a real write where a device exists."""
from __future__ import annotations

import enum
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest

from tsor.verbs import (
    Access,
    NoDevice,
    QpInfo,
    RecvWr,
    SendWr,
    Sge,
    WcOpcode,
    WcStatus,
    WrOpcode,
)
from tests.support.rdma import device_or_skip
from tsor.verbs import pyverbs_provider as pv

ALL = [(ctype, name) for ctype, names in pv._NEEDED.items() for name in names]
# values no libibverbs constant has, so a result can only have come from the injected module
FAKE = {name: 1 << i for i, (_, name) in enumerate(ALL)}


def new_layout() -> types.ModuleType:
    """PyPI pyverbs (rdma-core 5x): pyverbs.libibverbs_enums, one IntEnum class per C enum."""
    mod = types.ModuleType("pyverbs.libibverbs_enums")
    for ctype in pv._NEEDED:
        setattr(mod, ctype, enum.IntEnum(ctype, {n: FAKE[n] for n in pv._NEEDED[ctype]}))
    return mod


def old_layout() -> types.ModuleType:
    """Debian's python3-pyverbs (rdma-core 44): pyverbs.enums, flat module constants."""
    mod = types.ModuleType("pyverbs.enums")
    for name, value in FAKE.items():
        setattr(mod, name, value + 1)
    return mod


def test_constants_from_the_pypi_layout(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", new_layout())
    monkeypatch.setitem(sys.modules, "pyverbs.enums", old_layout())   # present too, but second choice
    assert pv.constants() == FAKE


def test_constants_from_the_debian_layout(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", None)   # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "pyverbs.enums", old_layout())
    assert pv.constants() == {n: v + 1 for n, v in FAKE.items()}


def test_a_layout_missing_a_constant_is_passed_over(monkeypatch):
    partial = new_layout()
    delattr(partial, "ibv_wr_opcode")
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", partial)
    monkeypatch.setitem(sys.modules, "pyverbs.enums", old_layout())
    assert pv.constants()["IBV_WR_RDMA_WRITE_WITH_IMM"] == FAKE["IBV_WR_RDMA_WRITE_WITH_IMM"] + 1


def test_no_pyverbs_at_all_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.libibverbs_enums", None)
    monkeypatch.setitem(sys.modules, "pyverbs.enums", None)
    with pytest.raises(NoDevice) as e:
        pv.open_device()
    assert str(e.value).startswith("no RDMA device (pyverbs is not usable")


def test_installed_pyverbs_has_libibverbs_values():
    pytest.importorskip("pyverbs", reason="python3-pyverbs not installed")
    c = pv.constants()
    assert (c["IBV_QPS_RTS"], c["IBV_QPS_ERR"], c["IBV_WR_RDMA_WRITE_WITH_IMM"], c["IBV_ACCESS_REMOTE_WRITE"],
            c["IBV_WC_RECV_RDMA_WITH_IMM"], c["IBV_QP_AV"]) == (3, 6, 1, 2, 129, 1 << 7)


def test_init_transition():
    t = pv.init_transition(FAKE, Access.LOCAL_WRITE | Access.REMOTE_WRITE, 2)
    assert t.fields == {"qp_state": FAKE["IBV_QPS_INIT"], "pkey_index": 0, "port_num": 2,
                        "qp_access_flags": FAKE["IBV_ACCESS_LOCAL_WRITE"] | FAKE["IBV_ACCESS_REMOTE_WRITE"]}
    assert t.mask == (FAKE["IBV_QP_STATE"] | FAKE["IBV_QP_PKEY_INDEX"] | FAKE["IBV_QP_PORT"]
                      | FAKE["IBV_QP_ACCESS_FLAGS"])


def test_rtr_transition_over_roce_uses_a_grh():
    gid = bytes(10) + b"\xff\xff" + bytes([10, 99, 0, 2])
    t = pv.rtr_transition(FAKE, QpInfo(qpn=0x1234, psn=0x1ABCDEF, gid=gid, lid=0), 1, 5, 3)
    assert t.fields["dest_qp_num"] == 0x1234
    assert t.fields["rq_psn"] == 0xABCDEF          # PSNs are 24 bits
    assert t.fields["path_mtu"] == 5 and t.fields["qp_state"] == FAKE["IBV_QPS_RTR"]
    assert t.ah["is_global"] == 1 and t.ah["sgid_index"] == 3 and t.gid == gid
    for m in ("STATE", "AV", "PATH_MTU", "DEST_QPN", "RQ_PSN", "MAX_DEST_RD_ATOMIC", "MIN_RNR_TIMER"):
        assert t.mask & FAKE["IBV_QP_" + m], m
    assert not t.mask & FAKE["IBV_QP_SQ_PSN"]


def test_rtr_transition_over_infiniband_routes_by_lid():
    t = pv.rtr_transition(FAKE, QpInfo(qpn=7, psn=1, gid=bytes(16), lid=0x21), 1, 5, 0)
    assert t.ah == {"port_num": 1, "dlid": 0x21, "is_global": 0, "sl": 0} and t.gid is None


def test_rts_and_error_transitions():
    t = pv.rts_transition(FAKE, 0x2000001)
    assert t.fields["sq_psn"] == 1 and t.fields["rnr_retry"] == 7
    assert t.mask == sum(FAKE["IBV_QP_" + m] for m in ("STATE", "SQ_PSN", "TIMEOUT", "RETRY_CNT", "RNR_RETRY",
                                                       "MAX_QP_RD_ATOMIC"))
    e = pv.error_transition(FAKE)
    assert (e.fields, e.mask) == ({"qp_state": FAKE["IBV_QPS_ERR"]}, FAKE["IBV_QP_STATE"])


def test_transition_becomes_a_pyverbs_qp_attr():
    pytest.importorskip("pyverbs", reason="python3-pyverbs not installed")
    c = pv.constants()
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    attr = pv.qp_attr(pv.rtr_transition(c, QpInfo(77, 5, gid, 0), 1, 3, 2))
    assert (attr.qp_state, attr.dest_qp_num, attr.rq_psn, attr.path_mtu) == (c["IBV_QPS_RTR"], 77, 5, 3)
    assert attr.ah_attr.dgid == "0000:0000:0000:0000:0000:ffff:0a00:0001"
    assert (attr.ah_attr.is_global, attr.ah_attr.sgid_index, attr.ah_attr.port_num) == (1, 2, 1)


def test_gid_text_round_trip():
    gid = bytes(range(16))
    assert pv.gid_text(gid) == "0001:0203:0405:0607:0809:0a0b:0c0d:0e0f"
    assert pv.gid_bytes(pv.gid_text(gid)) == gid
    with pytest.raises(ValueError):
        pv.gid_text(b"short")


def test_immediate_data_is_big_endian_on_the_wire():
    assert pv.imm_to_wire(0x80000001).to_bytes(4, sys.byteorder) == b"\x80\x00\x00\x01"
    assert pv.imm_from_wire(pv.imm_to_wire(0x80000007)) == 0x80000007
    assert socket.ntohl(pv.imm_to_wire(5)) == 5


ROCE = [(0, "fe80:0000:0000:0000:9cc1:e3ff:fecd:b827", "IB/RoCE v1"),
        (1, "fe80:0000:0000:0000:9cc1:e3ff:fecd:b827", "RoCE v2"),
        (2, "0000:0000:0000:0000:0000:ffff:0ad3:0001", "IB/RoCE v1"),
        (3, "0000:0000:0000:0000:0000:ffff:0ad3:0001", "RoCE v2")]


def test_default_gid_is_roce_v2_ipv4():
    """A NIC's table: link-local and IPv4 entries, each as RoCE v1 and v2; index 0 would be v1."""
    assert pv.default_gid_index(ROCE) == 3
    assert pv.default_gid_index(ROCE[:2]) == 1                 # no IPv4 address: the first v2 entry
    assert pv.default_gid_index([(0, "fe80:0000:0000:0000:0002:c903:0001:1f01", "")]) == 0   # InfiniBand
    assert pv.default_gid_index([(0, "0000:" * 7 + "0000", "")]) == 0


@pytest.fixture
def device():
    """The host's first RDMA device (`make test-rdma` runs the tests that take it)."""
    dev = device_or_skip()
    yield dev
    dev.close()


@pytest.mark.rdma_device
def test_the_default_gid_is_the_ports_roce_v2_ipv4_entry(device):
    table = pv.gid_table(device.name, device.port_num)
    assert device.gid_index == pv.default_gid_index(table)
    if any(t == pv.ROCE_V2 for _, _, t in table):   # rxe and RoCE NICs (an IB port has no types)
        assert device.port().gid[:12] == bytes(10) + b"\xff\xff", table


@pytest.mark.rdma_device
def test_a_waiting_completion_channel_stops_no_other_thread(device):
    """tsord waits for completions while its other threads (connect set-ups, metrics, routes) go on.
    rdma-core 44's pyverbs holds the GIL inside ibv_get_cq_event, so a channel waited on in it froze
    the whole process: here a second of waiting, in a child so that a freeze fails the test."""
    prog = textwrap.dedent("""
        import select, sys, threading, time
        from tsor.verbs import pyverbs_provider as pv
        dev = pv.open_device(sys.argv[1])
        chan = dev.create_comp_channel()
        cq = dev.create_cq(16, chan)
        cq.req_notify()
        ticks = 0
        def tick():
            global ticks
            while True:
                ticks += 1
                time.sleep(0.001)
        threading.Thread(target=tick, daemon=True).start()
        r, _, _ = select.select([chan], [], [], 1.0)   # nothing completes
        print(ticks, len(r), chan.get_events())
    """)
    try:
        r = subprocess.run([sys.executable, "-c", prog, device.name], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    except subprocess.TimeoutExpired:
        pytest.fail("the process froze while a completion channel was waited on")
    assert r.returncode == 0, r.stderr
    ticks, readable, events = map(int, r.stdout.split())
    assert ticks > 100 and (readable, events) == (0, 0)


@pytest.mark.rdma_device
def test_describe_devices_on_a_device(device):
    """`quark tsor check`'s inventory agrees with the port the transport uses."""
    reports = {d.name: d for d in pv.describe_devices()}
    port, info = reports[device.name].ports[0], device.port()
    assert (port.state == "ACTIVE", port.lid, port.mtu) == (info.active, info.lid, info.mtu)
    assert port.link_layer in ("InfiniBand", "Ethernet")
    assert not any(info.gid) or pv.gid_text(info.gid) in [g for _, g, _ in port.gids]
    assert port.default_gid == device.gid_index
    assert reports[device.name].kind != "hardware" or not device.name.startswith(("rxe", "siw"))


RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE


def qp_pair(dev, cq):
    """A PD and two RC QPs on the device's port, connected to each other (the port loops them back)."""
    pd = dev.alloc_pd()
    a, b = pd.create_qp(cq, cq, 16, 16), pd.create_qp(cq, cq, 16, 16)
    port = dev.port()
    for qp in (a, b):
        qp.to_init(RW)
    a.to_rtr(QpInfo(b.qp_num, 1, port.gid, port.lid))
    b.to_rtr(QpInfo(a.qp_num, 1, port.gid, port.lid))
    a.to_rts(1)
    b.to_rts(1)
    return pd, a, b


@pytest.mark.rdma_device
def test_write_with_imm_on_a_device(device):
    """Two RC QPs on the host's first RDMA port, connected to each other; the completion channel
    wakes the waiter."""
    chan = device.create_comp_channel()
    cq = device.create_cq(64, chan)
    pd, a, b = qp_pair(device, cq)
    src, dst = bytearray(b"rdma!" + bytes(59)), bytearray(64)
    smr, dmr = pd.reg_mr(src, RW), pd.reg_mr(dst, RW)
    b.post_recv(RecvWr(9))
    cq.req_notify()
    a.post_send(SendWr(4, WrOpcode.RDMA_WRITE_WITH_IMM, [Sge(smr.addr, 5, smr.lkey)],
                       remote_addr=dmr.addr, rkey=dmr.rkey, imm_data=0x80000003))
    # the way tsord's loop waits: the channel's fd turns readable, its events are taken without waiting
    assert select.select([chan], [], [], 10)[0] == [chan]
    assert chan.get_events() >= 1 and chan.get_events() == 0
    wcs, deadline = [], time.monotonic() + 5
    while len(wcs) < 2 and time.monotonic() < deadline:
        wcs += cq.poll(2)
    byop = {w.opcode: w for w in wcs}
    assert byop[WcOpcode.RECV_RDMA_WITH_IMM].imm_data == 0x80000003
    assert byop[WcOpcode.RDMA_WRITE].status == WcStatus.SUCCESS
    assert bytes(dst[:5]) == b"rdma!"


@pytest.mark.rdma_device
def test_only_signaled_writes_complete_at_the_requester(device):
    """The transport signals one write in SIGNAL_EVERY (and FINs): the others must cost no
    completion, while the responder gets every write's immediate."""
    cq = device.create_cq(64, None)
    pd, a, b = qp_pair(device, cq)
    buf = bytearray(64)
    mr = pd.reg_mr(buf, RW)
    for i in range(3):
        b.post_recv(RecvWr(100 + i))
    for i in range(3):
        a.post_send(SendWr(i, WrOpcode.RDMA_WRITE_WITH_IMM, [Sge(mr.addr, 1, mr.lkey)], remote_addr=mr.addr + 8 + i,
                           rkey=mr.rkey, imm_data=i, signaled=i == 2))
    wcs, deadline = [], time.monotonic() + 10
    while len(wcs) < 4 and time.monotonic() < deadline:
        wcs += cq.poll(8)
    time.sleep(0.2)
    wcs += cq.poll(8)
    assert sorted(w.imm_data for w in wcs if w.opcode == WcOpcode.RECV_RDMA_WITH_IMM) == [0, 1, 2]
    assert [w.wr_id for w in wcs if w.opcode == WcOpcode.RDMA_WRITE] == [2]
    for o in (a, b, mr, cq, pd):
        o.close()
