"""Syscall interception cost, side by side (root; gcc, runc):

  untrapped  getpid() x 1e6 in a container: quark (per platform) vs runc — goal: ratio <= 1.05
  trapped    one getsockopt() round trip through QKernel, per platform: p50 / p99 in us

    .venv/bin/python bench/syscalls.py [--json out.json]

The trapped rows run through tests/progs/qkernel_harness.py (the supervisor's code path without
namespaces); the untrapped rows run real containers with `quark run` and `runc run`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = [sys.executable, os.path.join(ROOT, "tests", "progs", "qkernel_harness.py")]
QUARK = [os.path.join(os.path.dirname(sys.executable), "quark")]
PLATFORMS = ("seccomp", "ptrace")

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    long n = atol(argv[2]);
    if (!strcmp(argv[1], "getpid")) {
        double t0 = now();
        for (long i = 0; i < n; i++) syscall(SYS_getpid);
        printf("%.1f\n", (now() - t0) / n);   /* ns per call */
        return 0;
    }
    int s = socket(AF_INET, SOCK_STREAM, 0), v; socklen_t len;
    double *d = malloc(n * sizeof *d);
    for (long i = 0; i < n; i++) {
        len = sizeof v; double t0 = now();
        getsockopt(s, SOL_SOCKET, SO_TYPE, &v, &len);   /* one of the options the filter traps */
        d[i] = (now() - t0) / 1e3;
    }
    qsort(d, n, sizeof *d, cmp);
    printf("%.1f %.1f\n", d[n / 2], d[n * 99 / 100]);   /* p50 p99 us */
    return 0;
}
"""


def build(tmp: str) -> str:
    src, exe = os.path.join(tmp, "bench.c"), os.path.join(tmp, "bench")
    with open(src, "w") as f:
        f.write(PROG)
    subprocess.run(["gcc", "-O2", "-static", "-o", exe, src], check=True)
    return exe


def trapped(exe: str, platform: str, n: int) -> tuple[float, float]:
    out = subprocess.run(HARNESS + ["--platform", platform, "--", exe, "trapped", str(n)],
                         capture_output=True, text=True, check=True).stdout
    p50, p99 = map(float, out.split())
    return p50, p99


def denied_profile() -> dict:
    """An OCI seccomp profile denying what quark's base policy denies (no trapping): runc with a
    filter of the same size, to separate the cost of having a filter from quark's own work."""
    from qkernel import table
    names = sorted(sc.name for sc in table.table() if sc.fate is table.Fate.DENIED and sc.when is None
                   and sc.nr(table.native_arch()) is not None)
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": [{"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


def bundle(tmp: str, exe: str, args: list[str], seccomp: dict | None = None) -> str:
    b = os.path.join(tmp, "bundle")
    shutil.rmtree(b, ignore_errors=True)
    os.makedirs(os.path.join(b, "rootfs"))
    shutil.copy(exe, os.path.join(b, "rootfs", "bench"))
    subprocess.run(["runc", "spec"], cwd=b, check=True)
    with open(os.path.join(b, "config.json")) as f:
        spec = json.load(f)
    spec["process"].update(args=["/bench", *args], terminal=False)
    if seccomp is not None:
        spec["linux"]["seccomp"] = seccomp
    with open(os.path.join(b, "config.json"), "w") as f:
        json.dump(spec, f)
    return b


def in_container(tmp: str, exe: str, runtime: str, platform: str | None, n: int) -> float:
    b = bundle(tmp, exe, ["getpid", str(n)], denied_profile() if platform == "profile" else None)
    cid = f"bench-{os.getpid()}"
    state = os.path.join(tmp, "state")
    if runtime == "runc":
        cmd = ["runc", "--root", state, "run", "-b", b, cid]
    else:
        cmd = QUARK + ["--root", state, "--platform", platform, "run", "-b", b, cid]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    return float(out.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--getpid-n", type=int, default=1_000_000)
    p.add_argument("--trapped-n", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5, help="containers per row; the best is kept")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results: dict = {"untrapped_getpid_ns": {}, "trapped_getsockopt_us": {}}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        rows = [("runc", None), ("runc", "profile")] + [("quark", pl) for pl in PLATFORMS]
        for runtime, platform in rows:
            name = {None: "runc", "profile": "runc + profile of quark's denials"}.get(platform, f"quark/{platform}")
            results["untrapped_getpid_ns"][name] = min(
                in_container(tmp, exe, runtime, platform, args.getpid_n) for _ in range(args.repeat))
        for platform in PLATFORMS:
            p50, p99 = trapped(exe, platform, args.trapped_n)
            results["trapped_getsockopt_us"][platform] = {"p50": p50, "p99": p99}
    runc_ns = results["untrapped_getpid_ns"]["runc"]
    print(f"untrapped getpid x {args.getpid_n:.0e} (ns/call, best of {args.repeat})")
    print("| runtime | ns/call | ratio vs runc |\n|---|---|---|")
    for name, ns in results["untrapped_getpid_ns"].items():
        print(f"| {name} | {ns:.1f} | {ns / runc_ns:.3f} |")
    print(f"\ntrapped getsockopt round trip x {args.trapped_n} (us)")
    print("| platform | p50 | p99 |\n|---|---|---|")
    for platform, r in results["trapped_getsockopt_us"].items():
        print(f"| {platform} | {r['p50']:.1f} | {r['p99']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
