"""The rdma transport: TCP connections between two nodes carried over one RC queue pair.

Per node pair one Link: an RC QP and two registered regions of `slots` rings of `ring` bytes, the
receive rings (the peer writes into them) and the send rings (we stage into them). A connection is a
channel: slot s (1..slots-1) in both nodes' regions; slot 0 is the control channel. The node whose
set-up info sorts first opens odd slots, the other even ones, so both can open at once.

Data: bytes the application writes are read (recv_into) straight into our send ring at offset
`sent % ring` and moved with one RDMA_WRITE_WITH_IMM to the same offset of the peer's receive ring;
imm = slot, bit 31 = FIN (a zero-length write with FIN is the application's shutdown(SHUT_WR)). RC
delivers in order, so the receiver knows where each write landed from byte_len alone. The sender may
have at most `ring` unconsumed bytes out: the receiver reports its consumed total (a CREDIT on the
control channel) once more than half a ring has been consumed since its last report.

Every write with immediate consumes one receive WR at the peer. Receive WRs are reposted as their
completions are polled, and their count is flow-controlled too: the sender spends the peer's
reported posted total, the receiver reports it (CTL_CREDIT, with the control ring's consumed total)
once more than half its queue was reposted since the last report. Data keeps RESERVE_WRS WRs in
hand and ordinary control messages three, so the reports that unblock the other side always go out.

Control channel records, a byte stream in slot 0: `!BHHIIH` type, slot, gen, v1, v2, payload length,
then the payload. OPEN (JSON {src, dst}), ACCEPT, REFUSE, CREDIT (v1 = consumed total mod 2^32),
RESET, RESET_ACK, CTL_CREDIT (v1 = control ring consumed, v2 = receive WRs posted, totals mod 2^32),
RELEASE. `gen` (per slot, set by the opener) keeps a late record from touching the slot's next
connection. The opener uses a slot again only after the acceptor's RELEASE for it: the acceptor may
still be handing the last bytes of the old connection to a slow reader when the opener is done.

A channel ends when both FINs are through and its writes completed, or by RESET (the application's
socket failed: ECONNRESET, EPIPE); a RESET is answered with RESET_ACK, after which the peer writes
nothing more into that slot. A QP error resets every channel of the link (their sockets are closed
abruptly) and marks the link down; the owner then builds a new Link, with a new set-up exchange.
AF_UNIX has no RST: an application whose end is closed that way reads ECONNRESET if it had data
queued toward the pump (a writer always does: EPIPE), else end-of-file.

Only FINs and every SIGNAL_EVERY-th write ask for a completion (each retires all the writes
before it): the requester's thread is woken for a sixteenth of the writes, and control records
(OPEN, ACCEPT, RELEASE: nothing waits for their completion, their ring space comes back with the
peer's CTL_CREDIT) cost the requester no ACK and no wake-up of their own.

An acceptor may have the listener's side write GREETING on the application's end before anything
else (what tsord's supervisors do on the tcp path): the pump then sends ACCEPT as soon as that byte
is in, without waiting for the listener's answer to travel back through tsord.

A peer that breaks the protocol (a control record out of range or unknown, a write that lands past
the ring or credit it was given, an immediate naming no slot) or that stops granting link credits
(receive WRs, control ring) for STALL_SECONDS while this side has something to send gets its link
reset: every channel of the link is aborted (the applications read ECONNRESET), the reset is
counted by reason (RdmaEngine.resets: tsor_rdma_link_resets_total), and the next connection builds a
new link; the engine's other links go on. What a peer can make this side hold is bounded: a control
record's payload (MAX_CTL_PAYLOAD), the queued control records (MAX_CTL_QUEUED), the rings. Where a
write lands is the writer's choice (one MR, one rkey for the whole receive region): the receiver
checks its length against the ring's end and the credit it gave, but a peer could write into any
slot's ring; peers are tsords that proved the cluster secret, and per-slot memory windows would be
what keeps one from another's bytes.

Everything runs in one event loop thread (RdmaEngine): the completion channel's fd and the
application sockets' ends are its file descriptors; other threads reach it through RdmaEngine.call,
or hold the loop's lock (RdmaEngine.open posts a connection's OPEN from the caller's thread).
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import mmap
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from qlib.eventloop import Loop
from tsor.addr import Endpoint
from tsor.errors import ProtocolError
from tsor.verbs import (
    Access,
    Device,
    QpInfo,
    RecvWr,
    SendWr,
    Sge,
    VerbsError,
    WcOpcode,
    WcStatus,
    WrOpcode,
)

log = logging.getLogger("tsor.rdma")
FIN = 1 << 31
_CTL = struct.Struct("!BHHIIH")
OPEN, ACCEPT, REFUSE, CREDIT, RESET, RESET_ACK, CTL_CREDIT, RELEASE = range(1, 9)
RESERVE_WRS = 4
RESERVE_BYTES = 4 * _CTL.size
MAX_WRITE = 1024 * 1024     # bytes per RDMA write (at most the port's max_msg_sz): a batch of what the socket had
CQ_BATCH = 64
SIGNAL_EVERY = 16
MAX_CTL_PAYLOAD = 4096      # an OPEN's JSON is ~100 bytes
MAX_CTL_QUEUED = 4096       # control records waiting for link credits: more is a peer that grants none
STALL_SECONDS = 10.0        # link credits withheld this long while we have something to send: reset
STALL_CHECK = 1.0           # how often the engine looks
# why a link was reset (RdmaEngine.resets, tsor_rdma_link_resets_total{reason})
PEER_PROTOCOL, PEER_STALLED, VERBS = "protocol", "stalled", "verbs"
_M32 = 0xFFFFFFFF
PUMP_SNDBUF = 1 << 20
# channel states
OPENING, ACCEPTING, OPEN_, CLOSING = range(4)

# accept(link, src, dst, app_end, answer): a peer opened a connection to dst. Called in the loop
# thread; must not block. Call answer(True) once a listener took app_end (ownership passes with the
# call), answer(False) to refuse; answer may be called from any thread. It returns True when the
# listener's side writes GREETING on app_end before anything else once it took it: that byte then
# accepts (and end of file refuses) without waiting for answer().
Accept = Callable[["Link", Endpoint, Endpoint, socket.socket, Callable[[bool], None]], bool | None]
GREETING = b"\x01"


@dataclass(frozen=True)
class RingConfig:
    ring: int = 256 * 1024    # bytes per ring: what one connection may have in flight (smaller: a lower rate)
    slots: int = 256          # channels per link, slot 0 included: 127 connections each way
    sq_depth: int = 256
    rq_depth: int = 512



@dataclass(frozen=True)
class SetupInfo:
    """What each node sends the other to connect a Link (over the authenticated tsord connection)."""
    qpn: int
    psn: int
    gid: str       # hex
    lid: int
    addr: int      # the receive rings' region
    rkey: int
    ring: int
    slots: int
    rq_depth: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> SetupInfo:
        if not isinstance(d, dict) or set(d) != {f for f in cls.__dataclass_fields__}:
            raise ProtocolError(f"rdma set-up info: expected the fields {sorted(cls.__dataclass_fields__)}")
        ints = {k: v for k, v in d.items() if k != "gid"}
        if not all(isinstance(v, int) and v >= 0 for v in ints.values()) or not isinstance(d["gid"], str):
            raise ProtocolError("rdma set-up info: non-negative integers and a hex gid expected")
        try:
            if len(bytes.fromhex(d["gid"])) != 16:
                raise ValueError
        except ValueError:
            raise ProtocolError(f"rdma set-up info: bad gid {d['gid']!r}") from None
        return cls(**d)


def slot_parity(mine: SetupInfo, cfg: RingConfig, remote: SetupInfo) -> int:
    """Which slots this side opens (1: odd) on a link to `remote`: the side whose set-up info sorts
    first opens odd ones. ProtocolError when the peer's rings differ from ours or it sent our own QP."""
    if (remote.ring, remote.slots) != (cfg.ring, cfg.slots):
        raise ProtocolError(f"peer rings {remote.slots}x{remote.ring} B, ours {cfg.slots}x{cfg.ring} B: "
                            "both nodes need the same ring size and slot count")
    ours, theirs = (mine.gid, mine.qpn, mine.psn), (remote.gid, remote.qpn, remote.psn)
    if ours == theirs:
        raise ProtocolError("rdma set-up: the peer sent our own QP")
    return 1 if ours < theirs else 0


