"""`podman run --rm IMAGE true` and `docker run --rm --runtime R IMAGE true`, quark vs runc,
alternating in one run, as a user of those clients times them.

podman and dockerd are tests/support/managers.py's (private storage, data and exec roots, no bridge,
`--iptables=false`); the image is a busybox root imported locally. quark is this checkout's front
end. Each client is timed in two conditions: with no sandbox factory running when it starts (what a
host that only ever runs quark under these managers has: none is started from under conmon; under
containerd's runc shim, docker's, the first create starts one), and with one started from outside
them (a shell's `quark` call, quark's containerd shim or a service does it). Median,
p90 and the quark/runc ratio of the medians; JSON to bench/results/managers.json.
Usage (root): python bench/managers.py [--runs 20]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qvisor.factory import client  # noqa: E402
from tests.integration.conftest import QUARK  # noqa: E402
from tests.support import managers  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NET = ["--network", "none"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def timed(argv: list[str], env: dict | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    t = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr}")
    return t


def measure(commands: dict[str, tuple[list[str], dict | None]], runs: int) -> dict[str, list[float]]:
    """Seconds per run of each command, the commands alternating (one warm-up each first)."""
    for argv, env in commands.values():
        timed(argv, env)
    out: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, (argv, env) in commands.items():
            out[name].append(timed(argv, env))
    return out


def summary(samples: dict[str, list[float]]) -> dict:
    row = {name: {"median_ms": statistics.median(xs) * 1e3, "p90_ms": _pct(xs, 0.9) * 1e3,
                  "min_ms": min(xs) * 1e3, "runs": len(xs)} for name, xs in samples.items()}
    row["ratio_median"] = row["quark"]["median_ms"] / row["runc"]["median_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    workdir = Path(__import__("tempfile").mkdtemp(prefix="qbm-", dir="/tmp"))
    tar = managers.image_tar(workdir / "busybox.tar")
    podman = managers.Podman({"runc": managers.RUNC, "quark": QUARK[0]})
    dockerd = managers.Dockerd({"quark": QUARK[0]})
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                     "runs": args.runs, "command": f"python bench/managers.py --runs {args.runs}"}
    client.stop()   # start from no factory, whoever started one (the next quark call starts one again)
    try:
        podman(["import", str(tar), managers.IMAGE])
        dockerd.start()
        dockerd(["import", str(tar), managers.IMAGE])
        docker = [managers.DOCKER, "-H", f"unix://{dockerd.socket}"]
        commands = {
            "podman": {rt: (podman.argv(["run", "--rm", *NET, managers.IMAGE, "true"], path), podman.env)
                       for rt, path in podman.runtimes.items()},
            "docker": {rt: (docker + ["run", "--rm", "--runtime", rt, *NET, managers.IMAGE, "true"], None)
                       for rt in ("runc", "quark")},
        }
        for condition in ("no factory", "factory running"):
            if condition == "factory running":
                client.ensure_running()
                time.sleep(3)   # it loads and forks its first spare worker and seed
            for name, cmds in commands.items():
                row = summary(measure(cmds, args.runs))
                results.setdefault(name, {})[condition] = row
                print(f"{name:7} {condition:16} quark {row['quark']['median_ms']:7.1f} ms (p90 "
                      f"{row['quark']['p90_ms']:7.1f})  runc {row['runc']['median_ms']:7.1f} ms (p90 "
                      f"{row['runc']['p90_ms']:7.1f})  ratio {row['ratio_median']:.2f}x", flush=True)
    finally:
        dockerd.close()
        podman.close()
        client.stop()   # the one this bench started
        subprocess.run(["rm", "-rf", str(workdir)])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "managers.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
