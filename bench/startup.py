"""Container start-up, quark vs runc, side by side in one run.

Rows: `run` of a busybox bundle running /bin/true through each CLI (create + start + wait +
delete), and `ctr run --rm` of a busybox image through containerd with quark's shim vs
io.containerd.runc.v2. Medians and the quark/runc ratio; JSON to bench/results/startup.json.
Usage: python bench/startup.py [--runs N] [--no-containerd]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qvisor.busybox import make_bundle  # noqa: E402

QUARK = os.path.join(os.path.dirname(sys.executable), "quark")
RESULTS = Path(__file__).resolve().parent / "results"


def time_cli_run(argv: list[str], bundle: str, runs: int) -> list[float]:
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv + ["run", "--bundle", bundle, f"bench-{i}"], check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
        if argv[0].endswith("runc"):
            subprocess.run(argv + ["delete", "-f", f"bench-{i}"], capture_output=True)
    return times


def row(name: str, quark: list[float], ref: list[float], ref_name: str) -> dict:
    q, r = statistics.median(quark), statistics.median(ref)
    return {"benchmark": name, "reference": ref_name, "runs": len(quark), "quark_median_s": round(q, 4),
            "reference_median_s": round(r, 4), "ratio": round(q / r, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-containerd", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="quark-bench-")
    rows = []
    try:
        bundle = os.path.join(work, "bundle")
        make_bundle(bundle, ["/bin/true"])
        qroot, rroot = os.path.join(work, "quark"), os.path.join(work, "runc")
        for argv in ([QUARK, "--root", qroot], ["runc", "--root", rroot]):  # warm-up
            time_cli_run(argv, bundle, 1)
        q_times, r_times = [], []
        for _ in range(a.runs):  # interleaved, so drift hits both alike
            q_times += time_cli_run([QUARK, "--root", qroot], bundle, 1)
            r_times += time_cli_run(["runc", "--root", rroot], bundle, 1)
        rows.append(row("run /bin/true (CLI: create+start+wait+delete)", q_times, r_times, "runc 1.1"))
        if not a.no_containerd:
            from tests.integration import containerd_env as ce
            if ce.skip_reason() is None:
                cd = ce.Containerd()
                try:
                    cd.start()
                    tar = ce.busybox_image_tar(Path(work) / "busybox.tar")
                    cd.ctr("images", "import", str(tar))
                    ce.time_ctr_run_rm(cd, "io.containerd.runc.v2", 1)
                    ce.time_ctr_run_rm(cd, ce.RUNTIME, 1)
                    qs, rs = [], []
                    for i in range(a.runs):
                        rs += ce.time_ctr_run_rm(cd, "io.containerd.runc.v2", 1, )
                        qs += ce.time_ctr_run_rm(cd, ce.RUNTIME, 1)
                    rows.append(row("ctr run --rm /bin/true (containerd 1.6 shim)", qs, rs, "io.containerd.runc.v2"))
                finally:
                    cd.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| benchmark | reference | runs | quark median | reference median | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['benchmark']} | {r['reference']} | {r['runs']} | {r['quark_median_s'] * 1000:.0f} ms "
              f"| {r['reference_median_s'] * 1000:.0f} ms | {r['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
