"""softverbs: a software RDMA provider, the rdma path's test double. Two devices joined by one TCP or
unix stream ("the cable") carry RC queue pairs' one-sided RDMA writes between two hosts that have no
RNIC: it implements tsor/verbs' interface as the pyverbs provider does, so the host's tests (no RDMA
here) run tsord's rdma transport and transport/rdma.py's engine over it; real verbs are the RDMA
lane's (tests/vm). tsord gets it only through tests/support/softverbs_tsord.py (`transport:
softverbs`); the production package has no software provider.

Each device runs one thread, its "NIC", that reads frames from the stream, checks them as a
responder would (QP state, source QP, PSN, R_Key, bounds, access) and writes the payload into the
target memory region, then answers with an ACK or a NAK. Requesters send from the posting thread
when the stream can take the frame at once, and leave the rest to the NIC thread.

Frame (network order, 36 bytes) then `length` payload bytes:

    u8 type (1 WRITE, 2 WRITE_IMM, 3 SEND, 4 ACK), u8 syndrome (ACKs: 0 ok, 1 RNR, 2 remote access,
    3 invalid request, 4 dropped), u16 flags (requests: bit 0 AckReq), u32 dest qpn, u32 source qpn,
    u32 psn (24 bits), u32 imm, u32 rkey, u32 length, u64 remote address

An ACK for psn P acknowledges every earlier PSN too (responders coalesce them per received batch).
As IB's AckReq bit, the requester asks for an ACK on a signaled request, and on any request once
half its send queue waits for one; the others are acknowledged by a later ACK (an error is NAKed at
once), so a stream of unsignaled writes costs no ACK frame each.
A device's GID is the stream's local address as an IPv4-mapped IPv6 address, like RoCE v2 (zeros
over a unix stream); to_rtr() refuses a remote GID that is not the other end's. Once started, each
side sends b"SOFTVRB1" and its GID; a hello that does not match takes the link down.

The responder reads frames into a staging buffer; a write whose header has passed the checks and
whose payload is still mostly on the way is read straight into the target region (one copy, as an
RNIC's DMA), and completes once all of it is in.

Where it differs from hardware, on purpose: there are no retransmission timers. A frame the
responder drops (QP missing, not ready, or connected elsewhere) is reported back at once, and the
requester fails with RETRY_EXC_ERR instead of after retry_cnt timeouts; RNR is not retried
(rnr_retry = 0). A lost cable fails every QP of the device with RETRY_EXC_ERR.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import logging
import os
import random
import selectors
import socket
import struct
import threading

from tsor.transport.rdma import RingConfig
from tsor.transport.rdma_link import Cabled
from tsor.verbs import (
    Access,
    CompletionChannel,
    CompletionQueue,
    Device,
    MemoryRegion,
    PortInfo,
    ProtectionDomain,
    QpInfo,
    QpState,
    QueuePair,
    RecvWr,
    SendWr,
    VerbsError,
    Wc,
    WcOpcode,
    WcStatus,
    WrOpcode,
)

log = logging.getLogger("tsor.softverbs")
MAGIC = b"SOFTVRB1"
HDR = struct.Struct("!BBHIIIIIIQ")
WRITE, WRITE_IMM, SEND, ACK = 1, 2, 3, 4
OK, NAK_RNR, NAK_ACCESS, NAK_INVALID, NAK_DROPPED = 0, 1, 2, 3, 4
ACKREQ = 1
PSN_MASK = 0xFFFFFF
MAX_MSG = 1 << 20        # the port's max_msg_sz
MTU = 4096
_STAGING = 4 * MAX_MSG   # the NIC's receive buffer: holds any whole frame
_RECV_MAX = 64 * 1024    # bytes per read into it: the bulk of a large write is read straight into its region
DIRECT_MIN = 32 * 1024   # a write whose payload has at least this much still to come is placed directly
_NAK_STATUS = {NAK_RNR: WcStatus.RNR_RETRY_EXC_ERR, NAK_ACCESS: WcStatus.REM_ACCESS_ERR,
               NAK_INVALID: WcStatus.REM_INV_REQ_ERR, NAK_DROPPED: WcStatus.RETRY_EXC_ERR}
_FRAME_OF = {WrOpcode.RDMA_WRITE: WRITE, WrOpcode.RDMA_WRITE_WITH_IMM: WRITE_IMM, WrOpcode.SEND: SEND}
_WC_OF = {WrOpcode.RDMA_WRITE: WcOpcode.RDMA_WRITE, WrOpcode.RDMA_WRITE_WITH_IMM: WcOpcode.RDMA_WRITE,
          WrOpcode.SEND: WcOpcode.SEND}


def _psn_le(a: int, b: int) -> bool:
    """a is at or before b in 24-bit PSN order."""
    return ((b - a) & PSN_MASK) < (1 << 23)


def _gid_of(sock: socket.socket, peer: bool = False) -> bytes:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return b"\0" * 16
    ip = (sock.getpeername() if peer else sock.getsockname())[0]
    if sock.family == socket.AF_INET:
        return b"\0" * 10 + b"\xff\xff" + socket.inet_aton(ip)
    return socket.inet_pton(socket.AF_INET6, ip)


def open_device(link: socket.socket, name: str = "softverbs0", start: bool = True) -> SoftDevice:
    """A device whose port is cabled, through the connected stream `link`, to one other softverbs
    device (which the other host opens over the other end). Takes ownership of `link`.

    start=False: the cable stays the caller's until start(), so QP set-up info can be exchanged
    over it first. Bring the QP to RTR before start(): the peer may write as soon as our hello is
    in, and use the link only once the peer's hello arrived (port().active)."""
    dev = SoftDevice(link, name)
    if start:
        dev.start()
    return dev


