"""tsord's side of the compiled rdma pump (rdma_pump.c, built by `make install` into _rdma_pump.so).

PumpEngine has RdmaEngine's interface (transport/rdma.py: add_link, connect, open, close_link,
close, the byte and reset counters) and speaks the same wire protocol, but every link's QP, CQ,
completion channel and ring pump live in one C thread that never takes the GIL: tsord's threads
run whatever the pump does, and the bytes never cross Python. What stays here is the control plane's
part of a link: the device's name, port and GID index (tsor.yaml's `rdma:`), the set-up info that
rdma_link.py exchanges with the peer, whose slots we open (parity), and the answers to the peer's
connections (the accept callback).

The C side's news (a peer opened a connection, an open was answered, a link went down) arrives as
messages on a stream socket that one reader thread (`tsor-rdma-events`) drains; a new connection's
application end comes with its message as an fd number (same process), owned here from then on.
"""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import itertools
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from tsor.addr import Endpoint
from tsor.transport.rdma import PEER_PROTOCOL, PEER_STALLED, VERBS, Accept, RingConfig, SetupInfo, slot_parity
from tsor.verbs import Device, VerbsError

log = logging.getLogger("tsor.rdma")
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_rdma_pump.so")
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rdma_pump.c")
_EVENT = struct.Struct("=IiIIqiiII")     # struct pe_event
EV_ACCEPT, EV_OPENED, EV_DOWN = 1, 2, 3
ANSWER_REFUSE, ANSWER_ACCEPT, ANSWER_GREETING = 0, 1, 2
_REASONS = (PEER_PROTOCOL, PEER_STALLED, VERBS)   # pe_stats.resets, in rdma_pump.c's order


class _Info(ctypes.Structure):
    _fields_ = [("qpn", ctypes.c_uint32), ("psn", ctypes.c_uint32), ("gid", ctypes.c_uint8 * 16),
                ("lid", ctypes.c_uint32), ("addr", ctypes.c_uint64), ("rkey", ctypes.c_uint32),
                ("ring", ctypes.c_uint32), ("slots", ctypes.c_uint32), ("rq_depth", ctypes.c_uint32),
                ("max_msg", ctypes.c_uint32)]


class _Stats(ctypes.Structure):
    _fields_ = [("bytes_sent", ctypes.c_uint64), ("bytes_received", ctypes.c_uint64),
                ("resets", ctypes.c_uint64 * 3), ("accepted", ctypes.c_uint64), ("unclaimed", ctypes.c_uint64)]


def unavailable() -> str | None:
    """Why the compiled pump cannot be used here (None: it can)."""
    if not os.path.exists(LIBRARY):
        return f"{LIBRARY} is not built (make install)"
    if os.path.exists(_SRC) and os.stat(LIBRARY).st_mtime < os.stat(_SRC).st_mtime:
        return f"{LIBRARY} is older than rdma_pump.c (make install)"
    try:
        _lib()
    except OSError as e:
        return f"{LIBRARY}: {e}"
    return None


