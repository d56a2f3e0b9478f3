"""Direct channels between the supervisors of one node: local-path connections without tsord.

A local-path connection used to cross tsord four times (its reader thread, a pool thread, the
server sandbox's reader thread, the pool thread again), each a wake-up of another thread; on this
2-core VM those hops were most of a connection's set-up, and tsord's CPU per connection was far
above what it is now (before and after: bench/README.md, "Supervisor to supervisor").
tsord still decides the first connection from a sandbox to a listener (identity, address claims,
NetworkPolicy, as before). When both supervisors said in their hello that they can (`direct`), its
answer also carries a *route*: the listener's token and tsord's route generation, plus one end of a
fresh SEQPACKET socketpair whose other end went to the server's supervisor in a `peer` message
naming the client sandbox and its addresses. The next connects from that sandbox to that address
and port go straight to the server's supervisor over the channel: an `incoming` record (the one
tsord sends) with one end of a new AF_UNIX socketpair. The client's supervisor answers the trapped
connect as soon as the record is sent, from the thread that received it (no hop to its event loop),
and the server's supervisor answers only a refusal: one cross-process wake-up per connection
(client supervisor -> server supervisor) where the way through tsord took six.

What keeps this as strict as asking tsord every time:
- the route holds only while tsord's route generation (a counter in a memfd page tsord shares with
  every supervisor at hello, `Generation`) is the one it was given with: any change of routes,
  pods, Services or NetworkPolicies bumps it, and the next connect asks tsord again;
- the server's supervisor checks every record: the peer address must be one of the client
  sandbox's (from tsord's `peer` message), the destination one of its own addresses on a port the
  listener covers, the token a listener it still has; a refusal drops the route and the connect
  asks tsord, which answers as it would have (fallback: the native connect gets its ECONNREFUSED);
- only a pod address is cached, never a Service ClusterIP (whose endpoint tsord picks per connect);
- the same generation keeps tsord's *fallback* answers: when tsord decided "native" from the
  addresses alone (the destination is no pod TSoR carries from here: another node's runc pod, a
  node, anything outside the cluster; never a Service, a NetworkPolicy verdict or a failed
  transport), its answer carries the generation, and the next connects to that address and port
  go native without asking, until the generation moves (a listener registering bumps it too).
  Such a connect costs the trap and a dict lookup instead of the /proc checks and a round trip
  through tsord (`bench/tsor.py --only fallback`, measured: bench/README.md, "TSoR", "Fallback
  connects, cached");
- a supervisor whose tsord connection drops closes every channel it holds (a restarted tsord starts
  from nothing), and a channel's end of file (the other sandbox gone) drops its routes.
Counts: the supervisors tell tsord how many connections went direct (`tally`, at most every 50 ms
and when the sandbox ends), so tsor_connections_total / tsor_incoming_total stay complete.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tsor import kernel_sockets, protocol
from tsor.addr import Endpoint, family_of, unmapped

# What a listening sandbox answers an offer when its listener's backlog is full (tsor/sandbox.py):
# FULL, not taken (from tsord: the connection then goes native, into the kernel's accept queue);
# OVER, over a direct channel: taken, and the client told to connect through tsord from now on
FULL, OVER = "full", "over"

log = logging.getLogger("quark.tsor")
TALLY_S = 0.05
MAX_NATIVE = 4096   # cached fallback answers per sandbox
_COUNTER = struct.Struct("Q")

Reply = Callable[[dict | None, list[int]], bool | None]   # False: the connection was not taken


class Generation:
    """tsord's side: the route generation, a counter in one shared page. Only tsord writes it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("tsor-route-generation", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, mmap.PAGESIZE)
        self._map = mmap.mmap(self.fd, mmap.PAGESIZE)
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return _COUNTER.unpack_from(self._map)[0]

    def bump(self) -> None:
        with self._lock:   # route sources run in threads of their own
            _COUNTER.pack_into(self._map, 0, self.value + 1)

    def close(self) -> None:
        self._map.close()
        os.close(self.fd)


class GenerationView:
    """A supervisor's read-only view of tsord's route generation."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ)

    @property
    def value(self) -> int:
        return _COUNTER.unpack_from(self._map)[0]

    def close(self) -> None:
        self._map.close()


class _Channel:
    """One end of a channel, on the supervisor's event loop."""

    def __init__(self, loop, sock: socket.socket, on_eof: Callable[[_Channel], None]) -> None:
        self.loop, self.sock, self.on_eof = loop, sock, on_eof
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._readable)

    @property
    def up(self) -> bool:
        return self.sock is not None

    def _readable(self) -> None:
        try:
            for mid, msg, fds in protocol.received(self.sock, "a peer channel"):
                self.record(mid, msg, fds)
                if self.sock is None:
                    return
        except protocol.Closed as e:
            log.debug("peer channel closed%s", f": {e}" if str(e) else "")
            self.close()
            self.on_eof(self)

    def record(self, mid: int, msg: object, fds: list[int]) -> None:
        raise NotImplementedError

    def send(self, data: bytes, fds: list[int] = ()) -> bool:
        try:
            protocol.send(self.sock, data, fds)
            return True
        except OSError:   # the other end is gone (EPIPE), or its queue is full: tsord's way then
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None


