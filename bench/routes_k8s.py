"""The Kubernetes route source at cluster size: 10,000 pods and 1,000 Services (each with an
EndpointSlice of 10 endpoints) on 100 nodes, served by the API stand-in (tests/support/fake_kube_api.py)
in a process of its own, read by tsor/routes_k8s.py with the official client.

    .venv/bin/python bench/routes_k8s.py [--pods N] [--services N] [--runs N] [--events N] [--pad BYTES] [--json F]

--pad adds about that many bytes of container env entries to each pod: the stand-in's pods, made from the client's
models with one container, are ~370 bytes of JSON; real ones are ~4-8 KB, and parsing is the list's
largest cost.

  list      KubernetesSource.start() until every kind is listed into a fresh RouteTable
            (HTTP pages of 500, JSON, entries, the table), each run in a fresh interpreter as at
            tsord's start, median of --runs after one untimed list (the stand-in encodes its objects
            on the first); beside it, the same
            pages fetched only (the HTTP share), and the reference: the pods read the way the
            client's own Watch/informer code reads them, deserialised into V1Pod models
  relist    after 410 (etcd's compaction: every watch gets an ERROR 410), every kind listed again
            into the table it already fills, from the stand-in's ERROR to the last kind's list; in
            each list's process, after it
  event     one watch event applied: the line decoded + the entry + the table change, as the
            watch thread does it, p50/p99 of --events MODIFIED pod events; and end to end, from the
            stand-in's write to the table change (both processes read CLOCK_MONOTONIC)
  memory    VmRSS of a real tsord (`python -m tsor.daemon`) holding that table, against a tsord
            whose API server has nothing in it, and a tsord without any route source
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import fake_kube_api as k8s   # noqa: E402
from tsor.config import Kubernetes   # noqa: E402
from tsor.routes import RouteTable   # noqa: E402
from tsor.routes_k8s import PAGE, KubernetesSource   # noqa: E402

NODES = 100


def objects(pods: int, services: int, pad: int = 0) -> list[tuple[str, dict]]:
    out = [("nodes", k8s.node(f"node-{n}", f"10.99.{n // 250}.{n % 250 + 1}", [f"10.{100 + n}.0.0/16"]))
           for n in range(NODES)]
    ips = []
    for i in range(pods):
        n = i % NODES
        ip = f"10.{100 + n}.{i // NODES // 250}.{i // NODES % 250 + 1}"
        ips.append((ip, f"node-{n}"))
        pod = k8s.pod(f"pod-{i}", [ip], f"node-{n}", namespace=f"ns-{i % 50}",
                      labels={"app": f"app-{i % services}", "tier": "web"})
        if pad:   # a real Pod carries far more (containers' env, volumes, managedFields): ~4-8 KB of
            # small fields, which cost JSON parsing more than one long string would
            pod["spec"]["containers"][0]["env"] = [{"name": f"VAR_{j}", "value": f"value-{j}"}
                                                   for j in range(pad // 34)]
        out.append(("pods", pod))
    for s in range(services):
        out.append(("services", k8s.service(f"svc-{s}", f"10.96.{s // 250}.{s % 250 + 1}", [("http", 80, 8080)],
                                            namespace=f"ns-{s % 50}")))
        eps = [(ips[(s * 10 + j) % pods][0], True, ips[(s * 10 + j) % pods][1]) for j in range(10)]
        out.append(("endpointslices", k8s.endpoint_slice(f"svc-{s}-1", f"svc-{s}", eps, [("http", 8080)],
                                                         namespace=f"ns-{s % 50}")))
    return out


def serve(conn, sizes) -> None:
    """The stand-in, in its own process: objects made there (a list of them kept in this process
    would make every collection of CPython's cyclic GC here slower, and the measured list with it),
    then commands from the pipe."""
    api = k8s.FakeKubeAPI()
    for kind, obj in objects(*sizes) if sizes else ():
        api.put(kind, obj)
    api.compact()   # the history of the set-up is not replayed to watches
    conn.send(api.port)
    while True:
        cmd = conn.recv()
        if cmd[0] == "put":
            t = time.monotonic()
            api.put(cmd[1], cmd[2])
            conn.send(t)
        elif cmd[0] == "expire":   # etcd compacted: every open watch gets ERROR 410, later ones too
            t = time.monotonic()
            api.compact()
            api.expire_watches()
            conn.send(t)
        elif cmd[0] == "stop":
            api.stop()
            conn.send(None)
            return


def start_api(sizes: tuple[int, int, int] | None):
    """A stand-in with objects(*sizes) in it (None: empty); its process, pipe and port."""
    parent, child = multiprocessing.Pipe()
    p = multiprocessing.Process(target=serve, args=(child, sizes), daemon=True)
    p.start()
    return p, parent, parent.recv()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure_list(kubeconfig: str, conn, runs: int) -> dict:
    """Each run in a fresh interpreter, as tsord lists at its start: the list into an empty table,
    then one relist after 410 in the same process (`child`). One untimed run first: the stand-in
    encodes its objects as they are first listed."""
    lists, relists = [], []
    for run in range(runs + 1):
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", kubeconfig],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            listed = json.loads(p.stdout.readline())
            assert p.stdout.readline().strip() == "ready"
            conn.send(("expire",))
            p.stdin.write(f"{conn.recv()}\n")
            p.stdin.flush()
            relisted = json.loads(p.stdout.readline())
        finally:
            p.stdin.close()
            p.wait(60)
        if run:
            lists.append(listed["seconds"])
            relists.append(relisted["seconds"])
    return {"seconds": lists, "median_s": statistics.median(lists), "table": listed["table"],
            "relist_seconds": relists, "relist_median_s": statistics.median(relists)}


def child(kubeconfig: str) -> None:
    """One run of measure_list: list (timed), say so, wait for the stand-in's 410s (the parent sends
    the CLOCK_MONOTONIC time it caused them at), and time the relist from then until every kind is
    listed again into the table it already fills."""
    src = KubernetesSource(Kubernetes(kubeconfig=kubeconfig), 7470, first_sync=120)
    table = RouteTable()
    t0 = time.perf_counter()
    src.start(table)
    took = time.perf_counter() - t0
    print(json.dumps({"seconds": took, "table": (len(table.pods), len(table.services), len(table.nodes))}), flush=True)
    time.sleep(0.5)   # every watch open
    before = {k.name: k.relists for k in src.kinds}
    print("ready", flush=True)
    sent = float(sys.stdin.readline())
    deadline = time.monotonic() + 120
    while any(k.relists == before[k.name] for k in src.kinds):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no relist after 410: {src.status()}")
        time.sleep(0.002)
    print(json.dumps({"seconds": time.monotonic() - sent}), flush=True)
    src.stop()


def measure_fetch_and_models(kubeconfig: str, runs: int) -> dict:
    """The HTTP share (pods' pages fetched, not parsed) and the reference: V1Pod models."""
    from kubernetes import client
    from tsor.routes_k8s import api_client
    core = client.CoreV1Api(api_client(Kubernetes(kubeconfig=kubeconfig)))

    def pages(**kw):
        cont = None
        while True:
            resp = core.list_pod_for_all_namespaces(limit=PAGE, _continue=cont, **kw)
            yield resp
            if hasattr(resp, "metadata"):
                cont = resp.metadata._continue
            else:   # not parsed: the token from the list's metadata, which comes before its items
                m = re.search(rb'"continue": ?"([^"]*)"', resp.data[:1024])
                cont = m and m.group(1).decode()
            if not cont:
                return
    fetch, models = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        n = sum(len(r.data) for r in pages(_preload_content=False))
        fetch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        count = sum(len(r.items) for r in pages())
        models.append(time.perf_counter() - t0)
    return {"pods_fetch_median_s": statistics.median(fetch), "pods_bytes": n,
            "pods_as_models_median_s": statistics.median(models), "pods_as_models": count}


def measure_events(kubeconfig: str, conn, n: int, pods: int) -> dict:
    src = KubernetesSource(Kubernetes(kubeconfig=kubeconfig), 7470, first_sync=120)
    table = RouteTable()
    src.start(table)
    pod_kind = next(k for k in src.kinds if k.name == "pods")
    # as the watch thread decodes a line (tsor/k8s_fields.py); json before it existed (a run of this
    # bench on the commit before, for comparison)
    decode = pod_kind.decoder.event if hasattr(pod_kind, "decoder") else json.loads
    # applied: as the watch thread does it, one line at a time (these lines are not from the server)
    lines = [json.dumps({"type": "MODIFIED", "object": dict(
        k8s.pod(f"pod-{i}", [f"10.{100 + i % NODES}.200.{i % 250 + 1}"], f"node-{i % NODES}", namespace=f"ns-{i % 50}"),
    )}) for i in range(n)]
    applied = []
    for line in lines:
        t0 = time.perf_counter()
        src._event(pod_kind, decode(line))
        applied.append(time.perf_counter() - t0)
    # end to end: the stand-in writes the event, the watch thread applies it
    arrived: dict[str, float] = {}
    done = threading.Event()
    set_pod = table.set_pod

    def hook(key, pod):
        set_pod(key, pod)
        arrived[key[1]] = time.monotonic()
        done.set()
    table.set_pod = hook
    src.kinds[1].apply = hook
    e2e = []
    for i in range(min(n, 500)):
        done.clear()
        name = f"pod-{i}"
        conn.send(("put", "pods", k8s.pod(name, [f"10.{100 + i % NODES}.201.{i % 250 + 1}"], f"node-{i % NODES}",
                                          namespace=f"ns-{i % 50}")))
        sent = conn.recv()
        if done.wait(5) and name in arrived:
            e2e.append(arrived.pop(name) - sent)
        time.sleep(0.002)
    src.stop()
    return {"applied_p50_ms": pct(applied, 0.5) * 1e3, "applied_p99_ms": pct(applied, 0.99) * 1e3,
            "e2e_p50_ms": pct(e2e, 0.5) * 1e3, "e2e_p99_ms": pct(e2e, 0.99) * 1e3, "events": n, "e2e_events": len(e2e)}


def tsord_rss(kubeconfig: str | None, tmp: str, name: str) -> float:
    """MiB of VmRSS of a real tsord once it has listed every kind (kubeconfig None: a tsord without
    any route source, once it serves)."""
    cfg = os.path.join(tmp, f"{name}.yaml")
    with open(cfg, "w") as f:
        json.dump({"node": "node-0", "socket": os.path.join(tmp, f"{name}.sock"),
                   **({"kubernetes": {"kubeconfig": kubeconfig}} if kubeconfig else {})}, f)
    p = subprocess.Popen([sys.executable, "-m", "tsor.daemon", "--config", cfg], stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        listed = 0
        for line in p.stderr:
            listed += " listed at resourceVersion " in line
            if listed == 4 or (kubeconfig is None and " serving " in line):
                break
        time.sleep(1.0)
        with open(f"/proc/{p.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss / 1024
    finally:
        p.terminate()
        p.wait(10)


def one_size(args, pad: int, tmp: str) -> dict:
    """Every measurement with pods of one size (`pad`), against a stand-in of their own."""
    proc, conn, port = start_api((args.pods, args.services, pad))
    empty_proc, empty_conn, empty_port = start_api(None)
    try:
        kc = _kubeconfig(tmp, f"full-{pad}", port)
        res = {"pod_padding_bytes": pad, "load_before": os.getloadavg()[0]}
        res["list"] = measure_list(kc, conn, args.runs)
        res["reference"] = measure_fetch_and_models(kc, max(1, args.runs // 2))
        res["event"] = measure_events(kc, conn, args.events, args.pods)
        res["memory"] = {"tsord_rss_mib": tsord_rss(kc, tmp, "full"),
                         "tsord_rss_empty_mib": tsord_rss(_kubeconfig(tmp, "empty", empty_port), tmp, "empty"),
                         "tsord_rss_no_source_mib": tsord_rss(None, tmp, "none")}
    finally:
        for c, p in ((conn, proc), (empty_conn, empty_proc)):
            c.send(("stop",))
            c.recv()
            p.join(10)
    ls, ref, ev, mem = res["list"], res["reference"], res["event"], res["memory"]
    print(f"pods of ~{ref['pods_bytes'] // args.pods} bytes of JSON:")
    print(f"  list {args.pods} pods + {args.services} services (+ slices, {NODES} nodes) into the table: "
          f"median {ls['median_s']:.3f} s of {len(ls['seconds'])} (goal at 150,000 pods: <= 2 s); table {ls['table']}")
    print(f"  relist after 410 (every watch's version compacted) into the filled table: median "
          f"{ls['relist_median_s']:.3f} s of {len(ls['relist_seconds'])}")
    print(f"  pods' pages fetched only: {ref['pods_fetch_median_s']:.3f} s ({ref['pods_bytes'] / 2**20:.1f} MiB); "
          f"the same pods as V1Pod models (the client's way): {ref['pods_as_models_median_s']:.3f} s "
          f"= {ref['pods_as_models_median_s'] / ls['median_s']:.1f}x the whole list into the table")
    print(f"  watch event applied: p50 {ev['applied_p50_ms']:.3f} ms, p99 {ev['applied_p99_ms']:.3f} ms "
          f"(goal p99 < 1 ms); end to end over HTTP: p50 {ev['e2e_p50_ms']:.2f} ms, p99 {ev['e2e_p99_ms']:.2f} ms")
    share = mem["tsord_rss_mib"] - mem["tsord_rss_empty_mib"]
    print(f"  tsord RSS holding the table: {mem['tsord_rss_mib']:.1f} MiB (with an empty API server: "
          f"{mem['tsord_rss_empty_mib']:.1f} MiB; the table's share {share:.1f} MiB); "
          f"without a route source: {mem['tsord_rss_no_source_mib']:.1f} MiB")
    return res


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=10_000)
    ap.add_argument("--services", type=int, default=1_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--pad", default="0,4000", help="~bytes of env entries added to each pod; one run per size")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "routes_k8s.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-routes-k8s-")
    try:
        sizes = [one_size(args, int(pad), tmp) for pad in args.pad.split(",")]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": " ".join(["bench/routes_k8s.py"] + sys.argv[1:]),
           "pods": args.pods, "services": args.services, "endpoints_per_service": 10, "nodes": NODES,
           "cpus": os.cpu_count(), "sizes": sizes}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


def _kubeconfig(tmp: str, name: str, port: int) -> str:
    return k8s.write_kubeconfig(os.path.join(tmp, f"{name}.kubeconfig"), f"http://127.0.0.1:{port}")


if __name__ == "__main__":
    main()