_loaded: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _loaded
    if _loaded is None:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)   # CDLL: every call releases the GIL
        vp, i, u32, i64, cp, err = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_int64,
                                    ctypes.c_char_p, ctypes.c_char_p)
        for name, res, args in (
                ("pe_new", vp, [i]),
                ("pe_free", None, [vp]),
                ("pe_link_new", i, [vp, cp, i, i, u32, u32, u32, u32, ctypes.POINTER(_Info), err, i]),
                ("pe_link_connect", i, [vp, i, ctypes.POINTER(_Info), i, err, i]),
                ("pe_open", i, [vp, i, i64, cp, u32, ctypes.POINTER(ctypes.c_int)]),
                ("pe_cancel", None, [vp, i, i64]),
                ("pe_answer", None, [vp, i, u32, u32, i]),
                ("pe_link_fail", None, [vp, i, cp]),
                ("pe_link_state", i, [vp, i]),
                ("pe_link_close", None, [vp, i]),
                ("pe_get_stats", None, [vp, ctypes.POINTER(_Stats)]),
                ("pe_maps", i, [vp, i, i, i, i, u32]),
                ("pe_listen", i, [vp, i])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _loaded = lib
    return _loaded


class PumpLink:
    """One RC QP to one peer node, run by the C pump; what tsord keeps of it."""

    def __init__(self, engine: PumpEngine, name: str, device: Device, link_id: int, info: SetupInfo,
                 cfg: RingConfig) -> None:
        self.engine, self.name, self.device, self.id, self.info, self.cfg = engine, name, device, link_id, info, cfg
        self.remote: SetupInfo | None = None

    def _state(self) -> int:
        return self.engine._call("pe_link_state", self.id)

    @property
    def up(self) -> bool:
        s = self._state()
        return s >= 0 and bool(s & 1)

    @property
    def connections(self) -> int:
        return max(self._state(), 0) >> 1


class PumpEngine:
    """The compiled pump's thread and the reader of its events. Its methods may be called from any thread."""

    provider = "compiled"

    def __init__(self, accept: Accept, cfg: RingConfig = RingConfig(),
                 on_down: Callable[[PumpLink], None] | None = None) -> None:
        self.accept, self.cfg, self.on_down = accept, cfg, on_down
        self.lib = _lib()
        self.closed = False
        self.links: dict[int, PumpLink] = {}
        self._waiting: dict[int, concurrent.futures.Future] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._pe = self.lib.pe_new(theirs.fileno())
        if not self._pe:
            e = ctypes.get_errno() or 12
            self._ours.close()
            theirs.close()
            raise VerbsError(e, "the rdma pump did not start")
        self._theirs = theirs   # the C side writes to it; closed after pe_free
        self._reader = threading.Thread(target=self._read_events, name="tsor-rdma-events", daemon=True)
        self._reader.start()

    def _call(self, name: str, *args: object) -> int:
        if self.closed:   # pe_free'd: no link, nothing opens
            return -1 if name in ("pe_link_new", "pe_link_connect", "pe_link_state") else 0
        return getattr(self.lib, name)(self._pe, *args) or 0

    # ---- counters (tsor_bytes_total{path="rdma"}, tsor_rdma_link_resets_total) ------------------
    def _stats(self) -> _Stats:
        st = _Stats()
        self._call("pe_get_stats", ctypes.byref(st))
        return st

    @property
    def bytes_sent(self) -> int:
        return self._stats().bytes_sent

    @property
    def bytes_received(self) -> int:
        return self._stats().bytes_received

    @property
    def resets(self) -> collections.Counter[str]:
        st = self._stats()
        return collections.Counter({r: st.resets[i] for i, r in enumerate(_REASONS) if st.resets[i]})

    @property
    def listened(self) -> tuple[int, int]:
        """The kernel-chosen path's listener: connections it carried, and ones it reset (unclaimed)."""
        st = self._stats()
        return st.accepted, st.unclaimed

    def use_maps(self, conns_map: int, peers_map: int, addrs_map: int, room_map: int, bind_ip: str) -> None:
        """The kernel-chosen path's maps (tsor/remote_path.py): the listener reads the conns map; a
        peer's connection to a pod of the sockmap path's address map is connected to by the pump
        itself, from `bind_ip`, with the client's address in the peers map for the pod's accept()
        (deleted when it ends); the room map gets each link's free channels (less a reserve), which
        the programs' connects take. The pump keeps its own descriptors of the maps."""
        ip = struct.unpack("=I", socket.inet_aton(bind_ip))[0]
        if self._call("pe_maps", conns_map, peers_map, addrs_map, room_map, ip) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"the rdma pump cannot use the maps: {os.strerror(e)}")

    def listen(self, sock: socket.socket) -> None:
        """Accept the kernel-chosen path's connections on `sock` in the pump (after use_maps; the
        pump keeps its own descriptor of the socket)."""
        fd = os.dup(sock.fileno())
        if self._call("pe_listen", fd) < 0:
            e = ctypes.get_errno()
            os.close(fd)
            raise OSError(e, f"the rdma pump does not listen: {os.strerror(e)}")

    # ---- links ---------------------------------------------------------------------------------
    def add_link(self, name: str, device: Device, cfg: RingConfig | None = None) -> PumpLink:
        """A new QP to a peer node on the device's port and GID (the pyverbs device tsor.yaml chose)."""
        cfg = cfg or self.cfg
        info, err = _Info(), ctypes.create_string_buffer(256)
        link_id = self._call("pe_link_new", device.name.encode(), device.port_num, device.gid_index, cfg.ring,
                             cfg.slots, cfg.sq_depth, cfg.rq_depth, ctypes.byref(info), err, len(err))
        if link_id < 0:
            raise VerbsError(0, err.value.decode(errors="replace"))
        setup = SetupInfo(info.qpn, info.psn, bytes(info.gid).hex(), info.lid, info.addr, info.rkey, info.ring,
                          info.slots, info.rq_depth)
        link = PumpLink(self, name, device, link_id, setup, cfg)
        with self._lock:
            self.links[link_id] = link
        return link

    def connect(self, link: PumpLink, remote: SetupInfo) -> None:
        """Connect the QP to the peer's and start pumping (rdma.py's Link.connect: the same checks)."""
        parity = slot_parity(link.info, link.cfg, remote)
        r = _Info(remote.qpn, remote.psn, (ctypes.c_uint8 * 16)(*bytes.fromhex(remote.gid)), remote.lid, remote.addr,
                  remote.rkey, remote.ring, remote.slots, remote.rq_depth, 0)
        err = ctypes.create_string_buffer(256)
        if self._call("pe_link_connect", link.id, ctypes.byref(r), parity, err, len(err)) < 0:
            raise VerbsError(0, err.value.decode(errors="replace"))
        link.remote = remote
        log.info("rdma link %s up over %s (compiled pump): qpn %d -> %d", link.name, link.device.name,
                 link.info.qpn, remote.qpn)

    def open(self, link: PumpLink, src: Endpoint, dst: Endpoint, timeout: float) -> socket.socket | None:
        """The client application's end of a new connection over `link`; None when the peer has
        no taker, the link is down or full, or no answer came in time."""
        token = next(self._tokens)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._waiting[token] = fut
        payload = json.dumps({"src": list(src), "dst": list(dst)}).encode()
        fd = ctypes.c_int(-1)
        if not self._call("pe_open", link.id, token, payload, len(payload), ctypes.byref(fd)):
            with self._lock:
                self._waiting.pop(token, None)
            return None
        app = socket.socket(fileno=fd.value)
        try:
            ok = fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self._call("pe_cancel", link.id, token)   # still opening: reset; accepted just now: our close ends it
            with self._lock:
                self._waiting.pop(token, None)
            ok = False
        if not ok:
            app.close()
            return None
        return app

    def close_link(self, link: PumpLink) -> None:
        with self._lock:
            self.links.pop(link.id, None)
        self._call("pe_link_close", link.id)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.lib.pe_free(self._pe)
        self._theirs.close()   # the reader sees end of file
        self._reader.join(5)
        self._ours.close()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_result(False)

    # ---- the C side's news ---------------------------------------------------------------------
    def _read_events(self) -> None:
        buf = bytearray()
        while True:
            try:
                data = self._ours.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buf += data
            pos = 0
            while len(buf) - pos >= _EVENT.size:
                kind, link_id, slot, gen, token, fd, code, n, _ = _EVENT.unpack_from(buf, pos)
                if len(buf) - pos < _EVENT.size + n:
                    break
                payload = bytes(buf[pos + _EVENT.size:pos + _EVENT.size + n])
                pos += _EVENT.size + n
                try:
                    self._event(kind, link_id, slot, gen, token, fd, code, payload)
                except Exception:   # one event's handler must not stop the others
                    log.exception("rdma pump: handling event %d failed", kind)
            del buf[:pos]

    def _event(self, kind: int, link_id: int, slot: int, gen: int, token: int, fd: int, code: int,
               payload: bytes) -> None:
        if kind == EV_OPENED:
            with self._lock:
                fut = self._waiting.pop(token, None)
            if fut is not None and not fut.done():
                fut.set_result(code == 1)
            return
        with self._lock:
            link = self.links.get(link_id)
        if kind == EV_DOWN:
            if link is not None:
                log.warning("rdma link %s down (%s)", link.name, payload.decode(errors="replace"))
                if self.on_down is not None:
                    self.on_down(link)
            return
        if kind != EV_ACCEPT:
            log.error("rdma pump: unknown event %d", kind)
            return
        app = socket.socket(fileno=fd)
        if link is None:
            app.close()
            return
        try:
            meta = json.loads(payload)
            src = (str(meta["src"][0]), int(meta["src"][1]))
            dst = (str(meta["dst"][0]), int(meta["dst"][1]))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            app.close()
            self._call("pe_link_fail", link_id, f"an OPEN for slot {slot} that says {e!r}".encode())
            return
        self._accepted(link, slot, gen, src, dst, app)

    def _accepted(self, link: PumpLink, slot: int, gen: int, src: Endpoint, dst: Endpoint,
                  app: socket.socket) -> None:
        """Hand a peer's connection to the accept callback; its answer (from any thread, possibly
        before the callback returned whether the listener greets) reaches the pump once."""
        lock = threading.Lock()
        state: dict[str, bool | None] = {"greeting": None, "early": None}

        def answer(ok: bool) -> None:
            with lock:
                if state["greeting"] is None:   # the callback has not returned yet
                    state["early"] = ok
                    return
                greeting = state["greeting"]
            if not (ok and greeting):           # a greeting listener's GREETING accepts, in the pump
                self._answer(link, slot, gen, ANSWER_ACCEPT if ok else ANSWER_REFUSE)

        greets = bool(self.accept(link, src, dst, app, answer))
        with lock:
            state["greeting"], early = greets, state["early"]
        if greets:
            self._answer(link, slot, gen, ANSWER_GREETING)
        if early is not None and not (early and greets):
            self._answer(link, slot, gen, ANSWER_ACCEPT if early else ANSWER_REFUSE)

    def _answer(self, link: PumpLink, slot: int, gen: int, how: int) -> None:
        self._call("pe_answer", link.id, slot, gen, how)