def _advance(total: int, reported: int) -> int:
    """A running total the peer reports modulo 2^32 (`reported`), carried on from ours (`total`)."""
    return total + ((reported - total) & _M32)


def _socketpair() -> tuple[socket.socket, socket.socket]:
    """A new connection's two AF_UNIX ends: the pump's (non-blocking) and the application's. The
    pump's end gets the send buffer the local path gives applications' ends: with AF_UNIX's default
    (~208 KiB, writable again only below a quarter) the pump stalls on a reader, and credits wait."""
    ours, app = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    ours.setblocking(False)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PUMP_SNDBUF)
    return ours, app


class Channel:
    """One connection: its slot, our end of the application's socketpair, the ring counters."""

    def __init__(self, link: Link, slot: int, gen: int, sock: socket.socket, app: socket.socket | None,
                 src: Endpoint, dst: Endpoint, state: int) -> None:
        self.link, self.slot, self.gen, self.sock, self.app = link, slot, gen, sock, app
        self.src, self.dst, self.state = src, dst, state
        self.base = slot * link.cfg.ring
        self.tx_sent = self.tx_acked = 0           # bytes written to the peer / consumed by it
        self.rx_tail = self.rx_head = self.rx_credited = 0   # received / given to the socket / reported
        self.fin_tx = self.fin_rx = self.shut = False
        self.reset_pending = False                  # our RESET is not acknowledged yet
        self.inflight = 0                           # our writes not completed yet
        self.reading = self.writing = self.blocked = False
        self.greeting = False                       # accepting: the listener's GREETING decides, not its answer
        self.future: concurrent.futures.Future | None = None


