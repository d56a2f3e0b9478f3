"""Container start-up, quark vs runc, side by side in one run.

N x (create, start, wait, delete), and N x a foreground `run` (create, start, wait, delete in one
call, as a user types it), of /bin/true in one busybox bundle, interleaved, with: quark as
installed on PATH (the C front end, qvisor/frontend.c, and the sandbox factory, qvisor/factory/),
quark without the factory (the Python CLI for every verb, QUARK_FACTORY=0: how quark ran before the
factory), and runc; median and p95 of each phase and the ratios to runc. The supervisors' resident
(RSS) and proportional (PSS) memory per sandbox over --sandboxes running sandboxes, with and
without the factory, and with the factory and supervisor.memory_merge after the host's ksmd has
merged what the supervisors offer (only on a host whose KSM is off: the bench runs ksmd from then
until the sandboxes are gone, then unmerges and stops it; tests/support/ksm.py). `ctr run --rm` of a busybox image through containerd with quark's shim vs
io.containerd.runc.v2. JSON to bench/results/startup.json.
Usage: python bench/startup.py [--runs 50] [--ctr-runs 20] [--sandboxes 50] [--no-containerd] [--lifecycle-only]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qlib import linux as L
from qlib.procfs import parent_pid, smaps_rollup  # noqa: E402
from tests.cleanup import quark_cgroup_dirs, remove_empty_since  # noqa: E402
from tests.support import ksm  # noqa: E402
from tests.support.busybox import make_bundle  # noqa: E402

ROOT_DIR = Path(__file__).resolve().parents[1]
QUARK_PY = os.path.join(os.path.dirname(sys.executable), "quark")
FRONT_END = str(ROOT_DIR / "qvisor" / "_quark")   # `make frontend`
RESULTS = Path(__file__).resolve().parent / "results"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def lifecycle(argv: list[str], bundle: str, cid: str, env: dict | None = None,
              marks: dict | None = None) -> dict[str, float]:
    """create, start, wait (pidfd poll on the init, the same for all), delete: seconds each.
    `marks` gets the CLOCK_MONOTONIC times at which create and start were called and returned."""
    t = {}
    t0 = time.perf_counter()
    m0 = time.monotonic()
    subprocess.run(argv + ["create", "--bundle", bundle, cid], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    t["create"] = time.perf_counter() - t0
    if marks is not None:
        marks.update(create_called=m0, create_returned=time.monotonic())
    pid = json.loads(subprocess.run(argv + ["state", cid], check=True, capture_output=True, env=env).stdout)["pid"]
    pidfd = os.pidfd_open(pid)   # before start: /bin/true may be gone before we look
    t0 = time.perf_counter()
    m0 = time.monotonic()
    subprocess.run(argv + ["start", cid], check=True, env=env)
    t["start"] = time.perf_counter() - t0
    if marks is not None:
        marks.update(start_called=m0, start_returned=time.monotonic())
    t0 = time.perf_counter()
    select.select([pidfd], [], [], 10)
    t["wait"] = time.perf_counter() - t0
    os.close(pidfd)
    L.reap_exited()   # runc's init is re-parented to us (a subreaper): collect it
    t0 = time.perf_counter()
    subprocess.run(argv + ["delete", cid], check=True, env=env)
    t["delete"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    return t


def time_run(argv: list[str], bundle: str, cid: str, env: dict | None = None) -> float:
    """A foreground `run` of the bundle (its process /bin/true): seconds until the call returns,
    the container deleted (runc's run deletes too, without --keep)."""
    t0 = time.perf_counter()
    subprocess.run(argv + ["run", "--bundle", bundle, cid], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, env=env)
    took = time.perf_counter() - t0
    L.reap_exited()
    return took


# (name, from, to): the steps of create and start, from the supervisor's QUARK_PHASES record
# (qvisor/phases.py) and the times the benchmark called and got back from `quark create`/`start`
BREAKDOWN = [
    ("create: client to verb (front end, factory checks, worker; or interpreter + imports)", "create_called", "verb"),
    ("create: verb to supervisor (spec, state dir, fork: one in a factory worker, two from the CLI)", "verb",
     "supervisor"),
    ("create: cgroup set-up, stage 1 fork, unshare, init fork", "supervisor", "namespaces"),
    ("create: rootfs (mounts, /proc view, pivot_root, hooks)", "namespaces", "rootfs"),
    ("create: state saved, control socket, supervisor confined", "rootfs", "created"),
    ("create: report back to the caller", "created", "create_returned"),
    ("start: client to supervisor", "start_called", "start"),
    ("start: capabilities, user, seccomp filters", "start", "filter"),
    ("start: close fds, exec, the supervisor sees it", "filter", "exec"),
    ("start: report back to the caller", "exec", "start_returned"),
]


def breakdown(records: list[dict]) -> list[dict]:
    rows = []
    for name, a, b in BREAKDOWN:
        xs = [r[b] - r[a] for r in records if a in r and b in r]
        if xs:
            rows.append({"phase": name, "runs": len(xs), "median_ms": round(statistics.median(xs) * 1000, 2),
                         "p95_ms": round(_pct(xs, 0.95) * 1000, 2)})
    return rows


def _phases(where: str, cid: str, marks: dict) -> dict:
    try:
        with open(os.path.join(where, f"{cid}.json")) as f:
            return json.load(f) | marks
    except (OSError, ValueError):
        return marks


def phase_rows(q: list[dict], nf: list[dict], r: list[dict]) -> list[dict]:
    rows = []
    for phase in ("create", "start", "wait", "delete", "total", "run"):
        qs, ns, rs = [x[phase] for x in q], [x[phase] for x in nf], [x[phase] for x in r]
        rows.append({"phase": phase, "runs": len(qs),
                     "quark_median_ms": round(statistics.median(qs) * 1000, 1),
                     "quark_p95_ms": round(_pct(qs, 0.95) * 1000, 1),
                     "no_factory_median_ms": round(statistics.median(ns) * 1000, 1),
                     "runc_median_ms": round(statistics.median(rs) * 1000, 1),
                     "runc_p95_ms": round(_pct(rs, 0.95) * 1000, 1),
                     "ratio": round(statistics.median(qs) / statistics.median(rs), 2),
                     "no_factory_ratio": round(statistics.median(ns) / statistics.median(rs), 2)})
    return rows


def supervisor_memory(argv: list[str], bundle: str, n: int, env: dict | None = None, merge: bool = False) -> dict:
    """Resident and proportional memory of the supervisors of n running sandboxes; `merge`: with the
    host's ksmd run (tests/support/ksm.py) until it has merged what they offer (env's config has
    supervisor.memory_merge)."""
    rss, pss = [], []
    merged: dict = {}
    with contextlib.ExitStack() as ksmd:   # closed after the sandboxes are deleted: unmerged, ksmd off
        try:
            for i in range(n):
                subprocess.run(argv + ["create", "--bundle", bundle, f"mem-{i}"], check=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
                subprocess.run(argv + ["start", f"mem-{i}"], check=True, env=env)
            if merge:   # what ksmd takes to merge them: three scans of everything
                cpu0, t0 = ksm.ksmd_cpu_s(), time.monotonic()
                ksmd.enter_context(ksm.running())
                ksm.wait_full_scans(3)
                merged = {"ksmd_seconds": round(time.monotonic() - t0, 1),
                          "ksmd_cpu_s": round(ksm.ksmd_cpu_s() - cpu0, 2),
                          "pages_shared": int(ksm.read("pages_shared")),
                          "pages_sharing": int(ksm.read("pages_sharing"))}
            for i in range(n):
                init = json.loads(subprocess.run(argv + ["state", f"mem-{i}"], check=True,
                                                 capture_output=True, env=env).stdout)["pid"]
                sup = parent_pid(init)
                fields = smaps_rollup(sup)
                rss.append(fields["Rss"] / 1024)
                pss.append(fields["Pss"] / 1024)
        finally:
            for i in range(n):
                subprocess.run(argv + ["delete", "--force", f"mem-{i}"], capture_output=True, env=env)
    return {"sandboxes": n, "rss_median_mib": round(statistics.median(rss), 1),
            "pss_median_mib": round(statistics.median(pss), 1), "pss_total_mib": round(sum(pss), 1), **merged}


def time_ctr(runs: int, work: str, env: dict[str, str]) -> dict | None:
    """`ctr run --rm` with quark's shim vs runc's, through one containerd started with `env` (its
    shims and everything they run inherit it: the factory's directory, or QUARK_FACTORY=0)."""
    from tests.integration import containerd_env as ce
    if ce.skip_reason() is not None:
        return None
    cd = ce.Containerd()
    cd.env.update(env)   # containerd's environment, before it starts
    try:
        cd.start()
        tar = ce.busybox_image_tar(Path(work) / "busybox.tar")
        cd.ctr("images", "import", str(tar))
        ce.time_ctr_run_rm(cd, "io.containerd.runc.v2", 1)   # warm-up
        ce.time_ctr_run_rm(cd, ce.RUNTIME, 1)
        qs, rs = [], []
        for _ in range(runs):
            rs += ce.time_ctr_run_rm(cd, "io.containerd.runc.v2", 1)
            qs += ce.time_ctr_run_rm(cd, ce.RUNTIME, 1)
    finally:
        cd.close()
    return {"runs": runs, "quark_median_ms": round(statistics.median(qs) * 1000, 1),
            "quark_p95_ms": round(_pct(qs, 0.95) * 1000, 1),
            "runc_median_ms": round(statistics.median(rs) * 1000, 1),
            "runc_p95_ms": round(_pct(rs, 0.95) * 1000, 1),
            "ratio": round(statistics.median(qs) / statistics.median(rs), 2)}


HOT_VERBS = ("start", "state", "kill", "delete", "pause", "resume", "ps")


def import_times(runs: int = 3) -> list[dict]:
    """The Python CLI's import time per hot verb (`python -X importtime`, the sum of the top-level
    imports' cumulative times; the median of `runs`): what each verb costs without the factory
    before it does any work. The verb runs against a root that does not exist, so it fails at once."""
    rows = []
    for verb in HOT_VERBS:
        totals, spec, seccomp = [], False, False
        for _ in range(runs):
            err = subprocess.run([sys.executable, "-X", "importtime", QUARK_PY, "--root", "/nonexistent/quark-bench",
                                  verb, "x"], capture_output=True, text=True, env=dict(os.environ, QUARK_FACTORY="0")
                                 ).stderr
            total = 0
            for line in err.splitlines():
                if line.startswith("import time:") and "|" in line:
                    _, cumulative, name = line.split("|")
                    if not cumulative.strip().isdigit():
                        continue   # the header line
                    if name.strip() and not name.startswith("  "):   # a top-level import
                        total += int(cumulative)
                    spec = spec or name.strip() == "qvisor.spec.model"
                    seccomp = seccomp or name.strip() == "seccomp"
            totals.append(total / 1000)
        rows.append({"verb": verb, "imports_ms": round(statistics.median(totals), 1),
                     "spec_model": spec, "libseccomp": seccomp})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--ctr-runs", type=int, default=20)
    ap.add_argument("--sandboxes", type=int, default=50, help="for the supervisor memory figure")
    ap.add_argument("--no-containerd", action="store_true")
    ap.add_argument("--lifecycle-only", action="store_true",
                    help="only the lifecycle and run rows (no imports, memory or containerd figures)")
    a = ap.parse_args()
    L.prctl(L.PR_SET_CHILD_SUBREAPER, 1)   # runc's orphaned inits come to us
    work = tempfile.mkdtemp(prefix="quark-bench-")
    result: dict = {"command": "python bench/startup.py " + " ".join(sys.argv[1:])}
    cgroups_before = quark_cgroup_dirs()
    # a factory of the benchmark's own (its directory, started by the first create, stopped at the end)
    phases_dir = os.path.join(work, "phases")
    os.makedirs(phases_dir)
    with_factory = dict(os.environ, QUARK_FACTORY_DIR=os.path.join(work, "factory"), QUARK_FACTORY="1",
                        QUARK_PHASES=phases_dir)
    no_factory = dict(os.environ, QUARK_FACTORY="0", QUARK_PHASES=phases_dir)
    front = FRONT_END if os.access(FRONT_END, os.X_OK) else QUARK_PY
    result["front_end"] = front
    try:
        bundle = os.path.join(work, "bundle")
        make_bundle(bundle, ["/bin/true"])
        quark, runc = [front, "--root", os.path.join(work, "quark")], ["runc", "--root", os.path.join(work, "runc")]
        slow = [QUARK_PY, "--root", os.path.join(work, "quark")]
        lifecycle(quark, bundle, "warm", with_factory)   # starts the factory
        time.sleep(1)
        lifecycle(quark, bundle, "warm", with_factory)
        lifecycle(slow, bundle, "warm", no_factory)
        lifecycle(runc, bundle, "warm")
        for argv, env in ((quark, with_factory), (slow, no_factory), (runc, None)):
            time_run(argv, bundle, "warm-run", env)
        q, nf, r = [], [], []
        qp, nfp = [], []
        for i in range(a.runs):   # interleaved, so drift hits all alike
            marks: dict = {}
            q.append(lifecycle(quark, bundle, f"b{i}", with_factory, marks))
            qp.append(_phases(phases_dir, f"b{i}", marks))
            marks = {}
            nf.append(lifecycle(slow, bundle, f"nf{i}", no_factory, marks))
            nfp.append(_phases(phases_dir, f"nf{i}", marks))
            r.append(lifecycle(runc, bundle, f"b{i}"))
            q[-1]["run"] = time_run(quark, bundle, f"r{i}", with_factory)
            nf[-1]["run"] = time_run(slow, bundle, f"nfr{i}", no_factory)
            r[-1]["run"] = time_run(runc, bundle, f"r{i}")
        result["lifecycle"] = phase_rows(q, nf, r)
        if a.lifecycle_only:
            return _report(result)
        result["imports"] = import_times()
        result["breakdown"] = breakdown(qp)
        result["breakdown_no_factory"] = breakdown(nfp)
        sleeper = os.path.join(work, "sleeper")
        make_bundle(sleeper, ["sleep", "1000"])
        result["supervisor_memory"] = supervisor_memory(
            [front, "--root", os.path.join(work, "mem")], sleeper, a.sandboxes, with_factory)
        merge_config = os.path.join(work, "config.yaml")
        with open(merge_config, "w") as f:
            f.write("supervisor:\n  memory_merge: true\n")
        try:
            result["supervisor_memory_ksm"] = supervisor_memory(
                [front, "--root", os.path.join(work, "mem")], sleeper, a.sandboxes,
                dict(with_factory, QUARK_CONFIG=merge_config), merge=True)
        except (OSError, ksm.InUse) as e:   # no KSM here, or the host uses it: said, not measured
            result["supervisor_memory_ksm"] = {"not_measured": str(e)}
        result["supervisor_memory_no_factory"] = supervisor_memory(
            [QUARK_PY, "--root", os.path.join(work, "mem")], sleeper, min(a.sandboxes, 10), no_factory)
        if not a.no_containerd:
            result["ctr_run_rm"] = time_ctr(a.ctr_runs, work, {k: with_factory[k] for k in ("QUARK_FACTORY_DIR",
                                                                                          "QUARK_FACTORY")})
            result["ctr_run_rm_no_factory"] = time_ctr(a.ctr_runs, work, {"QUARK_FACTORY": "0"})
    finally:
        from qvisor.factory import client
        client.stop(with_factory["QUARK_FACTORY_DIR"])
        shutil.rmtree(work, ignore_errors=True)
        remove_empty_since(cgroups_before)
    return _report(result)


def _report(result: dict) -> int:
    RESULTS.mkdir(exist_ok=True)
    name = "startup_lifecycle.json" if "imports" not in result else "startup.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"`{result['command']}`\n")
    print("| phase | runs | quark median | quark p95 | no factory median | runc median | runc p95 "
          "| ratio (median) | no factory ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in result["lifecycle"]:
        print(f"| {x['phase']} | {x['runs']} | {x['quark_median_ms']} ms | {x['quark_p95_ms']} ms "
              f"| {x['no_factory_median_ms']} ms | {x['runc_median_ms']} ms | {x['runc_p95_ms']} ms "
              f"| {x['ratio']:.2f}x | {x['no_factory_ratio']:.2f}x |")
    c, n = result.get("ctr_run_rm"), result.get("ctr_run_rm_no_factory")
    if c and n:
        print(f"| ctr run --rm (quark shim vs io.containerd.runc.v2) | {c['runs']} | {c['quark_median_ms']} ms "
              f"| {c['quark_p95_ms']} ms | {n['quark_median_ms']} ms | {c['runc_median_ms']} ms "
              f"| {c['runc_p95_ms']} ms | {c['ratio']:.2f}x | {n['ratio']:.2f}x |")
    if "imports" not in result:
        return 0
    print("\n| step (quark with the factory) | median | p95 | without the factory: median |")
    print("|---|---|---|---|")
    slow_steps = {x["phase"]: x for x in result["breakdown_no_factory"]}
    for x in result["breakdown"]:
        other = slow_steps.get(x["phase"], {}).get("median_ms", "")
        print(f"| {x['phase']} | {x['median_ms']} ms | {x['p95_ms']} ms | {other} ms |")
    print("\n| verb (Python CLI, no factory) | imports | imports the spec model | imports libseccomp |")
    print("|---|---|---|---|")
    for x in result["imports"]:
        print(f"| {x['verb']} | {x['imports_ms']} ms | {'yes' if x['spec_model'] else 'no'} "
              f"| {'yes' if x['libseccomp'] else 'no'} |")
    for key, what in (("supervisor_memory", "with the factory"),
                      ("supervisor_memory_ksm", "with the factory, supervisor.memory_merge and ksmd"),
                      ("supervisor_memory_no_factory", "without")):
        m = result[key]
        if "not_measured" in m:
            print(f"\nsupervisor memory {what}: not measured ({m['not_measured']})")
            continue
        print(f"\nsupervisor memory {what} ({m['sandboxes']} sandboxes): RSS median {m['rss_median_mib']} MiB, "
              f"PSS median {m['pss_median_mib']} MiB, PSS total {m['pss_total_mib']} MiB"
              + (f"; ksmd {m['ksmd_cpu_s']} s CPU over {m['ksmd_seconds']} s to merge" if "ksmd_cpu_s" in m else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
