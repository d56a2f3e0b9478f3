"""TSoR's rdma transport between two hosts' RoCE devices, beside plain TCP between the same two
hosts: the two guests of the pair lane (tests/vm/pair.py), soft-RoCE on each, one wire.

    .venv/bin/python -m tests.vm.pair --out /tmp/pair \
        --a '.venv/bin/python bench/pair_rdma.py --json $QUARK_VM_OUT/pair_rdma.json' \
        --b '.venv/bin/python -m tests.pair.peer --no-node'
    # with the kernel's SMC-R beside them (its link comes up over rxe from 6.12 on):
    .venv/bin/python -m tests.vm.pair --kernel-suite bookworm-backports --out /tmp/pair \
        --a '.venv/bin/python bench/pair_rdma.py --smc --json $QUARK_VM_OUT/pair_rdma_smc.json' \
        --b '.venv/bin/python -m tests.pair.peer --smc --no-node'

Runs on guest a against guest b's peer (tests/pair/peer.py). The same application protocol over
each path (tests/pair/rdma_node.py's serve_app: b"S" hash what comes, b"E" echo): over plain TCP to
the peer's APP_PORT, and over one rdma link with the compiled pump (tsord's default) and with the
Python engine, the link's ends being what tsord's are (the engine, its device, one RC QP), and with
--smc over the kernel's SMC-R (AF_SMC sockets; the pair lane's set-up gives it a pnet and a UEID,
tests/support/smc.py). Rows, the
paths alternating within each run: a stream of --mib MiB (Gb/s), --streams streams of --mib MiB in all
at once (Gb/s), 64 B round trips (p50 us), and a
connection's set-up with its first round trip (p50 us). CPU per GB: the guest's busy jiffies
(/proc/stat) per GB streamed, this guest's only. Under TCG every figure is the emulator's; the
ratios between paths on the same guests are the finding, not the values.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.pair.peer import APP_PORT, SMC_APP_PORT  # noqa: E402
from tests.pair.rdma_node import PUMPS, dial  # noqa: E402
from bench.pathprobe import parallel, rtts, setups, stream  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--streams", type=int, default=8, help="the parallel row's streams (its total: --mib)")
    p.add_argument("--rtts", type=int, default=300)
    p.add_argument("--setups", type=int, default=50)
    p.add_argument("--smc", action="store_true", help="also the kernel's SMC-R (guest b's peer run with --smc)")
    p.add_argument("--json")
    a = p.parse_args()
    pair, peer = os.environ["QUARK_PAIR_DIR"], os.environ["QUARK_PAIR_PEER"]
    while not os.path.exists(os.path.join(pair, "b-ready")):
        time.sleep(0.2)
    nodes = {pump: dial(peer, pump) for pump in PUMPS}
    paths = {"tcp": lambda: socket.create_connection((peer, APP_PORT), timeout=60),
             **{f"rdma ({pump} pump)": nodes[pump][0].open for pump in PUMPS}}
    if a.smc:
        from tests.support import smc

        def over_smc() -> socket.socket:
            s = smc.smc_socket()
            smc.connect(s, peer, SMC_APP_PORT)
            return s
        paths["SMC-R"] = over_smc
    rows: dict[str, dict[str, list[float]]] = {k: {"gbps": [], "gbps_parallel": [], "cpu_s_per_gb": [], "rtt_us": [],
                                                  "setup_us": []} for k in paths}
    for _ in range(a.runs):
        for name, open_conn in paths.items():
            gbps, cpu = stream(open_conn, a.mib)
            rows[name]["gbps"].append(round(gbps, 3))
            rows[name]["cpu_s_per_gb"].append(round(cpu, 2))
            rows[name]["gbps_parallel"].append(round(parallel(open_conn, a.mib, a.streams), 3))
            rows[name]["rtt_us"].append(round(rtts(open_conn, a.rtts), 1))
            rows[name]["setup_us"].append(round(setups(open_conn, a.setups), 1))
    for node, ctl in nodes.values():
        ctl.close()
        node.close()
    res = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": a.runs, "mib": a.mib,
           "streams": a.streams,
           "kernel": os.uname().release, "paths": rows}
    tcp = rows["tcp"]
    print(f"| path | stream Gb/s (runs) | vs TCP | {a.streams} streams Gb/s | vs TCP | 64 B RTT p50 us | vs TCP "
          "| set-up p50 us | vs TCP | CPU s/GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        def ratio(key: str) -> str:
            return f"{statistics.median(r[key]) / statistics.median(tcp[key]):.2f}x"
        print(f"| {name} | {statistics.median(r['gbps']):.3f} ({', '.join(map(str, r['gbps']))}) | {ratio('gbps')} "
              f"| {statistics.median(r['gbps_parallel']):.3f} | {ratio('gbps_parallel')} "
              f"| {statistics.median(r['rtt_us']):.0f} | {ratio('rtt_us')} | {statistics.median(r['setup_us']):.0f} "
              f"| {ratio('setup_us')} | {statistics.median(r['cpu_s_per_gb']):.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    open(os.path.join(pair, "a-done"), "w").close()   # every connection closed: guest b may go
    return 0


if __name__ == "__main__":
    sys.exit(main())
