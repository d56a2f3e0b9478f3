"""The kernel-chosen remote path (tsor/remote_path.py) between the pair lane's two guests, beside the
same connection made natively: a quark pod on node a (its connects sent to the pump by the kernel,
carried over the RDMA link, connected to the pod by b's pump) and a runc pod on the same node
(plain TCP over the same wire and routes), both dialling one quark pod on node b.

    .venv/bin/python -m tests.vm.pair --out /tmp/pair \
        --a '.venv/bin/python bench/pair_remote_path.py --json $QUARK_VM_OUT/pair_remote_path.json'

Each run starts one container per pod that measures from inside it (bench/pathprobe.py): one
stream of --mib MiB, --setups connections' set-up with their first one-byte round trip (p50), and
--rtts 64-byte round trips on one connection (p50); the two pods alternate, --runs times. Under TCG
every figure is the emulator's and the soft-RoCE round trip (tests/vm/README.md) bounds the rdma
side; the ratios on the same guests are the finding.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.pair import remote_node  # noqa: E402
from tsor.metrics import fetch, parse  # noqa: E402

KEYS = ("setup_us", "rtt_us", "gbps", "cpu_s_per_gb")


def probe(a: remote_node.PairNode, runtime: str, pod, name: str, server_ip: str, args: list[str]) -> dict:
    bundle = a.bed.bundle(name, ["python3", "/repo/bench/pathprobe.py", server_ip, str(remote_node.SERVER_PORT),
                                 *args], pod, tsor=runtime == "quark")
    r = a.bed.run(runtime, name, bundle, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"{runtime} probe exited {r.returncode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--setups", type=int, default=50)
    p.add_argument("--rtts", type=int, default=200)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    node = remote_node.PairNode("a", *remote_node.wire())
    try:
        server_ip = remote_node.wait_for_b(node)
        pods = {"quark": node.node.pod("q"), "runc": node.node.pod("r")}
        args = ["--mib", str(a.mib), "--setups", str(a.setups), "--rtts", str(a.rtts)]
        res: dict[str, dict[str, list[float]]] = {rt: {k: [] for k in KEYS} for rt in pods}
        before = parse(fetch(node.node.metrics)).get("tsor_remote_path_accepted", 0)
        for i in range(a.runs):
            for rt in (("quark", "runc") if i % 2 == 0 else ("runc", "quark")):
                got = probe(node, rt, pods[rt], f"{rt}{i}", server_ip, args)
                for k in KEYS:
                    res[rt][k].append(round(got[k], 3))
        carried = parse(fetch(node.node.metrics)).get("tsor_remote_path_accepted", 0) - before
    finally:
        node.close()
    out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kernel": os.uname().release,
           "runs": a.runs, "mib": a.mib, "setups": a.setups, "rtts": a.rtts, "results": res,
           # every quark connection went through the pump: one stream, the set-ups, one rtt connection per run
           "quark_connections_carried": carried, "quark_connections_made": a.runs * (a.setups + 2)}
    print(json.dumps(out, indent=1))
    q, r = res["quark"], res["runc"]
    print("| | quark pod, remote path | runc pod, plain TCP | ratio |\n|---|---|---|---|")
    for k in KEYS:
        mq, mr = statistics.median(q[k]), statistics.median(r[k])
        print(f"| {k} | {mq:.3f} ({', '.join(map(str, q[k]))}) | {mr:.3f} ({', '.join(map(str, r[k]))}) "
              f"| {mq / mr:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