class _MR(MemoryRegion):
    def __init__(self, pd: _PD, buf: bytearray | memoryview, access: Access, lkey: int, rkey: int) -> None:
        view = memoryview(buf)
        if view.readonly or not view.c_contiguous:
            raise VerbsError(errno.EINVAL, "reg_mr: buffer must be writable and contiguous")
        self.view = view.cast("B")
        self.length = len(self.view)
        # the buffer's real address, as a device would see it; the ctypes export pins the buffer
        self._pin = (ctypes.c_char * self.length).from_buffer(self.view) if self.length else None
        self.addr = ctypes.addressof(self._pin) if self._pin is not None else 0
        self.pd, self.access, self.lkey, self.rkey = pd, access, lkey, rkey

    def close(self) -> None:
        dev = self.pd.dev
        with dev.lock:
            dev.lkeys.pop(self.lkey, None)
            dev.rkeys.pop(self.rkey, None)
        self._pin = None   # drops the ctypes export first: release() refuses while it lives
        self.view.release()


class _Channel(CompletionChannel):
    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def fileno(self) -> int:
        return self.fd

    def get_events(self) -> int:
        try:
            return os.eventfd_read(self.fd)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _CQ(CompletionQueue):
    def __init__(self, dev: SoftDevice, depth: int, channel: _Channel | None) -> None:
        self.dev, self.depth, self.channel = dev, depth, channel
        self.entries: collections.deque[Wc] = collections.deque()
        self.armed = False
        self.overrun = False

    def push(self, wc: Wc) -> None:
        """Add a completion (device lock held)."""
        if len(self.entries) >= self.depth:
            self.overrun = True   # hardware raises a fatal async event; we fail every later poll
            return
        self.entries.append(wc)
        if self.armed and self.channel is not None:
            self.armed = False
            os.eventfd_write(self.channel.fd, 1)

    def poll(self, n: int) -> list[Wc]:
        with self.dev.lock:
            if self.overrun:
                raise VerbsError(errno.EOVERFLOW, "poll_cq: completion queue overrun")
            q = self.entries
            if len(q) <= n:
                out = list(q)
                q.clear()
                return out
            return [q.popleft() for _ in range(n)]

    def req_notify(self) -> None:
        with self.dev.lock:
            self.armed = True

    def close(self) -> None:
        self.entries.clear()


