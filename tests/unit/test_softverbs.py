"""softverbs, the software RDMA provider: two devices cabled by a real socketpair or a loopback TCP
connection, carrying RC queue pairs' writes between them as a pair of RNICs would."""
from __future__ import annotations

import contextlib
import errno
import select
import socket
import time

import pytest

from tests.support import softverbs
from tsor.verbs import (
    Access,
    QpInfo,
    QpState,
    RecvWr,
    SendWr,
    Sge,
    VerbsError,
    WcOpcode,
    WcStatus,
    WrOpcode,
)

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE


class End:
    """One host's side: device, PD, completion channel, one CQ, one RC QP, one 64 KiB MR."""

    def __init__(self, link: socket.socket, name: str, depth: int = 64) -> None:
        self.dev = softverbs.open_device(link, name)
        self.pd = self.dev.alloc_pd()
        self.chan = self.dev.create_comp_channel()
        self.cq = self.dev.create_cq(256, self.chan)
        self.qp = self.pd.create_qp(self.cq, self.cq, depth, depth)
        self.buf = bytearray(65536)
        self.mr = self.pd.reg_mr(self.buf, RW)

    def info(self, psn: int) -> QpInfo:
        return QpInfo(self.qp.qp_num, psn, self.dev.port().gid, 0)

    def wait(self, n: int = 1, timeout: float = 5.0) -> list:
        out, deadline = [], time.monotonic() + timeout
        while len(out) < n:
            out += self.cq.poll(n - len(out))
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(out)} of {n} completions: {out}")
            if len(out) < n:
                time.sleep(0.001)
        return out

    def close(self) -> None:
        self.qp.close()
        self.mr.close()
        self.dev.close()
        self.chan.close()


def connect(a: End, b: End) -> None:
    a.qp.to_init(RW)
    b.qp.to_init(RW)
    a.qp.to_rtr(b.info(200))
    b.qp.to_rtr(a.info(100))
    a.qp.to_rts(100)
    b.qp.to_rts(200)


def write(src: End, dst: End, off: int, n: int, imm: int | None = None, rkey: int | None = None,
          wr_id: int = 1, remote: int | None = None) -> None:
    op = WrOpcode.RDMA_WRITE if imm is None else WrOpcode.RDMA_WRITE_WITH_IMM
    src.qp.post_send(SendWr(wr_id, op, [Sge(src.mr.addr + off, n, src.mr.lkey)],
                            remote_addr=dst.mr.addr + off if remote is None else remote,
                            rkey=dst.mr.rkey if rkey is None else rkey, imm_data=imm or 0))


def tcp_link() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        c = socket.create_connection(srv.getsockname())
        s, _ = srv.accept()
    return c, s


@pytest.fixture(params=["unix", "tcp"])
def pair(request):
    links = socket.socketpair() if request.param == "unix" else tcp_link()
    a, b = End(links[0], "sva"), End(links[1], "svb")
    try:
        yield a, b
    finally:
        for e in (a, b):
            with contextlib.suppress(Exception):
                e.close()


@pytest.fixture
def connected(pair):
    connect(*pair)
    return pair


def test_state_machine_goes_reset_init_rtr_rts_only_in_order(pair):
    a, b = pair
    assert a.qp.state == QpState.RESET
    with pytest.raises(VerbsError):
        a.qp.to_rtr(b.info(1))          # RESET -> RTR skips INIT
    with pytest.raises(VerbsError):
        a.qp.post_recv(RecvWr(1))       # nothing may be posted in RESET
    a.qp.to_init(RW)
    with pytest.raises(VerbsError):
        a.qp.to_rts(1)                  # INIT -> RTS skips RTR
    a.qp.post_recv(RecvWr(1))           # receives may be posted from INIT on
    with pytest.raises(VerbsError):
        a.qp.post_send(SendWr(1, WrOpcode.RDMA_WRITE, []))   # sends only in RTS
    a.qp.to_rtr(b.info(1))
    assert a.qp.state == QpState.RTR
    a.qp.to_rts(1)
    assert a.qp.state == QpState.RTS
    with pytest.raises(VerbsError):
        a.qp.to_init(RW)


def test_rtr_refuses_a_gid_that_is_not_on_the_link(pair):
    a, b = pair
    a.qp.to_init(RW)
    with pytest.raises(VerbsError) as e:
        a.qp.to_rtr(QpInfo(b.qp.qp_num, 1, b"\x01" * 16, 0))
    assert e.value.errno == errno.EHOSTUNREACH


