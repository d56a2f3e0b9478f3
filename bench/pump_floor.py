"""The most any user-space pump can move on this host, against plain TCP (issue 17's softverbs goal).

TSoR's rdma path over softverbs carries an application's bytes through four more copies than the
tcp path does: application -> socketpair -> (pump) send ring -> cable -> (peer) receive ring ->
socketpair -> application, where the tcp path's kernel copies twice (send, receive). This bench runs
that data path with no protocol at all, as cheap as user space makes it: four processes (writer,
two relays, reader), blocking calls, 1 MiB relay buffers, so the interpreter's cost is one call per
MiB. What it reaches is the ceiling of any pump of this shape on this host, compiled or not; the
gap between it and the softverbs row of `bench/tsor.py --only two_nodes,rdma` is the pump's own
cost (Python, wake-ups, flow control).

    .venv/bin/python bench/pump_floor.py [--runs 5] [--seconds 4] [--ring BYTES] [--json out.json]

No root; loopback only (both configurations over 127.0.0.1 in the caller's network namespace).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time

CHUNK = 128 * 1024    # the writer's writes: iperf3's default for TCP
RELAY = 1 << 20       # a relay's buffer: the softverbs path's largest RDMA write


def _writer(sock: socket.socket, seconds: float) -> None:
    buf = b"x" * CHUNK
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(buf)
    sock.shutdown(socket.SHUT_WR)   # not close(): the other processes hold copies of every fd (fork)


def _reader(sock: socket.socket, out: mp.Queue) -> None:
    buf = memoryview(bytearray(4 * CHUNK))
    n, t0 = 0, time.monotonic()
    while k := sock.recv_into(buf):
        n += k
    out.put(n * 8 / (time.monotonic() - t0) / 1e9)


def _relay(src: socket.socket, dst: socket.socket, ring: int) -> None:
    """Read at most RELAY bytes at a time into a `ring`-byte buffer, at a rotating offset (as the
    rdma path's rings are written), and send them on."""
    buf, off = memoryview(bytearray(ring)), 0
    while k := src.recv_into(buf[off:off + min(RELAY, ring - off)]):
        dst.sendall(buf[off:off + k])
        off = (off + k) % ring
    dst.shutdown(socket.SHUT_WR)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as lsn:
        c = socket.create_connection(lsn.getsockname())
        s, _ = lsn.accept()
    return c, s


def run_once(kind: str, seconds: float, ring: int = RELAY) -> float:
    """Gb/s received by the reader: `tcp` writer -> TCP -> reader; `pump` the six-copy path."""
    out: mp.Queue = mp.Queue()
    socks: list[socket.socket] = []
    if kind == "tcp":
        c, s = _tcp_pair()
        socks += [c, s]
        procs = [mp.Process(target=_writer, args=(c, seconds)), mp.Process(target=_reader, args=(s, out))]
    else:
        app_a, pump_a = socket.socketpair()
        app_b, pump_b = socket.socketpair()
        c, s = _tcp_pair()
        socks += [app_a, pump_a, app_b, pump_b, c, s]
        procs = [mp.Process(target=_writer, args=(app_a, seconds)), mp.Process(target=_relay, args=(pump_a, c, ring)),
                 mp.Process(target=_relay, args=(s, pump_b, ring)), mp.Process(target=_reader, args=(app_b, out))]
    for p in procs:
        p.start()
    for sk in socks:
        sk.close()
    try:
        return out.get(timeout=seconds + 30)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--ring", type=int, default=RELAY,
                    help="bytes of each relay's buffer, written round at a rotating offset (default 1 MiB)")
    ap.add_argument("--json")
    args = ap.parse_args()
    mp.set_start_method("fork")
    runs = []
    for i in range(args.runs):   # side by side: each run measures both in turn
        tcp, pump = run_once("tcp", args.seconds), run_once("pump", args.seconds, args.ring)
        runs.append({"tcp_gbps": tcp, "pump_gbps": pump, "ratio": pump / tcp})
        print(f"run {i + 1}: plain TCP {tcp:.1f} Gb/s, six-copy pump {pump:.1f} Gb/s, ratio {pump / tcp:.2f}",
              flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    per_run = " / ".join(f"{r['ratio']:.2f}" for r in runs)
    print(f"median: plain TCP {med['tcp_gbps']:.1f} Gb/s, six-copy pump {med['pump_gbps']:.1f} Gb/s, "
          f"ratio {med['ratio']:.2f} (per run {per_run})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs, "median": med,
                       "chunk": CHUNK, "relay_read": RELAY, "ring": args.ring}, f, indent=2)


if __name__ == "__main__":
    main()
