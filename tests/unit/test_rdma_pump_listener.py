"""The compiled pump's side of the kernel-chosen remote leg (tsor/remote_path.py), on a real verbs
device (marked rdma_device: `make test-rdma` runs them on soft-RoCE in the RDMA lane): node A's pump
accepts a connection on its listener, reads where it goes from the conns map (kernel maps of the
programs' layouts, made here; on a node the sock_ops program writes the note), and carries it over
the link; node B's pump connects to the server itself, since the address map names it as a pod of
its node, with the client's address in the peers map until the connection ends. No Python callback
runs on either side. A connection with no note is reset; so is one whose pod refuses."""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from qlib import bpf
from tests.support.rdma import device_or_skip
from tests.unit.test_rdma_ring import wait_for
from tsor import remote_path, service_lb
from tsor.transport.rdma import RingConfig
from tsor.transport.rdma_pump import PumpEngine
from tsor.verbs import pyverbs_provider

pytestmark = pytest.mark.rdma_device
HASH, ARRAY, LRU_HASH = 1, 2, 9


class Pumps:
    def __init__(self) -> None:
        self.conns = bpf.map_create(LRU_HASH, 8, 8, 1024)
        self.peers = bpf.map_create(LRU_HASH, 12, 8, 1024)
        self.addrs = bpf.map_create(HASH, 4, 8, 16)     # the sockmap path's: the pods of node B
        bpf.map_update(self.addrs, socket.inet_aton("127.0.0.1"), struct.pack("=Q", 1))
        self.room = bpf.map_create(ARRAY, 4, 4, 1024)
        self.room_b = bpf.map_create(ARRAY, 4, 4, 1024)   # (each node has its own; link ids are per pump)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.seen: list[tuple] = []
        self.a = PumpEngine(lambda *a: False, RingConfig(ring=64 * 1024, slots=64))
        self.b = PumpEngine(self._accept, RingConfig(ring=64 * 1024, slots=64))
        self.devices = [pyverbs_provider.open_device(), pyverbs_provider.open_device()]
        self.la, self.lb = self.a.add_link("node-b", self.devices[0]), self.b.add_link("node-a", self.devices[1])
        self.a.connect(self.la, self.lb.info)
        self.b.connect(self.lb, self.la.info)
        self.listener = socket.create_server(("127.0.0.1", 0))
        for engine, room in ((self.a, self.room), (self.b, self.room_b)):
            engine.use_maps(self.conns, self.peers, self.addrs, room, "127.0.0.1")
        self.a.listen(self.listener)

    def _accept(self, link, src, dst, app, answer) -> bool:
        """tsord's callback: only for what the pump does not connect itself."""
        self.seen.append((src, dst))
        app.close()
        answer(False)
        return False

    def client(self, noted: bool = True, to: tuple[str, int] | None = None) -> socket.socket:
        c = socket.socket()
        c.bind(("127.0.0.1", 0))
        ip, port = to or self.server.getsockname()
        if noted:   # what the sock_ops program writes: the client's address -> where it goes, the link
            bpf.map_update(self.conns, socket.inet_aton("127.0.0.1") + struct.pack("!H", c.getsockname()[1]) + b"\0\0",
                           socket.inet_aton(ip) + struct.pack("!H", port) + struct.pack("=H", self.la.id))
        c.settimeout(10)
        c.connect(self.listener.getsockname())
        return c

    def room_of(self, link) -> int:
        """What the room map says link can take now."""
        return struct.unpack("=i", bpf.map_lookup(self.room, struct.pack("=I", link.id), 4))[0]

    def close(self) -> None:
        for engine, link in ((self.a, self.la), (self.b, self.lb)):
            engine.close_link(link)
        self.a.close()
        self.b.close()
        for d in self.devices:
            d.close()
        for s in (self.listener, self.server):
            s.close()
        for fd in (self.conns, self.peers, self.addrs, self.room, self.room_b):
            os.close(fd)


@pytest.fixture
def pumps():
    device_or_skip().close()
    p = Pumps()
    try:
        yield p
    finally:
        p.close()


def test_a_noted_connection_is_carried_to_the_server_the_note_names(pumps):
    room = pumps.room_of(pumps.la)
    assert 0 < room < 32   # the link's half of 64 slots, less the reserve
    c = pumps.client()
    with c:
        conn, peer = pumps.server.accept()
        with conn:
            assert peer[0] == "127.0.0.1"   # (the programs would answer the client's: host test)
            key = remote_path.peer_key(pumps.server.getsockname(), peer)
            assert bpf.map_lookup(pumps.peers, key, 8) == service_lb.endpoint_value(c.getsockname())
            conn.settimeout(10)
            data = bytes(range(256)) * 4096   # 1 MiB each way
            threading.Thread(target=c.sendall, args=(data,)).start()
            got = b""
            while len(got) < len(data):
                got += conn.recv(1 << 16)
            assert got == data
            conn.sendall(data[::-1])
            got = b""
            while len(got) < len(data):
                got += c.recv(1 << 16)
            assert got == data[::-1]
            assert pumps.seen == []                     # no Python on either side
            wait_for(lambda: pumps.room_of(pumps.la) == room - 1, 10)   # one channel of the link taken
            assert pumps.a.listened == (1, 0)
            # the note was taken out; the far side's peers entry is there while the connection is
            assert bpf.map_keys(pumps.conns, 8) == []
            assert len(bpf.map_keys(pumps.peers, 12)) == 1
            c.shutdown(socket.SHUT_WR)
            assert conn.recv(10) == b""                 # half-close crosses
            conn.sendall(b"after")
            assert c.recv(10) == b"after"
    deadline = time.monotonic() + 10
    while bpf.map_keys(pumps.peers, 12) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bpf.map_keys(pumps.peers, 12) == [], "the peers entry outlived the connection"
    wait_for(lambda: pumps.room_of(pumps.la) == room, 10)    # and given back


def reset(pumps, **kw) -> None:
    """A client's connection is reset by the pump (before its connect() returned, or after)."""
    with pytest.raises(ConnectionResetError):
        with pumps.client(**kw) as c:
            c.recv(10)


def test_a_connection_without_a_note_is_reset(pumps):
    reset(pumps, noted=False)
    assert pumps.a.listened == (0, 1)
    assert pumps.seen == []


def test_a_pod_that_refuses_resets_the_client_and_an_address_not_of_the_node_goes_to_tsord(pumps):
    with socket.socket() as closed:   # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    reset(pumps, to=("127.0.0.1", port))
    assert bpf.map_keys(pumps.peers, 12) == []
    reset(pumps, to=("127.0.0.2", port))   # not in the address map: tsord's callback answers
    assert [dst for _, dst in pumps.seen] == [("127.0.0.2", port)]
    assert pumps.a.listened == (2, 0)
