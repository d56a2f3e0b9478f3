"""One end of TSoR's rdma transport on a lane guest's own RoCE device (rxe0): the engine tsord runs
(the Python one, or the compiled pump, tsord's default), one link to the other guest, and the
connections it carries. Both guests of the pair lane use it: a opens connections, b serves them
(tests/pair/peer.py). Set-up as tsord does it over its node-to-node connection (transport/
rdma_link.py): each side's SetupInfo as a 4-byte length and JSON over a TCP control connection
between the guests, each QP in RTR before the other side writes."""
from __future__ import annotations

import hashlib
import socket
import threading

from tsor.transport.rdma import RdmaEngine, RingConfig, SetupInfo
from tsor.transport.rdma_link import recv_json, send_json   # tsord's own set-up framing
from tsor.transport.rdma_pump import PumpEngine
from tsor.verbs.pyverbs_provider import open_device

CONTROL_PORT = 7603
PUMPS = ("compiled", "python")


def serve_app(app: socket.socket) -> None:
    """What a carried connection asks by its first byte: b"E" echo until EOF; b"S" read to EOF and
    answer the SHA-256 hex digest of what came."""
    with app:
        mode = app.recv(1)
        if mode == b"E":
            while data := app.recv(65536):
                app.sendall(data)
        elif mode == b"S":
            h = hashlib.sha256()
            while data := app.recv(1 << 20):
                h.update(data)
            app.sendall(h.hexdigest().encode())


class RdmaNode:
    def __init__(self, pump: str) -> None:
        engine = PumpEngine if pump == "compiled" else RdmaEngine
        self.engine = engine(self._accept, RingConfig())
        self.dev = open_device()   # the first device: the guest's rxe0
        self.link = self.engine.add_link("peer", self.dev)

    def _accept(self, _link, _src, _dst, app: socket.socket, answer) -> None:
        threading.Thread(target=serve_app, args=(app,), daemon=True).start()
        answer(True)

    def info(self) -> dict:
        return self.link.info.to_dict()

    def connect(self, remote: object) -> None:
        self.engine.connect(self.link, SetupInfo.from_dict(remote))

    def open(self, timeout: float = 30) -> socket.socket:
        sock = self.engine.open(self.link, ("10.0.0.1", 1), ("10.0.0.2", 2), timeout)
        if sock is None:
            raise OSError("the link carried no connection")
        return sock

    def close(self) -> None:
        self.engine.close_link(self.link)
        self.engine.close()
        self.dev.close()


def serve_control(conn: socket.socket) -> None:
    """Guest b's side of one control connection: {"pump"} in, a node made, infos swapped, b"R" once
    its QP may be written to; the node serves until the control connection ends."""
    with conn:
        pump = recv_json(conn)["pump"]
        node = RdmaNode(pump)
        try:
            send_json(conn, node.info())
            node.connect(recv_json(conn))
            conn.sendall(b"R")
            conn.recv(1)   # EOF: guest a is done with this node
        finally:
            node.close()


def dial(peer: str, pump: str) -> tuple[RdmaNode, socket.socket]:
    """Guest a's side: a node linked to a fresh node of `pump` on guest b; the control connection
    stays open as long as the link is wanted."""
    ctl = socket.create_connection((peer, CONTROL_PORT), timeout=120)
    node = RdmaNode(pump)
    try:
        send_json(ctl, {"pump": pump})
        remote = recv_json(ctl)
        send_json(ctl, node.info())
        node.connect(remote)
        if ctl.recv(1) != b"R":
            raise OSError("guest b's node did not become ready")
    except BaseException:
        node.close()
        ctl.close()
        raise
    return node, ctl