class Link:
    """One RC QP to one peer node and its channels. Lives in the engine's loop thread."""

    def __init__(self, engine: RdmaEngine, name: str, device: Device, cfg: RingConfig | None = None) -> None:
        self.engine, self.name, self.device, self.cfg = engine, name, device, cfg or engine.cfg
        cfg = self.cfg
        self.loop = engine.loop
        self.pd = device.alloc_pd()
        self.chan = device.create_comp_channel()
        self.cq = device.create_cq(cfg.sq_depth + cfg.rq_depth + 64, self.chan)
        self.qp = self.pd.create_qp(self.cq, self.cq, cfg.sq_depth, cfg.rq_depth)
        size = cfg.ring * cfg.slots
        self._rx_mem, self._tx_mem = mmap.mmap(-1, size), mmap.mmap(-1, size)   # pages only as touched
        self.rx_mr = self.pd.reg_mr(self._rx_mem, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.tx_mr = self.pd.reg_mr(self._tx_mem, Access.LOCAL_WRITE)
        self.rx, self.tx = self.rx_mr.view, self.tx_mr.view
        self.qp.to_init(Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        for _ in range(cfg.rq_depth):
            self.qp.post_recv(RecvWr(0))
        port = device.port()
        self.max_write = min(MAX_WRITE, port.max_msg_size)
        # a software device's regions are ordinary memory: a finished channel's ring pages can go back
        self._release_pages = device.plain_memory and cfg.ring % mmap.PAGESIZE == 0
        self.info = SetupInfo(self.qp.qp_num, random.randrange(1 << 24), port.gid.hex(), port.lid,
                              self.rx_mr.addr, self.rx_mr.rkey, cfg.ring, cfg.slots, cfg.rq_depth)
        self.remote: SetupInfo | None = None
        self.up = False
        self.closed = False
        self.channels: dict[int, Channel] = {}
        self.gens = [0] * cfg.slots
        self.unreleased: set[int] = set()    # our slots whose last connection the peer still holds
        self._cursor = 0
        self.wrs: collections.deque[tuple[int, Channel | None]] = collections.deque()   # posted, in order
        self._wr_ids = itertools.count(1)
        self.sq_used = 0
        self.imm_sent = 0
        self.peer_rq_total = 0
        self.rq_posted = self.rq_reported = cfg.rq_depth
        self.ctl_sent = self.ctl_acked = 0          # our control stream / what the peer consumed
        self.ctl_rx = self.ctl_reported = 0         # the peer's control stream consumed here / reported
        self.ctl_in = bytearray()
        self.ctl_out: collections.deque[bytes] = collections.deque()
        self.credit_due: dict[int, Channel] = {}
        self.blocked: dict[int, Channel] = {}
        self.starved_since: float | None = None
        engine.links.add(self)

    @property
    def connections(self) -> int:
        return len(self.channels)

    # ---- set-up --------------------------------------------------------------------------------
    def connect(self, remote: SetupInfo) -> None:
        """Connect the QP to the peer's. Open connections only once the peer has connected too (the
        set-up exchange ends with its acknowledgment): a write reaching a QP not yet in RTR is
        dropped, and the tests' softverbs fails the requester at once where an RNIC would retry a while."""
        parity = slot_parity(self.info, self.cfg, remote)
        self.qp.to_rtr(QpInfo(remote.qpn, remote.psn, bytes.fromhex(remote.gid), remote.lid))
        self.qp.to_rts(self.info.psn)
        self.remote, self.parity = remote, parity
        self.peer_rq_total = remote.rq_depth
        self.up = True
        self.loop.add_reader(self.chan.fileno(), self._on_cq)
        self.cq.req_notify()
        log.info("rdma link %s up over %s (%s): qpn %d -> %d", self.name, self.device.name, self.device.provider,
                 self.info.qpn, remote.qpn)

    # ---- opening connections -------------------------------------------------------------------
    def open(self, src: Endpoint, dst: Endpoint) -> concurrent.futures.Future | None:
        """Ask the peer for a connection; the future gets the application's end, or None. (In the
        loop thread, or with the loop's lock held.)"""
        slot = self._free_slot() if self.up else None
        if slot is None:
            return None
        self.gens[slot] = gen = (self.gens[slot] + 1) & 0xFFFF
        ours, app = _socketpair()
        ch = Channel(self, slot, gen, ours, app, src, dst, OPENING)
        ch.future = concurrent.futures.Future()
        self.channels[slot] = ch
        self.unreleased.add(slot)
        self._ctl(OPEN, slot, gen, payload=json.dumps({"src": list(src), "dst": list(dst)}).encode())
        self._flush_ctl()
        return ch.future

    def cancel(self, fut: concurrent.futures.Future) -> None:
        """The opener gave up waiting: reset the channel if it is still opening."""
        for ch in list(self.channels.values()):
            if ch.future is fut and ch.state == OPENING:
                ch.future = None
                self._reset(ch)
                self._flush_ctl()

    def _free_slot(self) -> int | None:
        n = self.cfg.slots
        for i in range(n):
            s = (self._cursor + i) % n
            if s and s % 2 == self.parity and s not in self.channels and s not in self.unreleased:
                self._cursor = s + 1
                return s
        return None

    def _answer(self, ch: Channel, ok: bool) -> None:
        if self.channels.get(ch.slot) is not ch or ch.state != ACCEPTING or (ok and ch.greeting):
            return   # a listener that took it wrote GREETING first: _greeted reads it out of the stream
        if ok:
            ch.state = OPEN_
            self._ctl(ACCEPT, ch.slot, ch.gen)
            self._update(ch)
        else:
            self._close_sock(ch)
            del self.channels[ch.slot]
            self._ctl(REFUSE, ch.slot, ch.gen)   # a REFUSE releases the slot too
        self._flush_ctl()

    # ---- posting -------------------------------------------------------------------------------
    def _budget(self) -> int:
        """Writes with immediate we may still post: the peer's receive WRs and our send queue."""
        return min(self.peer_rq_total - self.imm_sent, self.cfg.sq_depth - self.sq_used)

    def _post(self, ch: Channel | None, off: int, n: int, imm: int) -> None:
        """A write with immediate of n bytes at `off` in the send region to the same offset of the
        peer's receive region."""
        wr_id = next(self._wr_ids)
        self.wrs.append((wr_id, ch))
        sg = [Sge(self.tx_mr.addr + off, n, self.tx_mr.lkey)] if n else []
        # a completion retires every write before it: FINs (whose completion frees a slot) and every
        # SIGNAL_EVERY-th write ask for one, the rest (control records included) spare the wake-up
        signaled = imm & FIN or wr_id % SIGNAL_EVERY == 0
        self.qp.post_send(SendWr(wr_id, WrOpcode.RDMA_WRITE_WITH_IMM, sg, remote_addr=self.remote.addr + off,
                                 rkey=self.remote.rkey, imm_data=imm, signaled=bool(signaled)))
        self.sq_used += 1
        self.imm_sent += 1
        if ch is not None:
            ch.inflight += 1

    # ---- the pump: application socket -> ring ----------------------------------------------------
    def _readable(self, ch: Channel) -> None:
        ring = self.cfg.ring
        for _ in range(4):   # a few batches, then let the other channels have their turn
            free = ring - (ch.tx_sent - ch.tx_acked)
            if free <= 0 or self._budget() <= RESERVE_WRS:
                break
            off = ch.tx_sent % ring
            n = min(free, ring - off, self.max_write)
            pos = ch.base + off
            try:
                got = ch.sock.recv_into(self.tx[pos:pos + n])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return self._reset(ch)
            if got == 0:
                ch.fin_tx = True
                self._post(ch, pos, 0, ch.slot | FIN)
                break
            self._post(ch, pos, got, ch.slot)
            ch.tx_sent += got
            self.engine.bytes_sent += got
            if got < n:
                break
        self._update(ch)

    # ---- the pump: ring -> application socket ----------------------------------------------------
    def _deliver(self, ch: Channel) -> None:
        ring = self.cfg.ring
        while ch.rx_head < ch.rx_tail:
            off = ch.rx_head % ring
            n = min(ch.rx_tail - ch.rx_head, ring - off)
            pos = ch.base + off
            try:
                sent = ch.sock.send(self.rx[pos:pos + n])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return self._reset(ch)
            ch.rx_head += sent
            self.engine.bytes_received += sent
            if sent < n:
                break
        if ch.rx_head - ch.rx_credited > ring // 2 and not ch.fin_rx:
            self.credit_due[ch.slot] = ch
        if ch.fin_rx and ch.rx_head == ch.rx_tail and not ch.shut:
            ch.shut = True
            try:
                ch.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self._update(ch)

    def _update(self, ch: Channel) -> None:
        """Register for what the channel waits for now; free its slot once it is done."""
        if ch.state == OPEN_ and ch.rx_head == ch.rx_tail and ch.fin_rx and ch.fin_tx and ch.inflight == 0:
            self._close_sock(ch)
            del self.channels[ch.slot]
            self._release(ch)
            return
        if ch.state == CLOSING:
            if not ch.reset_pending and ch.inflight == 0 and self.channels.get(ch.slot) is ch:
                del self.channels[ch.slot]
                self._release(ch)
            return
        fd = ch.sock.fileno()
        can_read = ch.state == OPEN_ and not ch.fin_tx and ch.tx_sent - ch.tx_acked < self.cfg.ring
        want_read = can_read and self._budget() > RESERVE_WRS
        if can_read and not want_read:
            self.blocked[ch.slot] = ch   # until completions or the peer's report give WRs back
        if want_read != ch.reading:
            ch.reading = want_read
            if want_read:
                self.loop.add_reader(fd, lambda: self._on_socket(self._readable, ch))
            else:
                self.loop.remove_reader(fd)
        want_write = ch.state == OPEN_ and ch.rx_head < ch.rx_tail
        if want_write != ch.writing:
            ch.writing = want_write
            if want_write:
                self.loop.add_writer(fd, lambda: self._on_socket(self._deliver, ch))
            else:
                self.loop.remove_writer(fd)

    def _release(self, ch: Channel) -> None:
        """The channel is over here: tell the opener it may use the slot again (if it was the
        peer's), and give its ring pages back. Only once nothing can touch them: both FINs or the
        RESET handshake are through (the peer writes no more into our ring), our writes completed
        (the device has sent what they read from our ring) and our application has every byte."""
        if ch.slot % 2 != self.parity:
            self._ctl(RELEASE, ch.slot, ch.gen)
        if self._release_pages and (ch.tx_sent or ch.rx_tail):
            self._tx_mem.madvise(mmap.MADV_REMOVE, ch.base, self.cfg.ring)
            self._rx_mem.madvise(mmap.MADV_REMOVE, ch.base, self.cfg.ring)

    def _on_socket(self, handler: Callable[[Channel], None], ch: Channel) -> None:
        try:
            handler(ch)
            self._flush_ctl()
        except VerbsError as e:
            self._down(f"post failed: {e}")

    def _starved(self) -> bool:
        """Something waits to be sent that only the peer's link credits can let out."""
        if not (self.ctl_out or self.credit_due or self.blocked):
            return False
        ctl_room = self.cfg.ring - (self.ctl_sent - self.ctl_acked) - RESERVE_BYTES
        return self._budget() <= RESERVE_WRS or (bool(self.ctl_out) and len(self.ctl_out[0]) > ctl_room)

    def check_stall(self, now: float) -> None:
        if not self.up or not self._starved():
            self.starved_since = None
        elif self.starved_since is None:
            self.starved_since = now
        elif now - self.starved_since >= STALL_SECONDS:
            self._down(f"the peer granted no link credits for {now - self.starved_since:.0f} s", PEER_STALLED)

    def _unblock(self) -> None:
        if self.blocked and self._budget() > RESERVE_WRS:
            blocked, self.blocked = self.blocked, {}
            for ch in blocked.values():
                if self.channels.get(ch.slot) is ch:
                    self._update(ch)

    # ---- ending channels -----------------------------------------------------------------------
    def _close_sock(self, ch: Channel) -> None:
        if ch.sock.fileno() < 0:
            return
        if ch.reading:
            self.loop.remove_reader(ch.sock.fileno())
        if ch.writing:
            self.loop.remove_writer(ch.sock.fileno())
        ch.reading = ch.writing = False
        ch.sock.close()
        if ch.app is not None:
            ch.app.close()
            ch.app = None

    def _abort(self, ch: Channel) -> None:
        if ch.future is not None and not ch.future.done():
            ch.future.set_result(None)
        self._close_sock(ch)
        ch.state = CLOSING
        self.credit_due.pop(ch.slot, None)

    def _reset(self, ch: Channel) -> None:
        """Our application's socket failed: drop the connection, and tell the peer."""
        if ch.state == CLOSING:
            return
        self._abort(ch)
        ch.reset_pending = True
        self._ctl(RESET, ch.slot, ch.gen)

    # ---- completions ---------------------------------------------------------------------------
    def _on_cq(self) -> None:
        self.chan.get_events()
        try:
            while self.up:
                wcs = self.cq.poll(CQ_BATCH)
                if len(wcs) < CQ_BATCH:
                    self.cq.req_notify()
                    wcs += self.cq.poll(CQ_BATCH - len(wcs))   # what came between the poll and the arming
                    if len(wcs) < CQ_BATCH:
                        self._completions(wcs)
                        break
                self._completions(wcs)
            self._unblock()
            self._flush_ctl()
        except VerbsError as e:
            self._down(f"verbs error: {e}")

    def _completions(self, wcs: list) -> None:
        ring = self.cfg.ring
        delivered: dict[int, Channel] = {}
        for wc in wcs:
            if wc.status != WcStatus.SUCCESS:
                return self._down(f"work request failed: {wc.status.name}")
            if wc.opcode == WcOpcode.RECV_RDMA_WITH_IMM:
                self.qp.post_recv(RecvWr(0))
                self.rq_posted += 1
                slot = wc.imm_data & ~FIN
                if slot >= self.cfg.slots:
                    return self._violation(f"a write for slot {slot} of {self.cfg.slots}")
                if slot == 0:
                    off = self.ctl_rx % ring
                    if off + wc.byte_len > ring or self.ctl_rx + wc.byte_len - self.ctl_reported > ring:
                        return self._violation(f"{wc.byte_len} control bytes past the ring or its credit")
                    self.ctl_in += self.rx[off:off + wc.byte_len]
                    self.ctl_rx += wc.byte_len
                    if not self._control():
                        return
                    continue
                ch = self.channels.get(slot)
                if ch is None or ch.state != OPEN_:
                    continue   # a closing channel's last bytes: nobody reads them any more
                if ch.rx_tail % ring + wc.byte_len > ring or ch.rx_tail + wc.byte_len - ch.rx_credited > ring:
                    return self._violation(f"{wc.byte_len} bytes for slot {slot} past its ring or its credit")
                ch.rx_tail += wc.byte_len
                if wc.imm_data & FIN:
                    ch.fin_rx = True
                delivered[slot] = ch
            else:
                wrs = self.wrs
                while wrs and wrs[0][0] <= wc.wr_id:
                    ch = wrs.popleft()[1]
                    self.sq_used -= 1
                    if ch is not None:
                        ch.inflight -= 1
                        if ch.inflight == 0 and self.channels.get(ch.slot) is ch:
                            delivered[ch.slot] = ch
        for ch in delivered.values():
            if self.channels.get(ch.slot) is ch:
                if ch.state == OPEN_:
                    self._deliver(ch)
                else:
                    self._update(ch)

    # ---- the control channel -------------------------------------------------------------------
    def _ctl(self, kind: int, slot: int, gen: int, v1: int = 0, v2: int = 0, payload: bytes = b"") -> None:
        if len(self.ctl_out) >= MAX_CTL_QUEUED:
            # only a peer that withholds the control ring's credit (while making us answer: RESETs)
            # lets records pile up; the stall check would reset it later, this bounds the memory now
            return self._down(f"{MAX_CTL_QUEUED} control records wait for credit", PEER_STALLED)
        self.ctl_out.append(_CTL.pack(kind, slot, gen, v1 & _M32, v2 & _M32, len(payload)) + payload)

    def _flush_ctl(self) -> None:
        """Post what is queued for the control channel as one write (two at the ring's end)."""
        ring = self.cfg.ring
        report = (self.ctl_rx - self.ctl_reported > ring // 2
                  or self.rq_posted - self.rq_reported > self.cfg.rq_depth // 2)
        if not self.up or not (report or self.ctl_out or self.credit_due):
            return
        free = ring - (self.ctl_sent - self.ctl_acked)
        budget = self._budget()
        out = bytearray()
        if report and budget >= 2 and free >= _CTL.size:
            out += _CTL.pack(CTL_CREDIT, 0, 0, self.ctl_rx & _M32, self.rq_posted & _M32, 0)
            self.ctl_reported, self.rq_reported = self.ctl_rx, self.rq_posted
        if budget > 3:
            room = free - RESERVE_BYTES
            while self.ctl_out and len(out) + len(self.ctl_out[0]) <= room:
                out += self.ctl_out.popleft()
            for slot, ch in list(self.credit_due.items()):
                if len(out) + _CTL.size > room:
                    break
                out += _CTL.pack(CREDIT, slot, ch.gen, ch.rx_head & _M32, 0, 0)
                ch.rx_credited = ch.rx_head
                del self.credit_due[slot]
        if not out:
            return
        off = self.ctl_sent % ring
        first = min(len(out), ring - off)
        self.tx[off:off + first] = out[:first]
        self._post(None, off, first, 0)
        if first < len(out):
            self.tx[:len(out) - first] = out[first:]
            self._post(None, 0, len(out) - first, 0)
        self.ctl_sent += len(out)

    def _control(self) -> bool:
        """Act on the complete control records received; False once a bad one reset the link."""
        buf = self.ctl_in
        pos = 0
        while len(buf) - pos >= _CTL.size:
            kind, slot, gen, v1, v2, n = _CTL.unpack_from(buf, pos)
            if n > MAX_CTL_PAYLOAD:
                self._violation(f"a control record of {n} bytes")
                return False
            if len(buf) - pos < _CTL.size + n:
                break
            payload = bytes(buf[pos + _CTL.size:pos + _CTL.size + n])
            pos += _CTL.size + n
            try:
                self._record(kind, slot, gen, v1, v2, payload)
            except (ProtocolError, ValueError, KeyError, TypeError, IndexError) as e:
                self._violation(f"control record {kind} for slot {slot}: {e}")
                return False
            if not self.up:
                return False
        del buf[:pos]
        return True

    def _record(self, kind: int, slot: int, gen: int, v1: int, v2: int, payload: bytes) -> None:
        if kind == CTL_CREDIT:
            acked, rq_total = _advance(self.ctl_acked, v1), _advance(self.peer_rq_total, v2)
            if acked > self.ctl_sent or rq_total - self.imm_sent > self.remote.rq_depth:
                raise ProtocolError("credit for more than was sent or posted")
            self.ctl_acked, self.peer_rq_total = acked, rq_total
            return self._unblock()
        if kind not in (OPEN, ACCEPT, REFUSE, CREDIT, RESET, RESET_ACK, RELEASE):
            raise ProtocolError(f"unknown record type {kind}")
        if not 0 < slot < self.cfg.slots:
            raise ProtocolError(f"slot {slot} out of range")
        ch = self.channels.get(slot)
        if ch is not None and ch.gen != gen:
            ch = None if kind != OPEN else ch
        if kind == OPEN:
            return self._opened(slot, gen, payload, ch)
        if kind == RELEASE:
            if slot % 2 == self.parity and gen == self.gens[slot]:
                self.unreleased.discard(slot)
            return
        if kind == RESET:
            self._ctl(RESET_ACK, slot, gen)
            if ch is not None:
                self._abort(ch)
                self._update(ch)
            return
        if ch is None:
            return   # a late record for a connection already gone
        if kind == CREDIT:
            acked = _advance(ch.tx_acked, v1)
            if acked > ch.tx_sent:
                raise ProtocolError(f"slot {slot}: credit for {acked - ch.tx_sent} bytes never sent")
            ch.tx_acked = acked
            self._update(ch)
        elif kind == ACCEPT and ch.state == OPENING:
            ch.state = OPEN_
            app, ch.app = ch.app, None
            ch.future.set_result(app)
            ch.future = None
            self._update(ch)
        elif kind == REFUSE and ch.state == OPENING:
            self._abort(ch)
            del self.channels[slot]
            self.unreleased.discard(slot)
        elif kind == RESET_ACK and ch.reset_pending:
            ch.reset_pending = False
            self._update(ch)

    def _opened(self, slot: int, gen: int, payload: bytes, old: Channel | None) -> None:
        if slot % 2 == self.parity:
            raise ProtocolError(f"the peer opened slot {slot}, one of ours")
        if old is not None:
            # the peer opens a slot again only after our RELEASE of it: a peer that does not wait
            # breaks the protocol, and the old connection cannot go on
            raise ProtocolError(f"the peer opened slot {slot} again before it was released")
        meta = json.loads(payload)
        src, dst = (str(meta["src"][0]), int(meta["src"][1])), (str(meta["dst"][0]), int(meta["dst"][1]))
        ours, app = _socketpair()
        ch = Channel(self, slot, gen, ours, None, src, dst, ACCEPTING)   # app: the acceptor's now
        self.channels[slot] = ch

        def answer(ok: bool) -> None:
            if ch.state == ACCEPTING and not (ok and ch.greeting):   # else no wake-up: nothing to do
                self.engine.soon(lambda: self._answer(ch, ok))
        if self.engine.accept(self, src, dst, app, answer) and self.channels.get(slot) is ch:
            ch.reading = ch.greeting = True
            self.loop.add_reader(ours.fileno(), lambda: self._on_socket(self._greeted, ch))

    def _greeted(self, ch: Channel) -> None:
        """The accepting channel's first byte: the listener's GREETING (it took the connection), or
        end of file (it never will: the last holder of its end closed it)."""
        if self.channels.get(ch.slot) is not ch or ch.state != ACCEPTING:
            return
        try:
            first = ch.sock.recv(1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            first = b""
        self.loop.remove_reader(ch.sock.fileno())
        ch.reading = ch.greeting = False
        if first not in (GREETING, b""):
            log.warning("rdma link %s: slot %d: the listener's side sent %r, not the greeting", self.name,
                        ch.slot, first)
        self._answer(ch, first == GREETING)

    # ---- the end of the link -------------------------------------------------------------------
    def _violation(self, why: str) -> None:
        """The peer broke the protocol: nothing it sends on this link can be trusted any more."""
        self._down(f"the peer broke the protocol: {why}", PEER_PROTOCOL)

    def _down(self, why: str, reason: str | None = VERBS) -> None:
        """reason: what to count the reset as (None: not a reset, the link was closed)."""
        if not self.up:
            return
        self.up = False
        if reason is not None and not self.closed:
            self.engine.resets[reason] += 1
        log.log(logging.INFO if self.closed else logging.WARNING, "rdma link %s down (%s): %d connections reset",
                self.name, why, len(self.channels))
        self.loop.remove_reader(self.chan.fileno())
        for ch in list(self.channels.values()):
            self._abort(ch)
        self.channels.clear()
        self.credit_due.clear()
        self.blocked.clear()
        if not self.closed:
            self.engine.link_down(self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.engine.links.discard(self)
        self._down("closed", None)
        for ch in list(self.channels.values()):
            self._abort(ch)
        self.channels.clear()
        self.qp.close()
        self.rx_mr.close()
        self.tx_mr.close()
        self.cq.close()
        self.chan.close()
        self.pd.close()
        self._rx_mem.close()
        self._tx_mem.close()


class RdmaEngine:
    """The thread that runs every Link's pump and protocol. Its methods may be called from any thread."""

    provider = "python"   # the pump in Python (rdma.pump: python, or the compiled one not built; the tests' softverbs)

    def __init__(self, accept: Accept, cfg: RingConfig = RingConfig(),
                 on_down: Callable[[Link], None] | None = None) -> None:
        self.accept, self.cfg, self.on_down = accept, cfg, on_down
        # application bytes the pump moved from the pods' sockets onto the QP / from the rings into
        # the pods' sockets (tsor_bytes_total{path="rdma"}); written by the loop thread only
        self.bytes_sent = self.bytes_received = 0
        self.resets: collections.Counter[str] = collections.Counter()   # links reset, by reason
        self.links: set[Link] = set()
        self.loop = Loop()
        # the loop spins when it watches no fd at all: this one is always there, and wakes it to stop
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.loop.add_reader(self._bell, lambda: os.eventfd_read(self._bell))
        self.loop.call_later(STALL_CHECK, self._check_stalls)
        self._thread = threading.Thread(target=self._run, name="tsor-rdma", daemon=True)
        self._running = True
        self._thread.start()

    def _run(self) -> None:
        while self._running:
            try:
                self.loop.run_once()
            except Exception:   # a bug in one callback must not stop every link's pump
                log.exception("rdma engine: a callback failed")

    def _check_stalls(self) -> None:
        now = time.monotonic()
        for link in list(self.links):
            link.check_stall(now)
        self.loop.call_later(STALL_CHECK, self._check_stalls)

    def soon(self, fn: Callable[[], None]) -> None:
        """Run fn in the loop thread."""
        self.loop.call_later(0, fn)

    def call(self, fn: Callable[[], object], timeout: float = 10.0) -> object:
        """Run fn in the loop thread and return what it returns (or raise what it raised)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:   # noqa: BLE001 — handed to the caller's thread
                fut.set_exception(e)
        self.soon(run)
        return fut.result(timeout)

    def add_link(self, name: str, device: Device, cfg: RingConfig | None = None) -> Link:
        """A new QP to a peer node (rings: cfg, else the engine's); send link.info to the peer, then
        connect() with its info."""
        return self.call(lambda: Link(self, name, device, cfg))

    def connect(self, link: Link, remote: SetupInfo) -> None:
        self.call(lambda: link.connect(remote))

    def open(self, link: Link, src: Endpoint, dst: Endpoint, timeout: float) -> socket.socket | None:
        """The client application's end of a new connection over `link`; None when the peer has
        no taker, the link is down or full, or no answer came in time."""
        # the OPEN is posted from this thread, under the loop's lock, and the loop thread wakes this
        # one once, with the answer: handing the OPEN to the loop thread first was one more thread
        # hand-off on every connection's path
        with self.loop.lock:
            fut = link.open(src, dst)
        if fut is None:
            return None
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self.call(lambda: link.cancel(fut))
            if fut.done() and fut.result() is not None:   # accepted just as we gave up
                fut.result().close()
            return None

    def link_down(self, link: Link) -> None:
        if self.on_down is not None:
            self.on_down(link)

    def close_link(self, link: Link) -> None:
        self.call(link.close)

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        os.eventfd_write(self._bell, 1)
        self._thread.join(5)
        os.close(self._bell)
