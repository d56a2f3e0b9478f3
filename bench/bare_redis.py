"""The kernel's own figure for redis-benchmark, with no container and no runtime: the same
redis-server and redis-benchmark binaries run straight in two pod network namespaces on a CNI
bridge, once over TCP (veth + bridge, the path runc's pods take) and once over a unix socket
(AF_UNIX, what TSoR's local path gives quark's pods). Their ratio is the most a runtime that hands
its pods AF_UNIX ends can show against veth + bridge on this machine; the benchmarks print it beside
quark's ratio (bench/tsor.py's redis row, bench/cri_redis.py).

    with BareRedis(srv_netns, srv_ip, workdir) as bare:
        bare.rps("unix", cli_netns, c=50, n=100000)   # GET/SET mean, req/s
"""
from __future__ import annotations

import csv
import io
import os
import subprocess
import time

VIAS = ("unix", "veth")


def redis_rps(text: str) -> dict[str, float]:
    """redis-benchmark --csv: {"GET": req/s, "SET": req/s}."""
    rows = [r for r in csv.reader(io.StringIO(text)) if len(r) > 1 and r[0] in ("GET", "SET")]
    return {r[0]: float(r[1]) for r in rows}


class BareRedis:
    """A redis-server with no container in network namespace `netns`, on `ip`:`port` and on a unix
    socket in `workdir`; close() (or the with block's end) stops it."""

    def __init__(self, netns: str, ip: str, workdir: str, port: int = 6380) -> None:
        self.ip, self.port = ip, port
        self.sock = os.path.join(workdir, "bare-redis.sock")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, "redis-server", "--bind", ip, "--port", str(port),
             "--unixsocket", self.sock, "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
             "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while not os.path.exists(self.sock):   # it opens the unix socket after the TCP one
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"bare redis-server in {netns} did not start")
            time.sleep(0.05)

    def rps(self, via: str, netns: str, c: int, n: int) -> float:
        """redis-benchmark GET/SET from network namespace `netns`, over the unix socket ("unix") or
        TCP to the server's address ("veth"): the mean of GET's and SET's req/s."""
        target = ["-s", self.sock] if via == "unix" else ["-h", self.ip, "-p", str(self.port)]
        r = subprocess.run(["ip", "netns", "exec", netns, "redis-benchmark", *target, "-t", "get,set",
                            "-n", str(n), "-c", str(c), "--csv"], capture_output=True, text=True, timeout=600)
        got = redis_rps(r.stdout)
        if r.returncode != 0 or set(got) != {"GET", "SET"}:
            raise RuntimeError(f"bare redis-benchmark over {via} failed: {(r.stdout + r.stderr)[-1000:]}")
        return (got["GET"] + got["SET"]) / 2

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass

    def __enter__(self) -> BareRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