class _QP(QueuePair):
    def __init__(self, pd: _PD, qpn: int, send_cq: _CQ, recv_cq: _CQ, max_send_wr: int, max_recv_wr: int) -> None:
        self.pd, self.dev, self.qp_num = pd, pd.dev, qpn
        self.send_cq, self.recv_cq = send_cq, recv_cq
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self._state = QpState.RESET
        self.access = Access(0)
        self.remote: QpInfo | None = None
        self.sq_psn = self.epsn = 0
        self.outstanding: collections.deque[tuple[int, SendWr]] = collections.deque()
        self.rq: collections.deque[RecvWr] = collections.deque()

    @property
    def state(self) -> QpState:
        return self._state

    def _move(self, want: QpState, to: QpState) -> None:
        if self._state != want:
            raise VerbsError(errno.EINVAL, f"modify_qp {self._state.name} -> {to.name}: not allowed")
        self._state = to

    def to_init(self, access: Access) -> None:
        with self.dev.lock:
            self._move(QpState.RESET, QpState.INIT)
            self.access = Access(access)

    def to_rtr(self, remote: QpInfo) -> None:
        with self.dev.lock:
            if remote.gid != self.dev.remote_gid:
                raise VerbsError(errno.EHOSTUNREACH,
                                 f"modify_qp RTR: gid {remote.gid.hex()} is not on this port's link")
            self._move(QpState.INIT, QpState.RTR)
            self.remote, self.epsn = remote, remote.psn & PSN_MASK

    def to_rts(self, psn: int) -> None:
        with self.dev.lock:
            self._move(QpState.RTR, QpState.RTS)
            self.sq_psn = psn & PSN_MASK

    def to_error(self) -> None:
        with self.dev.lock:
            self.fail()

    def fail(self, status: WcStatus | None = None) -> None:
        """Into ERR (device lock held): the first outstanding send gets `status`, the rest and
        every posted receive are flushed, in order."""
        if self._state == QpState.ERR:
            return
        self._state = QpState.ERR
        for _, wr in self.outstanding:
            self.send_cq.push(Wc(wr.wr_id, status or WcStatus.WR_FLUSH_ERR, _WC_OF[wr.opcode], qp_num=self.qp_num))
            status = None
        self.outstanding.clear()
        for rwr in self.rq:
            self.recv_cq.push(Wc(rwr.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, qp_num=self.qp_num))
        self.rq.clear()

    def post_recv(self, wr: RecvWr) -> None:
        with self.dev.lock:
            if self._state == QpState.RESET:
                raise VerbsError(errno.EINVAL, "post_recv: QP in RESET")
            if self._state == QpState.ERR:
                self.recv_cq.push(Wc(wr.wr_id, WcStatus.WR_FLUSH_ERR, WcOpcode.RECV, qp_num=self.qp_num))
                return
            if len(self.rq) >= self.max_recv_wr:
                raise VerbsError(errno.ENOMEM, "post_recv: receive queue full")
            self.rq.append(wr)

    def post_send(self, wr: SendWr) -> None:
        dev = self.dev
        with dev.lock:
            if self._state == QpState.ERR:
                self.send_cq.push(Wc(wr.wr_id, WcStatus.WR_FLUSH_ERR, _WC_OF[wr.opcode], qp_num=self.qp_num))
                return
            if self._state != QpState.RTS:
                raise VerbsError(errno.EINVAL, f"post_send: QP in {self._state.name}, not RTS")
            if len(self.outstanding) >= self.max_send_wr:
                raise VerbsError(errno.ENOMEM, "post_send: send queue full")
            payload, total = [], 0
            for sge in wr.sg:
                mr = dev.lkeys.get(sge.lkey)
                off = sge.addr - mr.addr if mr is not None else -1
                if mr is None or mr.pd is not self.pd or off < 0 or off + sge.length > mr.length:
                    return self._local_error(wr, WcStatus.LOC_PROT_ERR)
                if sge.length:
                    payload.append(mr.view[off:off + sge.length])
                total += sge.length
            if total > MAX_MSG:
                return self._local_error(wr, WcStatus.LOC_LEN_ERR)
            psn = self.sq_psn
            self.sq_psn = (psn + 1) & PSN_MASK
            self.outstanding.append((psn, wr))
            ackreq = ACKREQ if wr.signaled or len(self.outstanding) >= self.max_send_wr // 2 else 0
            dev.emit([HDR.pack(_FRAME_OF[wr.opcode], OK, ackreq, self.remote.qpn, self.qp_num, psn,
                               wr.imm_data & 0xFFFFFFFF, wr.rkey, total, wr.remote_addr), *payload])

    def _local_error(self, wr: SendWr, status: WcStatus) -> None:
        self.send_cq.push(Wc(wr.wr_id, status, _WC_OF[wr.opcode], qp_num=self.qp_num))
        self.fail()

    def close(self) -> None:
        with self.dev.lock:
            self.dev.qps.pop(self.qp_num, None)
            self._state = QpState.ERR
            self.outstanding.clear()
            self.rq.clear()


