"""What bench/pair_rdma.py and bench/pair_remote_path.py measure on one path, the standard library
only (bench/pair_remote_path.py runs it inside pods, as `python3 /repo/bench/pathprobe.py`, where
the project's virtual environment is not). The far end speaks tests/pair/rdma_node.py's serve_app
protocol: a first byte b"S" hashes what comes and answers the hash, b"E" echoes.

    python3 bench/pathprobe.py IP PORT [--setups N] [--rtts N] [--mib M]   # JSON on stdout
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time


def busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]   # all but idle and iowait


def stream(open_conn, mib: int) -> tuple[float, float]:
    """Gb/s, and busy CPU seconds per GB (this guest)."""
    block = os.urandom(1 << 20)
    s = open_conn()
    s.settimeout(600)
    j0, t0 = busy_jiffies(), time.perf_counter()
    s.sendall(b"S")
    for _ in range(mib):
        s.sendall(block)
    s.shutdown(socket.SHUT_WR)
    s.recv(100)
    t = time.perf_counter() - t0
    cpu = (busy_jiffies() - j0) / os.sysconf("SC_CLK_TCK")
    s.close()
    gb = mib * (1 << 20) / 1e9
    return gb * 8 / t, cpu / gb


def parallel(open_conn, mib: int, n: int) -> float:
    """Gb/s of n streams at once, mib MiB in all (each on its own connection and thread)."""
    block = os.urandom(1 << 20)
    conns = [open_conn() for _ in range(n)]

    def send(s: socket.socket) -> None:
        s.settimeout(600)
        s.sendall(b"S")
        for _ in range(mib // n):
            s.sendall(block)
        s.shutdown(socket.SHUT_WR)
        s.recv(100)
        s.close()
    threads = [threading.Thread(target=send, args=(s,)) for s in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (mib // n) * n * (1 << 20) * 8 / 1e9 / (time.perf_counter() - t0)


def rtts(open_conn, n: int) -> float:
    """p50 of n 64-byte round trips on one connection, us."""
    s = open_conn()
    s.settimeout(60)
    s.sendall(b"E")
    msg, out = b"x" * 64, []
    for _ in range(n):
        t0 = time.perf_counter()
        s.sendall(msg)
        got = 0
        while got < 64:
            got += len(s.recv(64 - got))
        out.append(time.perf_counter() - t0)
    s.close()
    return statistics.median(out) * 1e6


def setups(open_conn, n: int) -> float:
    """p50 of n connections' set-up and first one-byte round trip, us."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = open_conn()
        s.sendall(b"Ex")
        s.recv(1)
        out.append(time.perf_counter() - t0)
        s.close()
    return statistics.median(out) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ip")
    p.add_argument("port", type=int)
    p.add_argument("--setups", type=int, default=50)
    p.add_argument("--rtts", type=int, default=200)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args()

    def open_conn() -> socket.socket:
        return socket.create_connection((a.ip, a.port), timeout=60)
    gbps, cpu = stream(open_conn, a.mib)
    print(json.dumps({"setup_us": setups(open_conn, a.setups), "rtt_us": rtts(open_conn, a.rtts),
                      "gbps": gbps, "cpu_s_per_gb": cpu}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
