"""The rdma transport's pump, measured alone: node A and node B are two processes joined by one RC
QP on a pair of softverbs devices (a socketpair cable); the client and server applications are two
more processes on real socketpair ends, as sandboxes are.

    [RDMA_RING=BYTES] .venv/bin/python bench/rdma_pump.py [--rtts N] [--mib N] [--json F]

Per message, from each thread's CPU time (/proc/PID/task/TID/schedstat, ns):
  pump      both nodes' engine threads (socket -> send ring -> post_send, completion -> receive ring
            -> socket, credits): what tsord spends per message on the rdma path. softverbs's
            requester side (framing, the send on the cable) runs in the posting thread, so it is here.
  softverbs both devices' NIC threads (receiving frames, remote checks, copies into the region, ACKs):
            what an RNIC does in hardware
64 B ping-pong: one message per RDMA write, nothing batched; streams: the pump batches what the
socket holds into writes of up to 1 MiB (softverbs' max_msg_sz).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import softverbs
from tsor.transport.rdma import RdmaEngine, RingConfig, SetupInfo

RING = int(os.environ.get("RDMA_RING", softverbs.RING.ring))   # bytes per ring (tsord's for softverbs links)


def cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def send_json(s: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    s.sendall(struct.pack("!I", len(data)) + data)


def recv_json(s: socket.socket) -> object:
    n, = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
    return json.loads(s.recv(n, socket.MSG_WAITALL))


def spawn(fn, *args) -> int:
    """fn(*args) in a child process (forked from a thread: the child has that thread alone)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)
        finally:
            os._exit(0)
    return pid


def server_app(sock: socket.socket) -> None:
    """b"E": echo until EOF; b"S": read to EOF, answer the byte count."""
    mode = sock.recv(1)
    if mode == b"E":
        while data := sock.recv(65536):
            sock.sendall(data)
    else:
        n = 0
        while chunk := sock.recv(1 << 20):
            n += len(chunk)
        sock.sendall(struct.pack("!Q", n))


class Node:
    """One node: a softverbs device on one end of the cable, an engine, one link."""

    def __init__(self, cable: socket.socket, name: str) -> None:
        self.apps: list[int] = []
        self.accepted: list[socket.socket] = []
        self.engine = RdmaEngine(self._accept, RingConfig(ring=RING))
        self.dev = softverbs.open_device(cable, name)
        self.link = self.engine.add_link("peer", self.dev)

    def _accept(self, _link, _src, _dst, app: socket.socket, answer) -> None:
        self.apps.append(spawn(server_app, app))
        app.close()
        answer(True)

    def threads(self) -> dict[str, tuple[int, int]]:
        pid = os.getpid()
        return {"pump": (pid, self.engine._thread.native_id), "softverbs": (pid, self.dev._thread.native_id)}

    def close(self) -> None:
        self.engine.close_link(self.link)
        self.engine.close()
        self.dev.close()


def node_b(cable: socket.socket, ctl: socket.socket, node_a_ends: list[socket.socket]) -> None:
    for s in node_a_ends:
        s.close()
    node = Node(cable, "bench-b")
    send_json(ctl, {"info": node.link.info.to_dict(), "threads": node.threads()})
    node.engine.connect(node.link, SetupInfo.from_dict(recv_json(ctl)))
    ctl.sendall(b"R")   # ready: A may write now
    ctl.recv(1)   # until node A is done
    node.close()
    for pid in node.apps:
        os.waitpid(pid, 0)


class Bench:
    def __init__(self) -> None:
        cable_a, cable_b = socket.socketpair()
        ctl_a, ctl_b = socket.socketpair()
        self.node_b = spawn(node_b, cable_b, ctl_b, [cable_a, ctl_a])
        cable_b.close()
        ctl_b.close()
        self.ctl = ctl_a
        self.a = Node(cable_a, "bench-a")
        peer = recv_json(ctl_a)
        send_json(ctl_a, self.a.link.info.to_dict())
        self.a.engine.connect(self.a.link, SetupInfo.from_dict(peer["info"]))
        assert ctl_a.recv(1) == b"R"
        self.threads = [self.a.threads(), peer["threads"]]

    def cpu(self) -> dict[str, int]:
        out = {"pump": 0, "softverbs": 0}
        for node in self.threads:
            for kind, (pid, tid) in node.items():
                out[kind] += cpu_ns(pid, tid)
        return out

    def run_client(self, mode: bytes, fn, *args) -> dict:
        """fn(sock, out, *args) in a client process on a new connection; what it writes to out (JSON)."""
        sock = self.a.engine.open(self.a.link, ("10.0.0.1", 1), ("10.0.0.2", 2), 5)
        assert sock is not None
        sock.sendall(mode)
        r, w = socket.socketpair()
        before = self.cpu()

        def client() -> None:
            send_json(w, fn(sock, *args))
        pid = spawn(client)
        sock.close()
        w.close()
        res = recv_json(r)
        after = self.cpu()
        os.waitpid(pid, 0)
        res.update({f"{k}_us_per_msg": round((after[k] - before[k]) / res["messages"] / 1000, 2) for k in after})
        return res

    def close(self) -> None:
        self.a.close()
        self.ctl.close()
        os.waitpid(self.node_b, 0)
        for pid in self.a.apps:
            os.waitpid(pid, 0)


def pingpong(sock: socket.socket, n: int) -> dict:
    msg = b"x" * 64
    rtts = []
    for i in range(n + 200):   # the first 200: warm-up
        t0 = time.perf_counter_ns()
        sock.sendall(msg)
        got = 0
        while got < 64:
            got += len(sock.recv(64 - got))
        if i >= 200:
            rtts.append(time.perf_counter_ns() - t0)
    rtts.sort()
    return {"messages": 2 * (n + 200), "round_trips": n, "rtt_p50_us": round(rtts[n // 2] / 1000, 1),
            "rtt_p99_us": round(rtts[int(n * 0.99)] / 1000, 1), "note": "per message: each way counts once"}


def stream(sock: socket.socket, size: int, total: int) -> dict:
    msg = os.urandom(size)
    count = total // size
    t0 = time.perf_counter()
    for _ in range(count):
        sock.sendall(msg)
    sock.shutdown(socket.SHUT_WR)
    n, = struct.unpack("!Q", sock.recv(8, socket.MSG_WAITALL))
    secs = time.perf_counter() - t0
    assert n == count * size, (n, count * size)
    return {"message_bytes": size, "messages": count, "gbps": round(n * 8 / secs / 1e9, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtts", type=int, default=3000)
    p.add_argument("--mib", type=int, default=64, help="MiB per stream")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    bench = Bench()
    try:
        res = {"pingpong_64B": bench.run_client(b"E", pingpong, args.rtts),
               "stream_64KiB": bench.run_client(b"S", stream, 65536, args.mib << 20),
               "stream_64B": bench.run_client(b"S", stream, 64, min(args.mib, 4) << 20)}
    finally:
        bench.close()
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