def test_write_with_imm_lands_in_remote_memory_and_consumes_a_receive(connected):
    a, b = connected
    a.buf[100:105] = b"hello"
    b.qp.post_recv(RecvWr(77))
    write(a, b, 100, 5, imm=0x80000007, wr_id=5)
    [recv] = b.wait()
    assert (recv.wr_id, recv.status, recv.opcode, recv.byte_len, recv.imm_data) == \
        (77, WcStatus.SUCCESS, WcOpcode.RECV_RDMA_WITH_IMM, 5, 0x80000007)
    assert bytes(b.buf[100:105]) == b"hello"
    [sent] = a.wait()
    assert (sent.wr_id, sent.status, sent.opcode) == (5, WcStatus.SUCCESS, WcOpcode.RDMA_WRITE)


def test_plain_write_needs_no_receive_and_send_scatters_into_one(connected):
    a, b = connected
    a.buf[0:3] = b"abc"
    write(a, b, 0, 3)                       # no imm: one-sided, no receive consumed
    a.wait()
    assert bytes(b.buf[0:3]) == b"abc"
    b.qp.post_recv(RecvWr(9, [Sge(b.mr.addr + 1000, 2, b.mr.lkey), Sge(b.mr.addr + 2000, 8, b.mr.lkey)]))
    a.qp.post_send(SendWr(3, WrOpcode.SEND, [Sge(a.mr.addr, 3, a.mr.lkey)]))
    [recv] = b.wait()
    assert (recv.opcode, recv.byte_len) == (WcOpcode.RECV, 3)
    assert bytes(b.buf[1000:1002]) + bytes(b.buf[2000:2001]) == b"abc"


@pytest.mark.parametrize("case", ["bad rkey", "past the end", "before the start"])
def test_remote_access_is_checked_and_fails_both_qps(connected, case):
    a, b = connected
    b.buf[:16] = b"\xee" * 16
    b.qp.post_recv(RecvWr(1))
    b.qp.post_recv(RecvWr(2))
    if case == "bad rkey":
        write(a, b, 0, 8, imm=1, rkey=b.mr.rkey ^ 0x5a5a)
    elif case == "past the end":
        write(a, b, 0, 8, imm=1, remote=b.mr.addr + len(b.buf) - 4)
    else:
        write(a, b, 0, 8, imm=1, remote=b.mr.addr - 4)
    [wc] = a.wait()
    assert wc.status == WcStatus.REM_ACCESS_ERR
    assert a.qp.state == QpState.ERR
    assert [w.status for w in b.wait(2)] == [WcStatus.WR_FLUSH_ERR] * 2   # responder flushed too
    assert b.qp.state == QpState.ERR
    assert bytes(b.buf[:16]) == b"\xee" * 16


def test_unsignaled_writes_complete_with_the_next_signaled_one_and_still_report_errors(connected):
    """Unsignaled writes ask for no ACK of their own (the next signaled write's covers them), yet a
    remote error on one is reported at once, as hardware does."""
    a, b = connected
    a.buf[:4096] = bytes(range(256)) * 16
    for i in range(20):
        a.qp.post_send(SendWr(i, WrOpcode.RDMA_WRITE, [Sge(a.mr.addr + i * 200, 200, a.mr.lkey)],
                              remote_addr=b.mr.addr + i * 200, rkey=b.mr.rkey, signaled=False))
    write(a, b, 4000, 96, wr_id=99)
    assert [(w.wr_id, w.status) for w in a.wait()] == [(99, WcStatus.SUCCESS)]
    assert bytes(b.buf[:4096]) == bytes(a.buf[:4096])
    time.sleep(0.05)
    assert a.cq.poll(8) == []                          # nothing for the unsignaled ones
    a.qp.post_send(SendWr(7, WrOpcode.RDMA_WRITE, [Sge(a.mr.addr, 8, a.mr.lkey)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey ^ 0x5a5a, signaled=False))
    [wc] = a.wait()
    assert (wc.wr_id, wc.status) == (7, WcStatus.REM_ACCESS_ERR)
    assert a.qp.state == QpState.ERR


def test_rkey_of_a_region_without_remote_write_is_refused(connected):
    a, b = connected
    local_only = b.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    write(a, b, 0, 8, remote=local_only.addr, rkey=local_only.rkey)
    assert a.wait()[0].status == WcStatus.REM_ACCESS_ERR
    local_only.close()


def test_local_sge_outside_its_region_is_a_protection_error(connected):
    a, b = connected
    a.qp.post_send(SendWr(4, WrOpcode.RDMA_WRITE, [Sge(a.mr.addr + len(a.buf) - 2, 8, a.mr.lkey)],
                          remote_addr=b.mr.addr, rkey=b.mr.rkey))
    [wc] = a.wait()
    assert (wc.wr_id, wc.status) == (4, WcStatus.LOC_PROT_ERR)
    assert a.qp.state == QpState.ERR


def test_remote_write_access_needs_local_write():
    a, b = socket.socketpair()
    dev = softverbs.open_device(a, "x")
    other = softverbs.open_device(b, "y")
    try:
        with pytest.raises(VerbsError):
            dev.alloc_pd().reg_mr(bytearray(8), Access.REMOTE_WRITE)
        with pytest.raises(VerbsError):
            dev.alloc_pd().reg_mr(b"read-only", Access.LOCAL_WRITE)
    finally:
        dev.close()
        other.close()


def test_write_with_imm_without_a_posted_receive_is_rnr(connected):
    a, b = connected
    write(a, b, 0, 4, imm=3, wr_id=1)
    write(a, b, 4, 4, imm=4, wr_id=2)       # behind the RNR'd one: flushed, never executed
    wcs = a.wait(2)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WcStatus.RNR_RETRY_EXC_ERR), (2, WcStatus.WR_FLUSH_ERR)]
    assert a.qp.state == QpState.ERR
    assert b.qp.state == QpState.RTS        # the responder is not at fault
    b.qp.post_recv(RecvWr(5))
    time.sleep(0.05)
    assert b.cq.poll(4) == []               # the void write behind the NAK consumed nothing


