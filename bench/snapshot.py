"""Hibernation (`quark snapshot`): cold start vs wake to the first HTTP response, and the memory a
hibernated container holds.

The container is tests/progs/snapshot_server.py (the host's python3, its /usr bound read-only, in a
network namespace of its own) holding --state-mib MiB of state; GET /hello touches little, GET /
digests all the state. Per run, interleaved:
  * cold start: `quark run -d` (the front end, build/bin/quark) and `runc run -d` of the same bundle
    until GET /hello answers (connects polled every 2 ms; each container deleted after, runc's at once);
  * the quark container warmed up (GET / x3), then hibernated and woken over and over, each wake
    timed from before the request's connect() (or before `quark snapshot restore` is spawned) to
    the whole response:
      1. wake-on-connect, GET /hello   (first hibernation: no working set recorded yet)
      2. restore, GET /hello           (working set: what step 1's wake touched)
      3. wake-on-connect, GET /hello   (working set: what step 2's wake touched)
      then, after an untimed GET / (so the next working set is all the state), in an order rotated
      per run: restore + GET / (working-set prefetch), restore --no-prefetch + GET /, wake-on-connect
      + GET / (prefetch, the default);
  * memory: the cgroup's before hibernation (warm_bytes), after (held_bytes, and `snapshot list`'s
    held_now_bytes), and after each wake (`quark events --stats`: memory.usage_in_bytes).
Unless --keep-page-cache, every timed wake starts right after `sync; echo 3 > drop_caches` (the
host's clean page cache dropped); cold starts run with the cache as it is. Swap: a swap file of the
bench's own (tests/support/snapshot.py's swapfile), switched off and removed at the end, always.
JSON to bench/results/snapshot.json, chart to bench/results/snapshot.png.
Usage: python bench/snapshot.py [--runs 5] [--state-mib 64] [--swap-mib 1024] [--keep-page-cache]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qlib import linux as L
from tests.cleanup import quark_cgroup_dirs, remove_empty_since
from tests.support.snapshot import SERVER, http_get, python_bundle, swapfile

ROOT_DIR = Path(__file__).resolve().parents[1]
FRONT_END = str(ROOT_DIR / "build" / "bin" / "quark")   # `make frontend`
RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
POLL_S = 0.002
WAKE_GOAL = 0.05     # wake to first response <= 5 % of quark's cold start
MEMORY_GOAL = 0.15   # hibernated <= 15 % of warm
FIRST_HELLO = "wake-on-connect GET /hello (first hibernation)"
HELLO_PREFETCHED = "wake-on-connect GET /hello (prefetch)"
# the timed wakes of GET / after a working set of all the state was recorded; rotated per run
PREFETCH_STEPS = ("restore + GET / (prefetch)", "restore --no-prefetch + GET /", "wake-on-connect GET / (prefetch)")


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Quark:
    def __init__(self, root: str, env: dict[str, str]) -> None:
        self.argv, self.env = [FRONT_END, "--root", root], env

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv + list(args), check=check, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env=self.env)

    def json(self, *args: str) -> object:
        return json.loads(self(*args).stdout)

    def memory(self, cid: str) -> int:
        """The cgroup's memory.usage_in_bytes (v2: memory.current), as `quark events --stats` reads it."""
        return self.json("events", "--stats", cid)["data"]["memory"]["usage"]["usage"]