class ClientChannel(_Channel):
    """The connecting sandbox's end: sends `incoming` offers. An offer is not waited for: the
    listening supervisor answers only a refusal, or that the listener's backlog is full (the offer
    taken all the same), naming the address, and the route to it is dropped: the next connect asks
    tsord, which sends what the backlog cannot take native, into the kernel's accept queue."""

    def __init__(self, loop, sock: socket.socket, on_eof: Callable[[_Channel], None],
                 on_refused: Callable[[Endpoint], None]) -> None:
        super().__init__(loop, sock, on_eof)
        self.on_refused = on_refused
        self._ids = 0

    def offer(self, msg: protocol.Incoming, fd: int) -> bool:
        """False when the record cannot be sent (the other sandbox is gone, or far behind)."""
        self._ids += 1
        return self.send(protocol.encode(self._ids, msg), [fd])

    def record(self, mid: int, msg: object, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if isinstance(msg, dict) and (msg.get("ok") is False or msg.get("full") is True):
            local = msg.get("local")
            if isinstance(local, list) and len(local) == 2 and isinstance(local[0], str):
                self.on_refused((unmapped(local[0]), local[1]))


class ServedChannel(_Channel):
    """The listening sandbox's end: takes `incoming` offers from one client sandbox."""

    def __init__(self, loop, sock: socket.socket, client: protocol.Peer,
                 take: Callable[[protocol.Incoming, int], bool], on_eof: Callable[[_Channel], None]) -> None:
        super().__init__(loop, sock, on_eof)
        self.client = client
        self._addrs = frozenset(unmapped(a) for a in client.addrs)
        self.take = take

    def record(self, mid: int, msg: object, fds: list[int]) -> None:
        ok = False
        try:
            if (isinstance(msg, protocol.Incoming) and len(fds) == 1 and msg.path == "local" and not msg.greet
                    and unmapped(msg.peer[0]) in self._addrs):
                ok = self.take(msg, fds[0])
            elif isinstance(msg, protocol.Incoming):
                log.warning("peer channel from sandbox %s: refused an offer from %s", self.client.sandbox,
                            msg.peer[0])
        finally:
            for fd in fds:
                os.close(fd)
        if not isinstance(msg, protocol.Incoming) or ok is True:   # a taken offer is not answered
            return
        if ok == OVER:   # taken, but the listener's backlog is full: connect through tsord for now
            self.send(protocol.reply(mid, ok=True, full=True, local=msg.local))
        else:
            self.send(protocol.reply(mid, ok=False, local=msg.local))


@dataclass
class Route:
    """A listener another sandbox of this node holds, reachable over `channel` while `generation` holds."""
    channel: ClientChannel
    token: int
    src_ip: str
    generation: int


class PeerLinks:
    """A supervisor's direct channels, both roles: routes it may connect by, channels it serves."""

    def __init__(self, loop, own_addrs: list[str], take: Callable[[protocol.Incoming, int], bool],
                 tally: Callable[[protocol.Tally], None]) -> None:
        self.loop, self.own_addrs, self.take, self._send_tally = loop, own_addrs, take, tally
        self.generation: GenerationView | None = None
        self.routes: dict[Endpoint, Route] = {}
        self.served: set[ServedChannel] = set()
        self.channels: dict[str, ClientChannel] = {}    # by the listening sandbox's name
        self.native: dict[Endpoint, int] = {}            # dst -> generation of tsord's fallback answer
        self.connections = self.incoming = self.natives = 0   # not yet told to tsord
        self._tally_due = False

    # ---- tsord's side of it ----------------------------------------------------------------------
    def registered(self, generation_fd: int | None) -> None:
        """tsord took our hello; it shares its route generation when it offers direct channels."""
        self.reset()
        if generation_fd is not None:
            try:
                self.generation = GenerationView(generation_fd)
            except (OSError, ValueError) as e:
                log.warning("tsord's route generation cannot be mapped (%s): every connect asks tsord", e)
            finally:
                os.close(generation_fd)   # the mapping holds the page

    def reset(self) -> None:
        """tsord went away (or came back): nothing it vouched for holds any more."""
        self.routes.clear()
        self.native.clear()
        for ch in [*self.channels.values(), *self.served]:
            ch.close()
        self.channels.clear()
        self.served.clear()
        if self.generation is not None:
            self.generation.close()
            self.generation = None

    def serve(self, peer: protocol.Peer, fd: int) -> bool:
        """tsord's `peer` message: serve offers from `peer.sandbox` on this channel end."""
        sock = socket.socket(fileno=os.dup(fd))
        if sock.type != socket.SOCK_SEQPACKET:
            sock.close()
            return False
        self.served.add(ServedChannel(self.loop, sock, peer, self._take, self.served.discard))
        return True

    # ---- fallback answers -------------------------------------------------------------------------
    def remember_native(self, dst: Endpoint, generation: object) -> None:
        """tsord answered a connect to `dst` with fallback, decided by addresses alone, at `generation`."""
        if self.generation is None or not isinstance(generation, int):
            return
        if len(self.native) >= MAX_NATIVE:
            self.native.clear()   # (a sandbox scanning addresses: start over rather than grow)
        self.native[dst] = generation

    def known_native(self, dst: Endpoint) -> bool:
        """Whether a connect to `dst` goes native without asking tsord (and is counted for it)."""
        g = self.native.get(dst)
        if g is None:
            return False
        if self.generation is None or self.generation.value != g:
            del self.native[dst]
            return False
        self.natives += 1
        self._tally_soon()
        return True

    def adopt(self, dst: Endpoint, reply: dict, fds: list[int]) -> None:
        """A local-path answer of tsord's with a route (and maybe a channel end): remember it."""
        route = reply.get("direct")
        extra = fds[1] if len(fds) > 1 else None
        try:
            if self.generation is None or not isinstance(route, dict):
                return
            token, gen, peer = route.get("token"), route.get("generation"), route.get("sandbox")
            if not (isinstance(token, int) and isinstance(gen, int) and isinstance(peer, str)):
                return
            ch = self.channels.get(peer)
            if ch is None or not ch.up:
                if extra is None:
                    return
                ch = self.channels[peer] = ClientChannel(self.loop, socket.socket(fileno=os.dup(extra)),
                                                         self._lost, self._refused)
            self.routes[(unmapped(dst[0]), dst[1])] = Route(ch, token, reply["src"][0], gen)
        finally:
            if extra is not None:
                os.close(extra)

    # ---- connecting ------------------------------------------------------------------------------
    def connect(self, dst: Endpoint, src_port: int, on_reply: Reply) -> bool:
        """Connect over a channel if a route holds for `dst`: True, and `on_reply` has run (before
        this returns, so the trapped connect is answered at once; it returns False when it did not
        give the application the connection after all); False: ask tsord.

        The connection is the application's as soon as the offer is sent, as a TCP connection is
        once the listener's kernel completed the handshake, before accept(). In the rare case the
        listening supervisor then refuses it (its listener closed since the route was given), it
        closes its end: the application reads end of file, as a TCP client whose connection was
        still in the accept queue of a listener that closed; the route is dropped and the next
        connect asks tsord."""
        key = (unmapped(dst[0]), dst[1])
        route = self.routes.get(key)
        if route is None:
            return False
        if self.generation is None or route.generation != self.generation.value or not route.channel.up:
            del self.routes[key]
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        kernel_sockets.refuse_rights(ours, theirs)   # no fd crosses between the pods, as none does over TCP
        src = (route.src_ip, src_port)
        # The application's end first, the offer after: sent first, the offer woke the listening
        # supervisor onto this CPU (a unix socket's wake-up is a "sync" one), which then ran its part
        # before this one could answer the trapped connect (measured: bench/README.md, "Supervisor to
        # supervisor").
        with theirs:
            if on_reply({"path": "local", "src": list(src)}, [ours.detach()]) is False:
                return True   # answered natively after all (the task's fd changed meanwhile): no offer
            if not route.channel.offer(protocol.Incoming(route.token, src, key, "local"), theirs.fileno()):
                # the listening sandbox is gone: the application's connection reads end of file
                del self.routes[key]
                return True
        self.connections += 1
        self._tally_soon()
        return True

    def _refused(self, local: Endpoint) -> None:
        self.routes.pop(local, None)

    def _lost(self, ch: _Channel) -> None:
        for key in [k for k, r in self.routes.items() if r.channel is ch]:
            del self.routes[key]
        for name in [n for n, c in self.channels.items() if c is ch]:
            del self.channels[name]

    # ---- listening -------------------------------------------------------------------------------
    def _take(self, msg: protocol.Incoming, fd: int) -> bool | str:
        ip = unmapped(msg.local[0])
        if ip not in self.own_addrs or family_of(ip) != family_of(msg.peer[0]):
            return False
        taken = self.take(msg, fd)
        if taken is True or taken == OVER:
            self.incoming += 1
            self._tally_soon()
        return taken

    # ---- counts for tsord's metrics --------------------------------------------------------------
    def _tally_soon(self) -> None:
        if not self._tally_due:
            self._tally_due = True
            self.loop.call_later(TALLY_S, self.flush_tally)

    def flush_tally(self) -> None:
        self._tally_due = False
        if self.connections or self.incoming or self.natives:
            tally = protocol.Tally(self.connections, self.incoming, self.natives)
            self.connections = self.incoming = self.natives = 0
            self._send_tally(tally)
