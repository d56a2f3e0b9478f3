"""Pod start through containerd's CRI, quark vs runc, in one containerd, interleaved.

Each run is what kubelet does for a one-container pod: RunPodSandbox (runtime handler `runc`, or
`quark` as installed: a shim and a supervisor per pod; with a supervisor per container,
`supervisor: {scope: container}`; and with one shim for the node, `shim: {scope: node}`), CreateContainer, StartContainer, then the time until the container's first output line
is in its CRI log (the file containerd writes for kubelet). Timed per phase; then the pod is torn
down (StopPodSandbox, RemovePodSandbox: timed too, apart). The containerd is tests/integration/
cri_env.py's (private, CRI plugin on, bridge CNI); the shim is the one the tests use (the C front
end of this checkout when `make frontend` built it, else the console script), or --shim-dir's.
Median, p95 and the quark/runc ratio per phase; JSON to bench/results/cri.json.
Usage (root): python bench/cri.py [--runs 20] [--shim-dir DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration import containerd_env as ce  # noqa: E402
from tests.integration import cri_env  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# what each pod is made with: CRI's runtime handler, and for quark the shim's and the supervisor's
# scope (`shim: {scope}`, `supervisor: {scope}` in quark's host configuration, rewritten before each
# pod: a shim's `start` and quark's create read it each time)
KINDS = {"quark": ("quark", "pod", "pod"), "quark_container_supervisors": ("quark", "pod", "container"),
         "quark_node_shim": ("quark", "node", "pod"), "runc": ("runc", None, None)}
PHASES = ("run_pod", "create", "start", "first_output", "total", "teardown")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def one_pod(cri, kind: str, i: int, quark_config: Path) -> dict[str, float]:
    """Seconds of each phase of one pod's start (and its teardown)."""
    handler, shim_scope, supervisor_scope = KINDS[kind]
    if shim_scope:
        quark_config.write_text(f"shim:\n  scope: {shim_scope}\nsupervisor:\n  scope: {supervisor_scope}\n")
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    pod, config = cri.run_pod(f"bench-{kind.replace('_', '-')}-{i}", handler)
    t1 = time.perf_counter()
    cid = cri.create_container(pod, config, "main", cri_env.BUSYBOX_IMAGE, ["sh", "-c", "echo ready; exec sleep 300"])
    t2 = time.perf_counter()
    cri.start_container(cid)
    t3 = time.perf_counter()
    log = os.path.join(config.log_directory, "main", "0.log")
    deadline = t3 + 60
    while True:
        try:
            with open(log, "rb") as f:
                if b" ready" in f.read():
                    break
        except FileNotFoundError:
            pass
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{handler}: no first output in {log} after 60 s")
        time.sleep(0.001)
    t4 = time.perf_counter()
    cri.teardown_pod(pod)
    t5 = time.perf_counter()
    t.update(run_pod=t1 - t0, create=t2 - t1, start=t3 - t2, first_output=t4 - t3, total=t4 - t0, teardown=t5 - t4)
    return t


def rows(samples: dict[str, list[dict[str, float]]], kind: str = "quark") -> list[dict]:
    out = []
    for phase in PHASES:
        q = [s[phase] for s in samples[kind]]
        r = [s[phase] for s in samples["runc"]]
        qm, rm = statistics.median(q), statistics.median(r)
        out.append({"phase": phase, "runs": len(q), "quark_median_ms": round(qm * 1e3, 1),
                    "quark_p95_ms": round(_pct(q, 0.95) * 1e3, 1), "runc_median_ms": round(rm * 1e3, 1),
                    "runc_p95_ms": round(_pct(r, 0.95) * 1e3, 1), "ratio": round(qm / rm, 2) if rm else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--shim-dir", help="directory holding containerd-shim-quark-v1 to use (default: the tests')")
    a = ap.parse_args()
    reason = cri_env.skip_reason()
    if reason:
        print(f"bench/cri.py: cannot run: {reason}", file=sys.stderr)
        return 1
    from tests.support.cri.client import CriClient
    d = cri_env.CriContainerd(with_quark_cni=False, shim_dir=a.shim_dir)
    quark_config = d.base / "quark-config.yaml"
    d.env["QUARK_CONFIG"] = str(quark_config)   # the shim's scope, per pod (one_pod)
    shim = os.path.join(a.shim_dir or ce._BIN, "containerd-shim-quark-v1")
    result: dict = {"command": "python bench/cri.py " + " ".join(sys.argv[1:]), "shim": os.path.realpath(shim),
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    try:
        d.start()
        d.import_images()
        with CriClient(d.address, cgroup_parent=d.cgroup_parent, log_root=str(d.log_dir)) as cri:
            for k in KINDS:               # warm-up: image snapshots, page cache, the factory
                one_pod(cri, k, -1, quark_config)
            order = list(KINDS)
            for i in range(a.runs):       # interleaved, alternating who goes first, so drift hits all alike
                for k in (order if i % 2 == 0 else order[::-1]):
                    samples[k].append(one_pod(cri, k, i, quark_config))
    finally:
        d.close()
    result["phases"] = rows(samples)
    result["phases_node_shim"] = rows(samples, "quark_node_shim")
    result["phases_container_supervisors"] = rows(samples, "quark_container_supervisors")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cri.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['command']}  ({result['date']}, shim {result['shim']})")
    for title, key in (("its defaults (a shim and a supervisor per pod)", "phases"),
                       ("a supervisor per container", "phases_container_supervisors"),
                       ("one shim for the node", "phases_node_shim")):
        print(f"quark with {title}:")
        print("| phase | runs | quark median | quark p95 | runc median | runc p95 | ratio (median) |")
        print("|---|---|---|---|---|---|---|")
        for r in result[key]:
            print(f"| {r['phase']} | {r['runs']} | {r['quark_median_ms']} ms | {r['quark_p95_ms']} ms | "
                  f"{r['runc_median_ms']} ms | {r['runc_p95_ms']} ms | {r['ratio']}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