def cold_start(argv: list[str], bundle: str, cid: str, pid_file: str, port: int,
               env: dict[str, str] | None = None) -> tuple[float, int]:
    """`run -d`, then GET /hello until it answers: (seconds, the container's init pid)."""
    t0 = time.perf_counter()
    subprocess.run(argv + ["run", "-d", "--pid-file", pid_file, "--bundle", bundle, cid], check=True, env=env,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(pid_file) as f:
        pid = int(f.read())
    deadline = time.monotonic() + 60
    while True:
        try:
            http_get(pid, port, "/hello")
            return time.perf_counter() - t0, pid
        except (ConnectionRefusedError, ConnectionResetError):
            if time.monotonic() > deadline:
                raise
            time.sleep(POLL_S)


def timed_get(pid: int, port: int, path: str) -> float:
    t0 = time.perf_counter()
    body = http_get(pid, port, path)
    took = time.perf_counter() - t0
    if path == "/":
        got = json.loads(body)
        if got["digest"] != got["expected"]:
            raise AssertionError(f"the state came back changed: {got}")
    return took


def timed_restore(q: Quark, cid: str, pid: int, port: int, path: str, prefetch: bool) -> dict:
    """`quark snapshot restore` then GET: ms in all, of the restore command, of the GET after it,
    and the supervisor's own wake (prefetch + thaw) as the command prints it."""
    t0 = time.perf_counter()
    out = q("snapshot", "restore", *([] if prefetch else ["--no-prefetch"]), cid).stdout
    cli = time.perf_counter() - t0
    get = timed_get(pid, port, path)
    return {"ms": (cli + get) * 1000, "restore_cli_ms": cli * 1000, "get_after_ms": get * 1000,
            "supervisor_wake_ms": float(out.split("woken in ")[1].split()[0])}   # "ID: woken in X ms"


class Bench:
    def __init__(self, a: argparse.Namespace, work: str, env: dict[str, str]) -> None:
        self.a, self.work = a, work
        self.q = Quark(os.path.join(work, "quark"), env)
        self.runc = ["runc", "--root", os.path.join(work, "runc")]
        self.bundle = python_bundle(os.path.join(work, "bundle"),
                                    ["python3", SERVER, str(a.port), str(a.state_mib)])
        self.quark_ids: list[str] = []
        self.runc_ids: list[str] = []

    def hibernate(self, cid: str) -> dict:
        return self.q.json("snapshot", "create", "-f", "json", cid)

    def wake(self, cid: str, pid: int, how: str, path: str) -> dict:
        """Hibernate, drop the page cache, then one timed wake + GET `path`."""
        hib = self.hibernate(cid)
        if not self.a.keep_page_cache:
            drop_page_cache()
        step: dict = {"prefetch_pages": hib["prefetch_pages"], "hibernate_ms": hib["took_ms"],
                      "warm_bytes": hib["warm_bytes"], "held_bytes": hib["held_bytes"]}
        if how == "connect":
            step["ms"] = timed_get(pid, self.a.port, path) * 1000
        else:
            step |= timed_restore(self.q, cid, pid, self.a.port, path, prefetch=how == "restore")
        step["usage_after_bytes"] = self.q.memory(cid)
        return step

    def one_run(self, i: int) -> dict:
        port = self.a.port
        run: dict = {}
        pid = 0
        for who in (("quark", "runc") if i % 2 == 0 else ("runc", "quark")):   # interleaved, order alternating
            cid, pid_file = f"snap{i}-{who}", os.path.join(self.work, f"{who}{i}.pid")
            if who == "quark":
                self.quark_ids.append(cid)
                took, pid = cold_start(self.q.argv, self.bundle, cid, pid_file, port, self.q.env)
            else:
                self.runc_ids.append(cid)
                took, _ = cold_start(self.runc, self.bundle, cid, pid_file, port)
                subprocess.run(self.runc + ["delete", "--force", cid], check=True)
                self.runc_ids.remove(cid)
                L.reap_exited()   # runc's init was re-parented to us (a subreaper)
            run[f"cold_{who}_ms"] = took * 1000
        cid = f"snap{i}-quark"
        for _ in range(3):   # warm up: every page of the state touched
            timed_get(pid, port, "/")
        run["awake_hello_ms"] = statistics.median(timed_get(pid, port, "/hello") * 1000 for _ in range(3))
        run["awake_full_ms"] = timed_get(pid, port, "/") * 1000
        # the first hibernation: the memory figures, then a wake with nothing recorded to prefetch
        first = self.hibernate(cid)
        listed = {r["id"]: r for r in self.q.json("snapshot", "list", "-f", "json")}[cid]
        run["memory"] = {"warm_bytes": first["warm_bytes"], "held_bytes": first["held_bytes"],
                         "held_now_bytes": listed["held_now_bytes"], "hibernate_ms": first["took_ms"],
                         "swap": first["swap"]}
        if not self.a.keep_page_cache:
            drop_page_cache()
        step = {"prefetch_pages": first["prefetch_pages"], "ms": timed_get(pid, port, "/hello") * 1000,
                "usage_after_bytes": self.q.memory(cid)}
        run["steps"] = {FIRST_HELLO: step}
        run["steps"]["restore + GET /hello"] = self.wake(cid, pid, "restore", "/hello")
        run["steps"][HELLO_PREFETCHED] = self.wake(cid, pid, "connect", "/hello")
        timed_get(pid, port, "/")   # untimed: the next working set is all the state
        order = PREFETCH_STEPS[i % 3:] + PREFETCH_STEPS[:i % 3]
        hows = {PREFETCH_STEPS[0]: "restore", PREFETCH_STEPS[1]: "no-prefetch", PREFETCH_STEPS[2]: "connect"}
        for name in order:
            run["steps"][name] = self.wake(cid, pid, hows[name], "/")
        run["prefetch_order"] = list(order)
        self.q("delete", "--force", cid)
        self.quark_ids.remove(cid)
        L.reap_exited()
        return run

    def cleanup(self) -> None:
        for cid in self.quark_ids:
            self.q("delete", "--force", cid, check=False)
        for cid in self.runc_ids:
            subprocess.run(self.runc + ["delete", "--force", cid], check=False, capture_output=True)
        L.reap_exited()


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 1), "min": round(min(xs), 1), "max": round(max(xs), 1)}


