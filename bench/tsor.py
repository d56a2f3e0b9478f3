"""TSoR benchmark: one run, side by side, on this machine (root; runc, iperf3, redis, gcc).

One node  — two containers in two pods on one bridge (CNI bridge plugin):
            quark + TSoR (local path) vs runc (veth + bridge, the Kubernetes default path):
            iperf3 throughput, 64 B ping-pong RTT p50/p99, redis-benchmark GET/SET at -c 1 and -c 50.
Two nodes — two network namespaces joined by a veth, each with a bridge, pods and tsord:
            quark + TSoR (tcp path) vs runc (plain TCP, same veth): iperf3 throughput and
            connection set-up time (connect + 1-byte echo + close).

    .venv/bin/python bench/tsor.py [--json bench/results/tsor.json] [--png bench/results/tsor.png]
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import struct
import subprocess
import sys
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.cleanup import quark_cgroup_dirs, remove_empty_since  # noqa: E402
from tests.support.testbed import Testbed  # noqa: E402

GOALS = {"iperf3_gbps": (">=", 2.0), "rtt_p50_us": ("<=", 0.75), "redis_c50_rps": (">=", 1.5),
         "redis_c1_rps": (">=", 1.05), "two_node_iperf3_gbps": (">=", 0.95)}


def wait_port(bed: Testbed, pod, port: int, timeout: float = 15) -> None:
    code = f"import socket; socket.create_connection(('{pod.ip}', {port}), timeout=1).close()"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(["ip", "netns", "exec", pod.node.netns, sys.executable, "-c", code],
                          capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {pod.ip}:{port}")


def client(bed: Testbed, runtime: str, name: str, pod, shell: str, timeout: float = 180) -> str:
    out = f"/out/{name}.txt"
    r = bed.run(runtime, name, bed.bundle(name, ["sh", "-c", f"{shell} > {out} 2>&1"], pod,
                                          tsor=runtime == "quark"), timeout=timeout)
    with open(bed.out(f"{name}.txt")) as f:
        text = f.read()
    if r.returncode != 0:
        raise RuntimeError(f"{name} ({runtime}) failed: {text[-2000:]} {r.stderr[-2000:]}")
    return text


def redis_rps(text: str) -> dict[str, float]:
    rows = list(csv.reader(io.StringIO(text)))
    return {row[0]: float(row[1]) for row in rows[1:] if len(row) > 1}


def one_node(runtime: str, pp: str, tag: str) -> dict:
    bed = Testbed(prefix=f"qb{tag}", octet=215)
    try:
        node = bed.node("n")
        if runtime == "quark":
            node.start_tsord()
        srv, cli = node.pod("srv"), node.pod("cli")
        tsor = runtime == "quark"
        bed.start(runtime, "iperf-s", bed.bundle("iperf-s", ["iperf3", "-s", "-p", "5201"], srv, tsor=tsor))
        bed.start(runtime, "pp-s", bed.bundle("pp-s", [pp, "server", "7001"], srv, tsor=tsor))
        bed.start(runtime, "redis", bed.bundle("redis", ["redis-server", "--port", "6379", "--save", "",
                                                         "--appendonly", "no", "--protected-mode", "no"],
                                               srv, tsor=tsor))
        for port in (5201, 7001, 6379):
            wait_port(bed, srv, port)
        res = {}
        it = json.loads(client(bed, runtime, "iperf", cli, f"iperf3 -c {srv.ip} -p 5201 -t 5 -J"))
        res["iperf3_gbps"] = it["end"]["sum_received"]["bits_per_second"] / 1e9
        p50, p99 = map(float, client(bed, runtime, "rtt", cli, f"{pp} rtt {srv.ip} 7001 20000").split())
        res["rtt_p50_us"], res["rtt_p99_us"] = p50, p99
        for c, n in ((1, 20000), (50, 100000)):
            rps = redis_rps(client(bed, runtime, f"redis{c}", cli,
                                   f"redis-benchmark -h {srv.ip} -p 6379 -t get,set -n {n} -c {c} --csv"))
            res[f"redis_c{c}_rps"] = (rps["GET"] + rps["SET"]) / 2
            res[f"redis_c{c}_get_rps"], res[f"redis_c{c}_set_rps"] = rps["GET"], rps["SET"]
        if runtime == "quark":
            from tsor.metrics import fetch, parse
            res["tsord"] = {k: v for k, v in parse(fetch(node.metrics)).items() if "connections" in k}
        return res
    finally:
        bed.close()


def two_nodes(runtime: str, pp: str, tag: str) -> dict:
    bed = Testbed(prefix=f"qc{tag}", octet=216)
    try:
        a, b = bed.node("a"), bed.node("b")
        bed.link(a, b)
        tsor = runtime == "quark"
        if tsor:
            a.start_tsord()
            b.start_tsord()
        srv, cli = b.pod("srv"), a.pod("cli")
        bed.start(runtime, "iperf-s", bed.bundle("iperf-s", ["iperf3", "-s", "-p", "5201"], srv, tsor=tsor))
        bed.start(runtime, "pp-s", bed.bundle("pp-s", [pp, "server", "7001"], srv, tsor=tsor))
        for port in (5201, 7001):
            wait_port(bed, srv, port)
        res = {}
        it = json.loads(client(bed, runtime, "iperf", cli, f"iperf3 -c {srv.ip} -p 5201 -t 5 -J"))
        res["two_node_iperf3_gbps"] = it["end"]["sum_received"]["bits_per_second"] / 1e9
        p50, p99 = map(float, client(bed, runtime, "setup", cli, f"{pp} connect {srv.ip} 7001 300").split())
        res["two_node_setup_p50_us"], res["two_node_setup_p99_us"] = p50, p99
        if tsor:
            from tsor.metrics import fetch, parse
            res["tsord"] = {k: v for k, v in parse(fetch(a.metrics)).items() if "connections" in k}
        return res
    finally:
        bed.close()


def png(path: str, ratios: list[tuple[str, float, float, str]]) -> None:
    """A bar chart without a plotting library: one bar per metric, height = quark / runc (or runc /
    quark for latencies, so higher is better everywhere); the grey tick is the goal, the dark line
    is 1.0 (parity). Bars in the order of the README table."""
    w, h, scale = 80 + 90 * len(ratios), 320, 100   # 100 px per 1.0x
    img = [[(255, 255, 255)] * w for _ in range(h)]
    base = h - 20

    def rect(x0, y0, x1, y1, color):
        for y in range(max(0, y0), min(h, y1)):
            for x in range(max(0, x0), min(w, x1)):
                img[y][x] = color
    for i, (_, ratio, goal, better) in enumerate(ratios):
        x = 50 + 90 * i
        rect(x, base - int(min(ratio, 2.9) * scale), x + 50, base, (46, 125, 50) if ratio >= goal else (198, 40, 40))
        rect(x - 5, base - int(goal * scale) - 1, x + 55, base - int(goal * scale) + 2, (120, 120, 120))
    rect(20, base - scale - 1, w - 20, base - scale + 1, (0, 0, 0))
    rect(20, base, w - 20, base + 2, (0, 0, 0))
    raw = b"".join(b"\0" + bytes(c for px in row for c in px) for row in img)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack("!I", len(data)) + kind + data + struct.pack("!I", zlib.crc32(kind + data))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack("!IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=os.path.join(REPO, "bench/results/tsor.json"))
    p.add_argument("--png", default=os.path.join(REPO, "bench/results/tsor.png"))
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/tsor.py needs root (namespaces, containers)", file=sys.stderr)
        return 1
    pp = os.path.join(REPO, "bench", ".pingpong")
    subprocess.run(["gcc", "-O2", "-o", pp, os.path.join(REPO, "bench/pingpong.c"), "-lpthread"], check=True)
    pp_in = "/repo/bench/.pingpong"
    cgroups_before = quark_cgroup_dirs()
    try:
        results = {"machine": {"kernel": platform.release(), "cpus": os.cpu_count()},
                   "one_node": {"quark_tsor_local": one_node("quark", pp_in, "q"),
                                "runc_bridge": one_node("runc", pp_in, "r")},
                   "two_nodes": {"quark_tsor_tcp": two_nodes("quark", pp_in, "q"),
                                 "runc_plain_tcp": two_nodes("runc", pp_in, "r")}}
    finally:
        remove_empty_since(cgroups_before)
    q, r = results["one_node"]["quark_tsor_local"], results["one_node"]["runc_bridge"]
    q2, r2 = results["two_nodes"]["quark_tsor_tcp"], results["two_nodes"]["runc_plain_tcp"]
    ratios = {"iperf3_gbps": q["iperf3_gbps"] / r["iperf3_gbps"],
              "rtt_p50_us": q["rtt_p50_us"] / r["rtt_p50_us"],
              "redis_c50_rps": q["redis_c50_rps"] / r["redis_c50_rps"],
              "redis_c1_rps": q["redis_c1_rps"] / r["redis_c1_rps"],
              "two_node_iperf3_gbps": q2["two_node_iperf3_gbps"] / r2["two_node_iperf3_gbps"]}
    results["ratios"] = ratios
    results["goals_met"] = {k: (v >= GOALS[k][1] if GOALS[k][0] == ">=" else v <= GOALS[k][1])
                            for k, v in ratios.items()}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    bars = [(k, v if GOALS[k][0] == ">=" else 1 / v, GOALS[k][1] if GOALS[k][0] == ">=" else 1 / GOALS[k][1], "")
            for k, v in ratios.items()]
    png(args.png, bars)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
