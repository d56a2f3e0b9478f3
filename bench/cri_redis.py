"""redis-benchmark between two pods through CRI, quark (TSoR's local path) vs runc (bridge CNI).

Each run starts, through containerd's CRI as kubelet does, a redis-server pod and a
redis-benchmark pod with one handler (`quark` or `runc`), runs `redis-benchmark -t get,set --csv`
at -c 50 and -c 1 against the server pod's IP, and tears both pods down; the handlers are
interleaved, alternating which goes first. One containerd (tests/integration/cri_env.py: private,
CRI plugin on, bridge + host-local CNI with quark-cni chained after them, failing closed) and one
tsord of the benchmark's own (no --debug, as a node runs it); the quark pods carry the annotation
naming it (`io.quark.tsor.socket`), so their connections take TSoR's local path: tsord's
tsor_connections_total{path="local"} is recorded per run to show it. With `--local-path sockmap`
that tsord runs tsor.yaml's `local_path: sockmap` (nothing trapped; the kernel's TCP makes the
connection and SK_MSG moves its bytes socket to socket): the bytes that crossed the server pod's
eth0 per request (recorded for every run, both handlers) show which connections skipped the veth.
The image is busybox plus the
host's redis-server / redis-benchmark and their shared objects, built here (nothing is pulled).
Also recorded, per 10,000 requests: the CPU time of both pods' cgroups (cpuacct: the containers'
processes), of quark's supervisors (which run outside the pods' cgroups; runc has none in the data
path) and of tsord.
Each run also measures the kernel alone (bench/bare_redis.py): the same binaries with no container,
in two network namespaces on a CNI bridge, over a unix socket and over veth + bridge; that ratio is
the most a runtime handing its pods AF_UNIX ends can show here (at -c 50, the goal's row).
Median of the runs, per-run ratio quark/runc (GET/SET mean); JSON to bench/results/cri_redis.json
(cri_redis_sockmap.json with `--local-path sockmap`).
Usage (root): python bench/cri_redis.py [--runs 5] [--n50 100000] [--n1 20000] [--local-path sockmap]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration import containerd_env as ce  # noqa: E402
from tests.integration import cri_env  # noqa: E402
from tests.support.testbed import eth0_bytes  # noqa: E402

from bare_redis import VIAS, BareRedis, redis_rps  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HANDLERS = ("quark", "runc")
GOAL_C50 = 1.5
SERVER = ["redis-server", "--port", "6379", "--save", "", "--appendonly", "no", "--protected-mode", "no"]


def cgroup_cpu_s(cgroup: str) -> float:
    """CPU seconds of every process that ran in `cgroup` (cgroup v1 cpuacct, else v2 cpu.stat)."""
    try:
        return int(Path(f"/sys/fs/cgroup/cpuacct{cgroup}/cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        pass
    try:
        stat = dict(line.split() for line in Path(f"/sys/fs/cgroup{cgroup}/cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    except (OSError, KeyError, ValueError):
        return float("nan")


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def supervisors_cpu_s(cd) -> float:
    """CPU seconds so far of quark's supervisors serving this containerd (argv[0] `quark`, its state
    tree in argv): they run outside the pods' cgroups, so cpuacct does not see them."""
    marker, total = str(cd.base).encode(), 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if argv[0] == b"quark" and any(marker in a for a in argv):
                    total += proc_cpu_s(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return total


def wait(what: str, predicate, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_to_exit(cri, pod: str, config, name: str, command: list[str], timeout: float = 300) -> str:
    """A container of the redis image in `pod` running `command` to its end: its log's text."""
    from tests.support.cri import cri_v1_pb2 as pb
    cid = cri.create_container(pod, config, name, cri_env.REDIS_IMAGE, command)
    cri.start_container(cid)
    st = wait(f"{name} to exit", lambda: (lambda s: s if s.state == pb.CONTAINER_EXITED else None)(
        cri.container_status(cid)), timeout)
    with open(os.path.join(config.log_directory, name, "0.log"), encoding="utf-8") as f:
        out = "".join(line.split(" ", 3)[3] + "\n" for line in f.read().splitlines() if line.count(" ") >= 3)
    if st.exit_code != 0:
        raise RuntimeError(f"{name} exited {st.exit_code}: {out[-2000:]}")
    return out


def one_run(cri, cd, tsord, handler: str, i: int, sizes: dict[int, int]) -> dict:
    """Server pod + client pod of `handler`; redis-benchmark at each concurrency; both pods removed."""
    from tsor import SOCKET_ANNOTATION
    annotations = {SOCKET_ANNOTATION: tsord.socket} if handler == "quark" else {}
    srv, srv_conf = cri.run_pod(f"redis-{handler}-{i}", handler, annotations=annotations)
    cli, cli_conf = cri.run_pod(f"rbench-{handler}-{i}", handler, annotations=annotations)
    try:
        ip = cri.pod_status(srv).status.network.ip
        cid = cri.create_container(srv, srv_conf, "redis", cri_env.REDIS_IMAGE, SERVER)
        cri.start_container(cid)
        wait("redis-server", lambda: cri.exec_sync(cid, ["sh", "-c", "netstat -ltn | grep -q :6379"]).exit_code == 0)
        groups = [srv_conf.linux.cgroup_parent, cli_conf.linux.cgroup_parent]
        netns = tsord.registered()[srv]["netns"]   # quark-cni registered it (every pod of the conflist)
        out: dict = {}
        for c, n in sorted(sizes.items(), reverse=True):
            m0, cpu0, t0 = tsord.counters(), [cgroup_cpu_s(g) for g in groups], proc_cpu_s(tsord.proc.pid)
            s0, b0 = supervisors_cpu_s(cd), eth0_bytes(netns)
            text = run_to_exit(cri, cli, cli_conf, f"bench-c{c}",
                               ["redis-benchmark", "-h", ip, "-p", "6379", "-t", "get,set", "-n", str(n),
                                "-c", str(c), "--csv"])
            m1, cpu1, t1 = tsord.counters(), [cgroup_cpu_s(g) for g in groups], proc_cpu_s(tsord.proc.pid)
            s1, b1 = supervisors_cpu_s(cd), eth0_bytes(netns)
            rps = redis_rps(text)
            if set(rps) != {"GET", "SET"}:
                raise RuntimeError(f"redis-benchmark -c {c} ({handler}): no GET/SET rows in {text[-1000:]}")
            per10k = 1e4 / (2 * n)
            key = 'tsor_connections_total{path="local"}'
            out[f"c{c}"] = {
                "get_rps": rps["GET"], "set_rps": rps["SET"], "mean_rps": round((rps["GET"] + rps["SET"]) / 2, 1),
                "local_connections": m1.get(key, 0.0) - m0.get(key, 0.0),
                "server_eth0_bytes_per_request": round((b1 - b0) / (2 * n), 1),
                "server_pod_cpu_s_per_10k": round((cpu1[0] - cpu0[0]) * per10k, 4),
                "client_pod_cpu_s_per_10k": round((cpu1[1] - cpu0[1]) * per10k, 4),
                "tsord_cpu_s_per_10k": round((t1 - t0) * per10k, 4),
                "supervisors_cpu_s_per_10k": round((s1 - s0) * per10k, 4)}
        return out
    finally:
        for pod in (cli, srv):
            cri.teardown_pod(pod)


def summary(samples: dict[str, list[dict]], sizes: dict[int, int]) -> list[dict]:
    rows = []
    for c in sorted(sizes, reverse=True):
        k = f"c{c}"
        row: dict = {"concurrency": c, "requests": sizes[c], "runs": len(samples["quark"])}
        for h in HANDLERS:
            for m in ("mean_rps", "get_rps", "set_rps"):
                row[f"{h}_{m}_median"] = round(statistics.median(s[k][m] for s in samples[h]))
            for m in ("server_pod_cpu_s_per_10k", "client_pod_cpu_s_per_10k", "tsord_cpu_s_per_10k",
                      "supervisors_cpu_s_per_10k", "server_eth0_bytes_per_request"):
                row[f"{h}_{m}_median"] = round(statistics.median(s[k][m] for s in samples[h]), 4)
            row[f"{h}_mean_rps_runs"] = [round(s[k]["mean_rps"]) for s in samples[h]]
        row["quark_local_connections_per_run"] = [s[k]["local_connections"] for s in samples["quark"]]
        row["ratio_per_run"] = [round(q[k]["mean_rps"] / r[k]["mean_rps"], 2)
                                for q, r in zip(samples["quark"], samples["runc"])]
        row["ratio_median"] = round(statistics.median(row["ratio_per_run"]), 2)
        row["ratio_of_medians"] = round(row["quark_mean_rps_median"] / row["runc_mean_rps_median"], 2)
        if samples.get("unix"):   # the kernel alone: unix socket / veth + bridge, no container
            for via in VIAS:
                row[f"kernel_{via}_mean_rps_median"] = round(statistics.median(s[k] for s in samples[via]))
            row["kernel_ratio_per_run"] = [round(u[k] / v[k], 2) for u, v in zip(samples["unix"], samples["veth"])]
            row["kernel_ratio_median"] = round(statistics.median(row["kernel_ratio_per_run"]), 2)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n50", type=int, default=100000, help="requests per test at -c 50")
    ap.add_argument("--n1", type=int, default=20000, help="requests per test at -c 1")
    ap.add_argument("--local-path", choices=("socketpair", "sockmap"), default="socketpair",
                    help="tsord's local_path (tsor.yaml) for the quark pods")
    ap.add_argument("--shim-dir", help="directory holding containerd-shim-quark-v1 to use (default: the tests')")
    a = ap.parse_args()
    reason = cri_env.skip_reason() or cri_env.redis_image_skip_reason()
    if not reason and cri_env.quark_cni() is None:
        reason = "quark-cni is not installed (QUARK_CNI or PATH)"
    if reason:
        print(f"bench/cri_redis.py: cannot run: {reason}", file=sys.stderr)
        return 1
    from tests.support.cri.client import CriClient
    sizes = {50: a.n50, 1: a.n1}
    base = Path(tempfile.mkdtemp(prefix="qw15i-rb-"))
    tsord = cri_env.Tsord(base, "bench-node")
    d = cri_env.CriContainerd(shim_dir=a.shim_dir,
                              quark_cni_conf={"failOpen": False, "tsorSocket": tsord.socket})
    shim = os.path.join(a.shim_dir or ce._BIN, "containerd-shim-quark-v1")
    result: dict = {"command": "python bench/cri_redis.py " + " ".join(sys.argv[1:]),
                    "shim": os.path.realpath(shim), "cpus": os.cpu_count(), "local_path": a.local_path,
                    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    samples: dict[str, list[dict]] = {h: [] for h in (*HANDLERS, *VIAS)}
    bed = bare = None
    try:
        from tests.support.testbed import Testbed
        bed = Testbed(prefix="qbk", octet=219)     # the kernel-alone pair's own namespaces and bridge
        node = bed.node("n")
        bare_srv, bare_cli = node.pod("srv"), node.pod("cli")
        bare = BareRedis(bare_srv.netns, bare_srv.ip, bed.dir)
        tsord.start(debug=False, local_path=a.local_path)
        d.start()
        d.import_images(redis=True)
        with CriClient(d.address, cgroup_parent=d.cgroup_parent, log_root=str(d.log_dir)) as cri:
            for h in HANDLERS:            # warm-up: image snapshots, page cache, the factory
                one_run(cri, d, tsord, h, -1, {50: 2000, 1: 500})
            for i in range(a.runs):       # interleaved, alternating who goes first, so drift hits both alike
                for h in (HANDLERS if i % 2 == 0 else HANDLERS[::-1]):
                    samples[h].append(one_run(cri, d, tsord, h, i, sizes))
                    print(f"run {i} {h}: " + ", ".join(f"-c {k[1:]} {v['mean_rps']:.0f} req/s"
                                                       for k, v in samples[h][-1].items()), flush=True)
                for via in VIAS:
                    samples[via].append({f"c{c}": round(bare.rps(via, bare_cli.netns, c, n), 1)
                                         for c, n in sorted(sizes.items(), reverse=True)})
                    print(f"run {i} kernel alone, {via}: " + ", ".join(
                        f"-c {k[1:]} {v:.0f} req/s" for k, v in samples[via][-1].items()), flush=True)
    finally:
        if bare is not None:
            bare.close()
        if bed is not None:
            bed.close()
        d.close()
        tsord.stop()
        import shutil
        shutil.rmtree(base, ignore_errors=True)
    result["rows"] = summary(samples, sizes)
    result["runs"] = samples
    RESULTS.mkdir(exist_ok=True)
    name = "cri_redis.json" if a.local_path == "socketpair" else f"cri_redis_{a.local_path}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['command']}  ({result['date']}, shim {result['shim']}, local_path {a.local_path})")
    print("| redis-benchmark GET/SET | quark median (GET / SET) | runc median (GET / SET) | ratio (median of "
          "per-run) | per-run ratios | goal |")
    print("|---|---|---|---|---|---|")
    for r in result["rows"]:
        goal = f">= {GOAL_C50}x: {'yes' if r['ratio_median'] >= GOAL_C50 else 'no'}" if r["concurrency"] == 50 else "-"
        print(f"| -c {r['concurrency']}, -n {r['requests']} | {r['quark_mean_rps_median']} ({r['quark_get_rps_median']}"
              f" / {r['quark_set_rps_median']}) | {r['runc_mean_rps_median']} ({r['runc_get_rps_median']} / "
              f"{r['runc_set_rps_median']}) | {r['ratio_median']}x | "
              f"{' / '.join(f'{x}' for x in r['ratio_per_run'])} | {goal} |")
    print("\nbytes across the server pod's eth0 per request (median): " + ", ".join(
        f"-c {r['concurrency']} quark {r['quark_server_eth0_bytes_per_request_median']}, "
        f"runc {r['runc_server_eth0_bytes_per_request_median']}" for r in result["rows"]))
    print("\n| the kernel alone (no container) | unix socket median | veth + bridge median | ratio (median of "
          "per-run) | per-run ratios |")
    print("|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| -c {r['concurrency']}, -n {r['requests']} | {r['kernel_unix_mean_rps_median']} | "
              f"{r['kernel_veth_mean_rps_median']} | {r['kernel_ratio_median']}x | "
              f"{' / '.join(f'{x}' for x in r['kernel_ratio_per_run'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