def test_error_state_flushes_outstanding_and_later_work_requests(connected):
    a, b = connected
    for i in range(3):
        a.qp.post_recv(RecvWr(10 + i))
    a.qp.to_error()
    assert [(w.wr_id, w.status, w.opcode) for w in a.wait(3)] == \
        [(10 + i, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV) for i in range(3)]
    write(a, b, 0, 4, imm=1, wr_id=20)      # posted to a QP in ERR: flushed at once
    a.qp.post_recv(RecvWr(21))
    assert [(w.wr_id, w.status) for w in a.wait(2)] == [(20, WcStatus.WR_FLUSH_ERR), (21, WcStatus.WR_FLUSH_ERR)]
    # the remote QP, still in RTS, learns on its next write: nobody answers for the dead QP
    write(b, a, 0, 4, wr_id=30)
    assert b.wait()[0].status == WcStatus.RETRY_EXC_ERR
    assert b.qp.state == QpState.ERR


def test_send_queue_depth_is_enforced(pair):
    a, b = pair[0], pair[1]
    small = a.pd.create_qp(a.cq, a.cq, 2, 2)
    peer = b.pd.create_qp(b.cq, b.cq, 8, 8)
    small.to_init(RW)
    peer.to_init(RW)
    small.to_rtr(QpInfo(peer.qp_num, 0, b.dev.port().gid, 0))
    peer.to_rtr(QpInfo(small.qp_num, 0, a.dev.port().gid, 0))
    small.to_rts(0)
    peer.to_rts(0)
    small.post_recv(RecvWr(1))
    small.post_recv(RecvWr(2))
    with pytest.raises(VerbsError) as e:
        small.post_recv(RecvWr(3))
    assert e.value.errno == errno.ENOMEM


def test_completion_channel_fd_is_readable_only_when_armed(connected):
    a, b = connected
    fd = b.chan.fileno()
    b.qp.post_recv(RecvWr(1))
    b.qp.post_recv(RecvWr(2))
    write(a, b, 0, 1, imm=1)
    b.wait()                                              # not armed: no event
    assert select.select([fd], [], [], 0.1)[0] == []
    b.cq.req_notify()
    write(a, b, 0, 1, imm=2)
    assert select.select([fd], [], [], 5)[0] == [fd]
    assert b.chan.get_events() == 1
    assert select.select([fd], [], [], 0)[0] == []        # consumed; one event per arming
    assert b.cq.poll(8)[0].imm_data == 2


def test_lost_link_fails_the_qps_and_flushes_their_work(connected):
    a, b = connected
    a.qp.post_recv(RecvWr(41))
    b.dev.close()                                         # the other host goes away
    deadline = time.monotonic() + 5
    while not a.dev.down and time.monotonic() < deadline:
        time.sleep(0.01)
    with a.dev.lock:   # the device marks itself down, then fails its QPs, under its lock
        pass
    assert a.dev.down and not a.dev.port().active
    assert a.qp.state == QpState.ERR
    assert [(w.wr_id, w.status) for w in a.wait()] == [(41, WcStatus.WR_FLUSH_ERR)]