def summarize(runs: list[dict]) -> dict:
    cold_q = _stats([r["cold_quark_ms"] for r in runs])
    cold_r = _stats([r["cold_runc_ms"] for r in runs])
    wakes = {}
    for name in runs[0]["steps"]:
        steps = [r["steps"][name] for r in runs]
        ms = _stats([s["ms"] for s in steps])
        wakes[name] = {"ms": ms, "share_of_quark_cold": round(ms["median"] / cold_q["median"], 4),
                       "usage_after_mib": round(statistics.median(s["usage_after_bytes"] for s in steps) / MiB, 1),
                       "prefetch_pages": int(statistics.median(s["prefetch_pages"] for s in steps))}
        for part in ("restore_cli_ms", "get_after_ms", "supervisor_wake_ms"):
            if part in steps[0]:
                wakes[name][part] = _stats([s[part] for s in steps])
    warm = statistics.median(r["memory"]["warm_bytes"] for r in runs)
    memory = {}
    for key in ("warm_bytes", "held_bytes", "held_now_bytes"):
        v = statistics.median(r["memory"][key] for r in runs)
        memory[key.replace("_bytes", "_mib")] = {"mib": round(v / MiB, 1), "share_of_warm": round(v / warm, 4)}
    for name in (FIRST_HELLO, PREFETCH_STEPS[0]):
        v = statistics.median(r["steps"][name]["usage_after_bytes"] for r in runs)
        memory[f"after {name}"] = {"mib": round(v / MiB, 1), "share_of_warm": round(v / warm, 4)}
    hib_ms = [r["memory"]["hibernate_ms"] for r in runs] + [s["hibernate_ms"] for r in runs
                                                            for s in r["steps"].values() if "hibernate_ms" in s]
    cold = cold_q["median"]
    goals = {f"wake ({name}) <= 5 % of quark's cold start": {
        "share": round(wakes[name]["ms"]["median"] / cold, 4), "met": wakes[name]["ms"]["median"] <= WAKE_GOAL * cold}
        for name in (FIRST_HELLO, HELLO_PREFETCHED)}
    goals["hibernated (held_bytes) <= 15 % of warm"] = {"share": memory["held_mib"]["share_of_warm"],
                                                       "met": memory["held_mib"]["share_of_warm"] <= MEMORY_GOAL}
    return {"cold_start_ms": {"quark": cold_q, "runc": cold_r,
                              "ratio": round(cold_q["median"] / cold_r["median"], 2)},
            "awake_ms": {"GET /hello": _stats([r["awake_hello_ms"] for r in runs]),
                         "GET /": _stats([r["awake_full_ms"] for r in runs])},
            "wake_ms": wakes, "hibernate_ms": _stats(hib_ms), "memory": memory, "goals": goals}


