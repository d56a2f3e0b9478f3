"""What a pod costs beyond its own cgroup, through containerd's CRI: quark vs runc, per pod.

Each run starts N pods of each kind, interleaved: `runc`; `quark` as installed (a shim per pod and
one supervisor per pod, the defaults); `quark_container_supervisors`, a supervisor per container
(`supervisor: {scope: container}` in quark's host configuration); and `quark_node_shim`, one shim
for the node (`shim: {scope: node}`) and one supervisor per pod. Each is what kubelet makes of a
one-container pod: the pause sandbox and one busybox `sleep`. Once they have
all started, for each pod:

* **outside the pod's cgroup** — what the runtime spends on the pod that the pod's cgroup (and so
  its memory limit and kubelet's accounting of it) does not see: the PSS (/proc/PID/smaps_rollup)
  of the pod's shim (the node's shim: its PSS divided by the pods of the run it serves) and, for
  quark, of the supervisor of each of its two sandboxes (the pause's and the container's; one
  process for both with the pod's supervisor, counted once, as supervisor_pause), each
  with those of its descendants that are not in the pod's cgroup. The shim
  is the one the sandbox's bundle names (`shim.pid`; containerd's runc shim writes none, and it is
  the parent of the pod's processes), a supervisor the parent of its sandbox's init (the init's pid
  from CRI's verbose PodSandboxStatus / ContainerStatus, as `crictl inspect` shows it);
* **inside the pod's cgroup** — the memory the kernel charges to it (v1 memory.usage_in_bytes, v2
  memory.current) and the PSS of its processes.

PSS divides a page shared by several processes among them, so a supervisor's figure depends on
who else maps the sandbox factory's pages (docs/startup.md): measured first with the factory
running, as right after pods start, then again after the factory has been stopped, as a node sees
it once the factory has been idle long enough to exit (its pages then count on fewer processes).
The factory's own processes (and its seeds) are a node's, not a pod's: their PSS is recorded apart.

One containerd (tests/integration/cri_env.py: private, CRI plugin on, bridge CNI), one sandbox
factory of the benchmark's own (its directory under the benchmark's temporary one, stopped at the
end), the shim the tests use (the C front end when `make frontend` built it) or --shim-dir's.
Median, p95, min and max over every pod of every run; JSON to bench/results/pod_overhead.json.
Usage (root): python bench/pod_overhead.py [--pods 10] [--runs 3] [--shim-dir DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qlib import procfs  # noqa: E402
from tests.integration import containerd_env as ce  # noqa: E402
from tests.integration import cri_env  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# what each pod is made with: CRI's runtime handler, and for quark the shim's and the supervisor's
# scope (`shim: {scope}`, `supervisor: {scope}` in quark's host configuration, rewritten before each
# pod: a shim's `start` and quark's create read it each time)
KINDS = {"quark": ("quark", "pod", "pod"), "quark_container_supervisors": ("quark", "pod", "container"),
         "quark_node_shim": ("quark", "node", "pod"), "runc": ("runc", None, None)}
MiB = 1024 * 1024
SETTLE_S = 3.0   # after the last pod started: supervisors finish what start-up left to do
SHIMS_GONE_S = 30.0   # at most, after a run's pods are removed, for their shims to go


def pss_kib(pid: int) -> int | None:
    """The PSS of one process in KiB (smaps_rollup), None if it is gone."""
    try:
        return procfs.smaps_rollup(pid).get("Pss", 0)
    except (FileNotFoundError, ProcessLookupError):
        return None


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := procfs.parent_pid(entry)) is not None:
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def in_cgroup(pid: int, cgroup: str) -> bool:
    """Is `pid` in `cgroup` or below it, in any hierarchy?"""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(line.rstrip("\n").split(":", 2)[2].startswith(cgroup + "/") or
                       line.rstrip("\n").split(":", 2)[2] == cgroup for line in f)
    except OSError:
        return False


def tree_outside(root: int, cgroup: str, kids: dict[int, list[int]]) -> list[int]:
    """`root` and its descendants, less those in `cgroup` (the pod's own processes) and theirs."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if in_cgroup(pid, cgroup):
            continue
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def cgroup_memory_bytes(cgroup: str) -> int | None:
    """What the kernel charges to `cgroup` and below (v1 memory.usage_in_bytes, v2 memory.current)."""
    for path in (f"/sys/fs/cgroup/memory{cgroup}/memory.usage_in_bytes", f"/sys/fs/cgroup{cgroup}/memory.current"):
        try:
            return int(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return None


def cgroup_pids(cgroup: str) -> set[int]:
    pids: set[int] = set()
    for top in (Path(f"/sys/fs/cgroup/memory{cgroup}"), Path(f"/sys/fs/cgroup{cgroup}")):
        for procs in top.rglob("cgroup.procs") if top.is_dir() else ():
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except (OSError, ValueError):
                pass
        if pids:
            break
    return pids


def init_pid(info: dict[str, str]) -> int:
    """The init's pid from CRI's verbose status (containerd's "info" JSON)."""
    return int(json.loads(info["info"])["pid"])


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def supervisor(cd, cid: str) -> int:
    """The supervisor serving the container (its state, as quark keeps it)."""
    state = cd.state / "quark" / cri_env.NAMESPACE / cid / "state.json"
    return json.loads(state.read_text())["supervisor_pid"]


def start_pod(cri, kind: str, name: str, quark_config: Path) -> dict:
    handler, shim_scope, supervisor_scope = KINDS[kind]
    if shim_scope:
        quark_config.write_text(f"shim:\n  scope: {shim_scope}\nsupervisor:\n  scope: {supervisor_scope}\n")
    pod, config = cri.run_pod(name, handler)
    cid = cri.create_container(pod, config, "main", cri_env.BUSYBOX_IMAGE, ["sleep", "3600"])
    cri.start_container(cid)
    return {"kind": kind, "handler": handler, "pod": pod, "cid": cid, "cgroup": config.linux.cgroup_parent}


def measure(cri, cd, p: dict, kids: dict[int, list[int]], sharing: dict[int, int]) -> dict:
    """One pod's figures in MiB (see the module's docstring); `sharing`: how many of the pods
    measured each shim serves (the node's shim counts for each pod its share)."""
    from tests.support.cri import cri_v1_pb2 as pb
    pause = init_pid(cri.pod_status(p["pod"], verbose=True).info)
    app = init_pid(cri.call("ContainerStatus", pb.ContainerStatusRequest(container_id=p["cid"], verbose=True)).info)
    shim_pid_file = cd.state / "io.containerd.runtime.v2.task" / cri_env.NAMESPACE / p["pod"] / "shim.pid"
    shim = int(shim_pid_file.read_text()) if shim_pid_file.exists() else parent(pause)
    roles = {"shim": shim}
    if p["handler"] == "quark":   # (a pod's supervisor is no parent of the app's init: pod.py)
        roles |= {"supervisor_pause": supervisor(cd, p["pod"]), "supervisor_app": supervisor(cd, p["cid"])}
        if shim in (roles["supervisor_pause"], roles["supervisor_app"]):
            raise RuntimeError(f"pod {p['pod'][:12]}: the shim is a sandbox's parent, not a supervisor")
    elif parent(app) != shim:
        raise RuntimeError(f"runc pod {p['pod'][:12]}: its container's parent is not the pause's shim")
    gone = [role for role, pid in roles.items() if not os.path.exists(f"/proc/{pid}")]
    if gone:
        raise RuntimeError(f"pod {p['pod'][:12]}: no process for {', '.join(gone)}")
    seen: set[int] = set()
    out: dict = {}
    for role, root in roles.items():
        pids = [q for q in tree_outside(root, p["cgroup"], kids) if q not in seen]
        seen.update(pids)
        share = sharing.get(root, 1) if role == "shim" else 1
        out[f"{role}_mib"] = round(sum(pss_kib(q) or 0 for q in pids) / 1024 / share, 2)
        out[f"{role}_processes"] = len(pids)
        if role == "shim":
            out["shim_serves_pods"] = share
    out["outside_mib"] = round(sum(v for k, v in out.items() if k.endswith("_mib")), 2)
    inside = cgroup_pids(p["cgroup"])
    out["inside_processes"] = len(inside)
    out["inside_pss_mib"] = round(sum(pss_kib(q) or 0 for q in inside) / 1024, 2)
    usage = cgroup_memory_bytes(p["cgroup"])
    out["inside_cgroup_mib"] = round(usage / MiB, 2) if usage is not None else None
    if seen & inside:
        raise RuntimeError(f"pod {p['pod'][:12]}: a process counted both outside and inside its cgroup")
    return out


SCENARIOS = ("quark", "quark_factory_exited", "quark_container_supervisors",
             "quark_container_supervisors_factory_exited", "quark_node_shim", "quark_node_shim_factory_exited", "runc")


def _sharing(cd, pods: list[dict]) -> dict[int, int]:
    """How many of `pods` each quark shim serves (by the pid their sandbox's bundle names)."""
    counts: dict[int, int] = {}
    for p in pods:
        f = cd.state / "io.containerd.runtime.v2.task" / cri_env.NAMESPACE / p["pod"] / "shim.pid"
        if p["handler"] == "quark" and f.exists():
            pid = int(f.read_text())
            counts[pid] = counts.get(pid, 0) + 1
    return counts


def factory_pss_mib(factory_dir: str) -> float:
    """PSS of the sandbox factory's own processes (the factory, its workers, the seeds' parent and
    the seeds waiting): every process whose command line names its directory, less the supervisors
    and shims forked from it (they run with command lines of their own)."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"qvisor.factory" in b" ".join(argv) and factory_dir.encode() in b" ".join(argv):
                total += pss_kib(int(entry)) or 0
    return round(total / 1024, 2)


def stats(values: list[float]) -> dict:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": round(statistics.median(xs), 2), "p95": xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))],
            "min": xs[0], "max": xs[-1]}


def summarize(samples: list[dict]) -> dict:
    keys = sorted({k for s in samples for k in s if k.endswith("_mib")})
    return {k: stats([s.get(k) for s in samples]) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=10, help="pods per handler, running at once")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shim-dir", help="directory holding containerd-shim-quark-v1 to use (default: the tests')")
    ap.add_argument("--out", default=str(RESULTS / "pod_overhead.json"))
    a = ap.parse_args()
    reason = cri_env.skip_reason()
    if reason:
        print(f"bench/pod_overhead.py: cannot run: {reason}", file=sys.stderr)
        return 1
    from qvisor.factory import client
    from tests.support.cri.client import CriClient
    work = tempfile.mkdtemp(prefix="quark-podov-")
    factory_dir = os.path.join(work, "factory")
    os.environ["QUARK_FACTORY_DIR"] = factory_dir   # inherited by containerd, its shims and their quark
    d = cri_env.CriContainerd(with_quark_cni=False, shim_dir=a.shim_dir)
    quark_config = Path(work, "config.yaml")
    d.env["QUARK_CONFIG"] = str(quark_config)   # the shim's scope, per pod (start_pod)
    shim = os.path.join(a.shim_dir or ce._BIN, "containerd-shim-quark-v1")
    result: dict = {"command": "python bench/pod_overhead.py " + " ".join(sys.argv[1:]),
                    "shim": os.path.realpath(shim), "cpus": os.cpu_count(), "kernel": platform.release(),
                    "pods": a.pods, "runs": a.runs,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    samples: dict[str, list[dict]] = {kind: [] for kind in SCENARIOS}
    factory: list[float] = []
    factory_left: list[float] = []
    try:
        d.start()
        d.import_images()
        with CriClient(d.address, cgroup_parent=d.cgroup_parent, log_root=str(d.log_dir)) as cri:
            for run in range(a.runs):
                # warm-up: the first create of a run starts the factory; the pods then measured are
                # all made through it, as on a node that keeps starting pods
                for k in KINDS:
                    cri.teardown_pod(start_pod(cri, k, f"warm-{k}-{run}", quark_config)["pod"])
                time.sleep(1)
                order = list(KINDS)
                pods = [start_pod(cri, k, f"ov-{k.replace('_', '-')}-{run}-{i}", quark_config) for i in range(a.pods)
                        for k in (order if i % 2 == 0 else order[::-1])]
                time.sleep(SETTLE_S)
                kids = children_map()
                sharing = _sharing(d, pods)
                for p in pods:
                    samples[p["kind"]].append(measure(cri, d, p, kids, sharing) | {"run": run})
                factory.append(factory_pss_mib(factory_dir))
                client.stop(factory_dir)
                time.sleep(SETTLE_S)
                factory_left.append(factory_pss_mib(factory_dir))   # its seeds and workers went with it
                kids = children_map()
                for p in pods:
                    if p["handler"] == "quark":
                        samples[f"{p['kind']}_factory_exited"].append(measure(cri, d, p, kids, sharing) | {"run": run})
                for p in pods:
                    cri.teardown_pod(p["pod"])
                # the node's shim goes once idle (shim/serve.py): each run starts without it, as the
                # first (one left from a run whose factory was stopped shares no page with the next)
                deadline = time.monotonic() + SHIMS_GONE_S
                while d.shim_pids() and time.monotonic() < deadline:
                    time.sleep(0.2)
                med = {k: statistics.median(s["outside_mib"] for s in v if s["run"] == run) for k, v in samples.items()}
                print(f"run {run}: outside the pod's cgroup, median per pod (MiB): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    finally:
        d.close()
        client.stop(factory_dir)
        shutil.rmtree(work, ignore_errors=True)
    result["summary"] = {k: summarize(v) for k, v in samples.items()}
    result["factory_pss_mib"] = stats(factory)
    result["factory_pss_mib_after_stop"] = stats(factory_left)
    result["samples"] = samples
    out = Path(a.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    _report(result)
    return 0


def _report(result: dict) -> None:
    print(f"{result['command']}  ({result['date']}, shim {result['shim']}, {result['pods']} pods per handler "
          f"x {result['runs']} runs)")
    print("| per pod, MiB | " + " | ".join(SCENARIOS) + " |")
    print("|---" * (len(SCENARIOS) + 1) + "|")
    s = result["summary"]
    for key in ("outside_mib", "shim_mib", "supervisor_pause_mib", "supervisor_app_mib", "inside_cgroup_mib",
                "inside_pss_mib"):
        cells = []
        for scenario in SCENARIOS:
            m = s[scenario].get(key)
            cells.append(f"{m['median']} ({m['min']}-{m['max']}, p95 {m['p95']})" if m and m.get("n") else "-")
        print(f"| {key.removesuffix('_mib')} | " + " | ".join(cells) + " |")
    f = result["factory_pss_mib"]
    print(f"the factory's own processes (a node's, not a pod's): PSS median {f.get('median')} MiB; after it was "
          f"stopped: {result['factory_pss_mib_after_stop'].get('max')} MiB")


if __name__ == "__main__":
    sys.exit(main())