def test_many_writes_in_flight_arrive_in_order(connected):
    a, b = connected
    a.buf[:] = bytes(range(256)) * 256
    for i in range(64):
        b.qp.post_recv(RecvWr(i))
    for i in range(64):
        write(a, b, i * 1024, 1024, imm=i, wr_id=i)
    recvs = b.wait(64)
    assert [w.imm_data for w in recvs] == list(range(64))
    assert [w.status for w in a.wait(64)] == [WcStatus.SUCCESS] * 64
    assert b.buf == a.buf


def test_large_writes_between_small_ones_arrive_whole_and_in_order(connected):
    """Writes of up to max_msg_sz (read straight into the target region once their header is in)
    interleaved with small ones: every byte where it belongs, completions in posting order."""
    a, b = connected
    size = softverbs.MAX_MSG
    src, dst = bytearray(2 * size), bytearray(2 * size)
    src[:] = (bytes(range(251)) * (len(src) // 251 + 1))[:len(src)]
    smr, dmr = a.pd.reg_mr(src, RW), b.pd.reg_mr(dst, RW)
    try:
        plan = [(0, size), (size, 100), (size + 100, 300_000), (size + 300_100, 7), (size + 300_107, 700_000)]
        for i in range(len(plan)):
            b.qp.post_recv(RecvWr(i))
        for i, (off, n) in enumerate(plan):
            a.qp.post_send(SendWr(i, WrOpcode.RDMA_WRITE_WITH_IMM, [Sge(smr.addr + off, n, smr.lkey)],
                                  remote_addr=dmr.addr + off, rkey=dmr.rkey, imm_data=i))
        recvs = b.wait(len(plan), timeout=20)
        assert [(w.imm_data, w.byte_len, w.status) for w in recvs] == \
            [(i, n, WcStatus.SUCCESS) for i, (_, n) in enumerate(plan)]
        assert [w.status for w in a.wait(len(plan), timeout=20)] == [WcStatus.SUCCESS] * len(plan)
        end = plan[-1][0] + plan[-1][1]
        assert dst[:end] == src[:end]
    finally:
        smr.close()
        dmr.close()


def test_set_up_info_travels_on_the_cable_before_start():
    """How two tsords use it: QP numbers over the raw stream, RTR, then start (the hello)."""
    ca, cb = tcp_link()
    a, b = End.__new__(End), End.__new__(End)
    for end, link, name in ((a, ca, "pre-a"), (b, cb, "pre-b")):
        end.dev = softverbs.open_device(link, name, start=False)
        end.pd = end.dev.alloc_pd()
        end.chan = end.dev.create_comp_channel()
        end.cq = end.dev.create_cq(64, end.chan)
        end.qp = end.pd.create_qp(end.cq, end.cq, 8, 8)
        end.buf = bytearray(4096)
        end.mr = end.pd.reg_mr(end.buf, RW)
    try:
        ca.sendall(a.qp.qp_num.to_bytes(4, "big"))
        cb.sendall(b.qp.qp_num.to_bytes(4, "big"))
        qpn_of_b, qpn_of_a = int.from_bytes(ca.recv(4), "big"), int.from_bytes(cb.recv(4), "big")
        assert not a.dev.port().active      # no hello yet
        for end, qpn in ((a, qpn_of_b), (b, qpn_of_a)):
            end.qp.to_init(RW)
            peer = b if end is a else a
            end.qp.to_rtr(QpInfo(qpn, 7, peer.dev.port().gid, 0))
            end.qp.to_rts(7)
        b.qp.post_recv(RecvWr(1))
        a.buf[:4] = b"ping"
        write(a, b, 0, 4, imm=1)            # posted before start: waits behind the hello
        a.dev.start()
        b.dev.start()
        assert b.wait()[0].imm_data == 1 and bytes(b.buf[:4]) == b"ping"
        deadline = time.monotonic() + 5
        while not (a.dev.port().active and b.dev.port().active) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.dev.port().active and b.dev.port().active   # each got the other's hello
    finally:
        for e in (a, b):
            e.close()


def test_a_hello_from_something_else_takes_the_link_down():
    ca, cb = socket.socketpair()
    dev = softverbs.open_device(ca, "lonely")
    try:
        cb.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 5
        while not dev.down and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dev.down and not dev.port().active
    finally:
        dev.close()
        cb.close()


def test_a_tcp_cable_sends_small_frames_at_once():
    """ACKs and the transport's credits are tiny frames a requester waits for: no Nagle delay."""
    ca, cb = tcp_link()
    a, b = softverbs.open_device(ca, "nd-a"), softverbs.open_device(cb, "nd-b")
    try:
        assert a.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert b.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        a.close()
        b.close()