def chart(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["summary"]
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    cache = "page cache kept" if result["keep_page_cache"] else "page cache dropped before each wake"
    fig.suptitle(f"quark hibernation: Python HTTP server, {result['state_mib']} MiB state "
                 f"(median of {result['runs']} runs; {result['machine']})", fontsize=12)
    labels = ["cold start, runc run -d", "cold start, quark run -d"] + [f"wake: {n}" for n in s["wake_ms"]] + \
        ["reference: GET / awake (its own work)"]
    values = [s["cold_start_ms"]["runc"]["median"], s["cold_start_ms"]["quark"]["median"]] + \
        [w["ms"]["median"] for w in s["wake_ms"].values()] + [s["awake_ms"]["GET /"]["median"]]
    colors = ["#999999", "#1f77b4"] + ["#2ca02c"] * len(s["wake_ms"]) + ["#dddddd"]
    y = range(len(labels))[::-1]
    ax.barh(list(y), values, color=colors)
    ax.set_xscale("log")
    for yi, v in zip(y, values):
        ax.text(v * 1.05, yi, f"{v:.1f} ms", va="center", fontsize=9)
    ax.set_yticks(list(y), labels, fontsize=9)
    goal = WAKE_GOAL * s["cold_start_ms"]["quark"]["median"]
    ax.axvline(goal, color="red", linestyle="--", label=f"goal: wake <= 5 % of quark's cold start ({goal:.0f} ms)")
    ax.set_xlabel("time to the first complete HTTP response (ms, log scale)")
    ax.set_title(f"cold start vs wake ({cache})", fontsize=10)
    ax.set_xlim(min(values + [goal]) / 2, max(values) * 3)
    ax.legend(loc="lower right", fontsize=8)
    m = s["memory"]
    mlabels = ["warm (before)", "hibernated (held_bytes)", "hibernated (snapshot list)",
               "after wake + GET /hello", "after wake + GET / (prefetch)"]
    mvals = [m["warm_mib"]["mib"], m["held_mib"]["mib"], m["held_now_mib"]["mib"],
             m[f"after {FIRST_HELLO}"]["mib"], m[f"after {PREFETCH_STEPS[0]}"]["mib"]]
    x = range(len(mlabels))
    mx.bar(list(x), mvals, color=["#1f77b4", "#2ca02c", "#2ca02c", "#ff7f0e", "#ff7f0e"])
    warm = mvals[0]
    for xi, v in zip(x, mvals):
        mx.text(xi, v + warm * 0.01, f"{v:.1f} MiB\n{v / warm:.0%}", ha="center", va="bottom", fontsize=9)
    mx.axhline(MEMORY_GOAL * warm, color="red", linestyle="--",
               label=f"goal: hibernated <= 15 % of warm ({MEMORY_GOAL * warm:.1f} MiB)")
    mx.set_xticks(list(x), mlabels, rotation=20, ha="right", fontsize=9)
    mx.set_ylabel("container cgroup memory (MiB)")
    mx.set_ylim(top=warm * 1.25)
    mx.set_title("memory of the container's cgroup (share of warm)", fontsize=10)
    mx.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--state-mib", type=int, default=64, help="the server's state (default 64)")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--swap-mib", type=int, default=1024, help="size of the bench's swap file (default 1024)")
    ap.add_argument("--swap-dir", default="/var/tmp", help="where the swap file goes (not tmpfs)")
    ap.add_argument("--keep-page-cache", action="store_true", help="do not drop the page cache before each wake")
    ap.add_argument("--json", default=str(RESULTS / "snapshot.json"))
    ap.add_argument("--png", default=str(RESULTS / "snapshot.png"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/snapshot.py needs root (containers, swapon, drop_caches)")
    from qlib import hostconfig
    from qvisor import swap
    if swap.configured_swapfile(hostconfig.path()):
        sys.exit(f"{hostconfig.path()} configures snapshot.swapfile: quark would switch that on and leave it; "
                 "run the bench with QUARK_CONFIG pointing at a config without it")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # through the finally blocks: swap off, containers gone
    L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)   # runc's orphaned inits come to us
    work = tempfile.mkdtemp(prefix="quark-bench-snapshot-")
    swap_path = os.path.join(a.swap_dir, f"quark-bench-snapshot-{os.getpid()}.swap")
    # a factory directory of the bench's own: nothing here talks to (or starts) the host's factory
    env = dict(os.environ, QUARK_FACTORY_DIR=os.path.join(work, "factory"))
    cgroups_before = quark_cgroup_dirs()
    swaps_before = swap.active_swaps()
    result: dict = {"command": "python bench/snapshot.py " + " ".join(sys.argv[1:]), "runs": a.runs,
                    "state_mib": a.state_mib, "keep_page_cache": a.keep_page_cache,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "kernel": os.uname().release,
                    "machine": f"{os.cpu_count()} cores, kernel {os.uname().release}",
                    "swap": {"file_mib": a.swap_mib, "dir": a.swap_dir, "other_swaps_active": swaps_before}}
    result["load_average_before"] = os.getloadavg()
    t_start = time.monotonic()
    try:
        with swapfile(swap_path, a.swap_mib):
            bench = Bench(a, work, env)
            try:
                result["per_run"] = [bench.one_run(i) for i in range(a.runs)]
            finally:
                bench.cleanup()
    finally:
        if os.path.exists(swap_path) and swap_path not in swap.active_swaps():
            os.unlink(swap_path)   # swapon itself failed: swapfile() leaves the file then
        from qvisor.factory import client
        client.stop(env["QUARK_FACTORY_DIR"])
        shutil.rmtree(work, ignore_errors=True)
        remove_empty_since(cgroups_before)
    result["took_s"] = round(time.monotonic() - t_start, 1)
    result["load_average_after"] = os.getloadavg()   # other work on the machine skews the figures
    result["summary"] = summarize(result["per_run"])
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    try:
        chart(result, Path(a.png))
    except ImportError:
        print(f"no chart: matplotlib is missing (make bench installs it); {a.png} not written", file=sys.stderr)
    report(result)
    return 0


def report(result: dict) -> None:
    s = result["summary"]
    c = s["cold_start_ms"]
    print(f"`{result['command']}` ({result['took_s']} s)\n")
    print("| what | median | min | max | share of quark's cold start |")
    print("|---|---|---|---|---|")
    for name, x in (("cold start, runc run -d", c["runc"]), ("cold start, quark run -d", c["quark"])):
        share = x["median"] / c["quark"]["median"]
        print(f"| {name} | {x['median']} ms | {x['min']} ms | {x['max']} ms | {share:.1%} |")
    for name, w in s["wake_ms"].items():
        x = w["ms"]
        print(f"| wake: {name} | {x['median']} ms | {x['min']} ms | {x['max']} ms | {w['share_of_quark_cold']:.1%} |")
    for name, w in s["wake_ms"].items():
        if "restore_cli_ms" in w:
            print(f"{name}: the restore command {w['restore_cli_ms']['median']} ms (supervisor's wake "
                  f"{w['supervisor_wake_ms']['median']} ms), the GET after it {w['get_after_ms']['median']} ms")
    print(f"\nawake: GET /hello {s['awake_ms']['GET /hello']['median']} ms, "
          f"GET / {s['awake_ms']['GET /']['median']} ms;"
          f" hibernating took {s['hibernate_ms']['median']} ms (median)\n")
    print("| memory | MiB | share of warm |")
    print("|---|---|---|")
    for name, m in s["memory"].items():
        print(f"| {name} | {m['mib']} | {m['share_of_warm']:.1%} |")
    print()
    for name, g in s["goals"].items():
        print(f"{name}: {g['share']:.1%} -> {'met' if g['met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