class _PD(ProtectionDomain):
    def __init__(self, dev: SoftDevice) -> None:
        self.dev = dev

    def reg_mr(self, buf: bytearray | memoryview, access: Access) -> MemoryRegion:
        access = Access(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_READ) and not access & Access.LOCAL_WRITE:
            raise VerbsError(errno.EINVAL, "reg_mr: remote write access needs local write access")
        dev = self.dev
        with dev.lock:
            lkey, rkey = dev.new_key(), dev.new_key()
            mr = _MR(self, buf, access, lkey, rkey)
            dev.lkeys[lkey] = mr
            if access & Access.REMOTE_WRITE:
                dev.rkeys[rkey] = mr
        return mr

    def create_qp(self, send_cq: CompletionQueue, recv_cq: CompletionQueue, max_send_wr: int,
                  max_recv_wr: int) -> QueuePair:
        dev = self.dev
        with dev.lock:
            qp = _QP(self, next(dev.qpns) & PSN_MASK, send_cq, recv_cq, max_send_wr, max_recv_wr)
            dev.qps[qp.qp_num] = qp
        return qp

    def close(self) -> None:
        pass


class SoftDevice(Device):
    provider = "softverbs"
    plain_memory = True

    def __init__(self, link: socket.socket, name: str) -> None:
        self.name = name
        self.sock = link
        self.gid, self.remote_gid = _gid_of(link), _gid_of(link, peer=True)
        if link.family in (socket.AF_INET, socket.AF_INET6):
            # ACKs and credits are small frames a requester waits for: Nagle would hold them 40 ms
            link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._hello = threading.Event()        # the other end's hello came in
        self._started = False
        self.lock = threading.Lock()
        self.qps: dict[int, _QP] = {}
        self.lkeys: dict[int, _MR] = {}
        self.rkeys: dict[int, _MR] = {}
        self.qpns = itertools.count(random.randrange(1, 1 << 23))
        self._keys = itertools.count(random.randrange(1, 1 << 31))
        self.out: collections.deque[memoryview | bytes] = collections.deque()
        self.down = False
        self._closing = False
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._staging = bytearray(_STAGING)
        self._lo = self._hi = 0
        self._direct: list | None = None       # [frame fields, region, offset, bytes placed]: a write being read in
        self._acks: dict[_QP, int] = {}
        self._thread = threading.Thread(target=self._run, name=f"softverbs-{name}", daemon=True)

    def start(self) -> None:
        """Say hello on the cable and hand it to the NIC thread."""
        self.sock.settimeout(5.0)
        self.sock.sendall(MAGIC + self.gid)   # into a drained stream: never waits for the other host
        self.sock.setblocking(False)
        with self.lock:
            self._started = True
        self._thread.start()

    def new_key(self) -> int:
        return next(self._keys) & 0xFFFFFFFF or next(self._keys)

    def port(self) -> PortInfo:
        return PortInfo(active=self._hello.is_set() and not self.down, lid=0, gid=self.gid, mtu=MTU,
                        max_msg_size=MAX_MSG)

    def alloc_pd(self) -> ProtectionDomain:
        return _PD(self)

    def create_comp_channel(self) -> CompletionChannel:
        return _Channel()

    def create_cq(self, depth: int, channel: CompletionChannel | None) -> CompletionQueue:
        return _CQ(self, depth, channel)

    # ---- the wire ------------------------------------------------------------------------------
    def emit(self, chunks: list) -> None:
        """Queue a frame (device lock held). With nothing queued before it, try to send it from
        this thread at once: the NIC thread wakes only for what the stream did not take."""
        if self.down:
            return
        was_empty = not self.out
        self.out.extend(chunks)
        if was_empty and self._started and threading.current_thread() is not self._thread:
            self._flush()
            if self.out:
                os.eventfd_write(self._bell, 1)

    def _flush(self) -> None:
        """Send what the stream takes without blocking (device lock held)."""
        out = self.out
        while out:
            try:
                n = self.sock.sendmsg(list(itertools.islice(out, 0, 256)))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._link_down()
            while n:
                first = out[0]
                if len(first) <= n:
                    n -= len(first)
                    out.popleft()
                else:
                    out[0] = memoryview(first)[n:]
                    n = 0

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, None)
        sel.register(self._bell, selectors.EVENT_READ, None)
        writing = False
        try:
            while not self._closing and not self.down:
                with self.lock:
                    want = bool(self.out)
                if want != writing:
                    writing = want
                    sel.modify(self.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0))
                for key, mask in sel.select():
                    if key.fd == self._bell:
                        try:
                            os.eventfd_read(self._bell)
                        except BlockingIOError:
                            pass
                        continue
                    if mask & selectors.EVENT_READ:
                        self._receive()
                    if mask & selectors.EVENT_WRITE:
                        with self.lock:
                            self._flush()
        finally:
            sel.close()

    def _read(self, into: memoryview) -> int | None:
        """What one read from the cable brought: None when nothing was there, 0 when it failed."""
        try:
            return self.sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            log.info("softverbs device %s: link failed: %s", self.name, e)
            return 0

    def _receive(self) -> None:
        if self._direct is not None:
            return self._receive_direct()
        buf = self._staging
        view = memoryview(buf)
        n = self._read(view[self._hi:self._hi + _RECV_MAX])
        if n is None:
            return
        if n == 0:
            with self.lock:
                self._link_down()
            return
        self._hi += n
        lo, hi = self._lo, self._hi
        if not self._hello.is_set():
            if hi - lo < len(MAGIC) + 16:
                return
            if buf[lo:lo + len(MAGIC) + 16] != MAGIC + self.remote_gid:
                log.warning("softverbs device %s: the other end of the link is not a softverbs device with gid %s",
                            self.name, self.remote_gid.hex())
                with self.lock:
                    return self._link_down()
            self._hello.set()
            log.info("softverbs device %s up, gid %s, peer gid %s", self.name, self.gid.hex(), self.remote_gid.hex())
            lo += len(MAGIC) + 16
        with self.lock:
            while hi - lo >= HDR.size:
                fields = HDR.unpack_from(buf, lo)
                if fields[8] > MAX_MSG:
                    log.warning("softverbs device %s: %d-byte frame from the link", self.name, fields[8])
                    return self._link_down()
                end = lo + HDR.size + fields[8]
                if end > hi:
                    if end - hi >= DIRECT_MIN and self._start_direct(fields, view[lo + HDR.size:hi]):
                        lo = hi
                    break
                if fields[0] == ACK:
                    self._acked(fields)
                else:
                    self._respond(fields, view[lo + HDR.size:end])
                lo = end
            self._answer()
        if lo == hi:
            lo = hi = 0
        elif len(buf) - hi < MAX_MSG + HDR.size:
            buf[:hi - lo] = view[lo:hi]
            lo, hi = 0, hi - lo
        self._lo, self._hi = lo, hi

    def _answer(self) -> None:
        """Send the ACKs a batch of requests earned, and what else is queued (device lock held)."""
        for qp, psn in self._acks.items():
            self._ack_frame(qp.remote.qpn, qp.qp_num, psn, OK)
        self._acks.clear()
        if self.out:
            self._flush()

    def _start_direct(self, f: tuple, head: memoryview) -> bool:
        """Read the rest of write `f` straight into its target, if it passes the checks now (device
        lock held); else it waits in the staging buffer and _respond answers it whole."""
        kind, _, _, dqpn, sqpn, psn, _, rkey, length, raddr = f
        qp = self.qps.get(dqpn)
        if (kind not in (WRITE, WRITE_IMM) or qp is None or qp._state not in (QpState.RTR, QpState.RTS)
                or qp.remote.qpn != sqpn or psn != qp.epsn or (kind == WRITE_IMM and not qp.rq)):
            return False
        mr = self.rkeys.get(rkey)
        off = raddr - mr.addr if mr is not None else -1
        if (mr is None or mr.pd is not qp.pd or not qp.access & Access.REMOTE_WRITE
                or off < 0 or off + length > mr.length):
            return False
        mr.view[off:off + len(head)] = head
        self._direct = [f, mr, off, len(head)]
        return True

    def _receive_direct(self) -> None:
        f, mr, off, done = self._direct
        length = f[8]
        with self.lock:
            if self.rkeys.get(f[7]) is mr:
                with mr.view[off + done:off + length] as target:
                    n = self._read(target)
            else:   # deregistered meanwhile: the rest is read and dropped, _respond NAKs the write
                n = self._read(memoryview(self._staging)[:length - done])
            if n is None:
                return
            if n == 0:
                return self._link_down()
            self._direct[3] = done = done + n
            if done == length:
                self._direct = None
                self._respond(f, None)
                self._answer()

    def _ack_frame(self, dqpn: int, sqpn: int, psn: int, syndrome: int) -> None:
        self.out.append(HDR.pack(ACK, syndrome, 0, dqpn, sqpn, psn, 0, 0, 0, 0))

    def _nak(self, qp: _QP | None, dqpn: int, sqpn: int, psn: int, syndrome: int) -> None:
        if qp is not None and qp in self._acks:   # what came before is acknowledged first
            self._ack_frame(dqpn, sqpn, self._acks.pop(qp), OK)
        self._ack_frame(dqpn, sqpn, psn, syndrome)

    def _respond(self, f: tuple, payload: memoryview | None) -> None:
        """A request from the remote requester: check it, carry it out, schedule the ACK. payload
        None: a write already placed in its region (_start_direct), checked here again."""
        kind, _, flags, dqpn, sqpn, psn, imm, rkey, length, raddr = f
        qp = self.qps.get(dqpn)
        if qp is None or qp._state not in (QpState.RTR, QpState.RTS) or qp.remote.qpn != sqpn:
            return self._nak(None, sqpn, dqpn, psn, NAK_DROPPED)
        if psn != qp.epsn:
            return   # after a NAK: the requester is in ERR and this frame is void
        if kind != SEND and length:
            mr = self.rkeys.get(rkey)
            off = raddr - mr.addr if mr is not None else -1
            if (mr is None or mr.pd is not qp.pd or not qp.access & Access.REMOTE_WRITE
                    or off < 0 or off + length > mr.length):
                self._nak(qp, sqpn, dqpn, psn, NAK_ACCESS)
                return qp.fail()
            if payload is not None:
                mr.view[off:off + length] = payload
        if kind != WRITE:
            if not qp.rq:
                return self._nak(qp, sqpn, dqpn, psn, NAK_RNR)
            rwr = qp.rq.popleft()
            if kind == SEND and not self._scatter(qp, rwr, payload):
                qp.recv_cq.push(Wc(rwr.wr_id, WcStatus.LOC_LEN_ERR, WcOpcode.RECV, qp_num=qp.qp_num))
                self._nak(qp, sqpn, dqpn, psn, NAK_INVALID)
                return qp.fail()
            qp.recv_cq.push(Wc(rwr.wr_id, WcStatus.SUCCESS,
                               WcOpcode.RECV if kind == SEND else WcOpcode.RECV_RDMA_WITH_IMM,
                               length, imm, qp.qp_num))
        qp.epsn = (psn + 1) & PSN_MASK
        if flags & ACKREQ:
            self._acks[qp] = psn

    def _scatter(self, qp: _QP, rwr: RecvWr, payload: memoryview) -> bool:
        pos = 0
        for sge in rwr.sg:
            if pos == len(payload):
                break
            mr = self.lkeys.get(sge.lkey)
            off = sge.addr - mr.addr if mr is not None else -1
            if mr is None or mr.pd is not qp.pd or off < 0 or off + sge.length > mr.length:
                return False
            n = min(sge.length, len(payload) - pos)
            mr.view[off:off + n] = payload[pos:pos + n]
            pos += n
        return pos == len(payload)

    def _acked(self, f: tuple) -> None:
        _, syndrome, _, dqpn, _, psn, *_ = f
        qp = self.qps.get(dqpn)
        if qp is None or qp._state == QpState.ERR:
            return
        out = qp.outstanding
        while out and _psn_le(out[0][0], psn):
            wpsn, wr = out[0]
            if wpsn == psn and syndrome != OK:
                return qp.fail(_NAK_STATUS.get(syndrome, WcStatus.REM_INV_REQ_ERR))
            out.popleft()
            if wr.signaled:
                qp.send_cq.push(Wc(wr.wr_id, WcStatus.SUCCESS, _WC_OF[wr.opcode], qp_num=qp.qp_num))

    def _link_down(self) -> None:
        """The cable is gone (device lock held): every QP fails as after exhausted retries."""
        if self.down:
            return
        self.down = True
        self.out.clear()
        log.warning("softverbs device %s: link down", self.name)
        for qp in list(self.qps.values()):
            qp.fail(WcStatus.RETRY_EXC_ERR)

    def close(self) -> None:
        self._closing = True
        try:
            os.eventfd_write(self._bell, 1)
        except OSError:
            pass
        if self._started and threading.current_thread() is not self._thread:
            self._thread.join(5)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        os.close(self._bell)


# A connection's rate is at most a ring per credit round trip (write, delivery to the socket, CREDIT
# back). An RNIC's round trip is microseconds; softverbs' crosses four Python threads, ~0.3 ms here,
# so its links get 2 MiB rings (iperf3 between two namespace nodes: 5.2-6.0 Gb/s with 256 KiB rings,
# 9.8-9.9 with 2 MiB; bench/README.md). Its regions are plain memory, touched only as used and
# given back when a connection ends (transport/rdma.py's Link._release); an RNIC's are pinned.
RING = RingConfig(ring=2 << 20)
# what tsord takes it as (tests/support/softverbs_tsord.py, test_tsor_daemon's in-process tsords)
CABLED = Cabled("softverbs", lambda cable, name: open_device(cable, name, start=False), RING)
