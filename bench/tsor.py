"""TSoR benchmark: side by side, on this machine (root; runc, iperf3, redis, gcc, wrk; nginx is fetched).

One node  — two containers in two pods on one bridge (CNI bridge plugin):
            quark + TSoR (local path) vs runc (veth + bridge, the Kubernetes default path):
            iperf3 throughput, 64 B ping-pong RTT p50/p99 (unpinned, and with both ends pinned by
            taskset to one CPU and to two), redis-benchmark GET/SET at -c 1 and -c 50, connection
            set-up time, and nginx (Debian's default nginx.conf) under `wrk -t1 -c16 -d10s`, keep-alive
            and `Connection: close`, with the CPU time of quark's supervisors and tsord per 10,000 requests.
            Beside runc's redis rows, the kernel alone (bench/bare_redis.py: no container, the same pods'
            namespaces): -c 50 over a unix socket vs over veth + bridge.
Two nodes — two network namespaces joined by a veth, each with a bridge, pods and tsord:
            quark + TSoR (tcp path) vs runc (plain TCP, same veth): iperf3 throughput (one stream and
            -P 8), redis-benchmark GET/SET -c 50, 64 B ping-pong RTT and connection set-up time
            (connect + 1-byte echo + close).
rdma      — the same two nodes with both tsords on `transport: softverbs` (the rdma path over
            softverbs, this machine having no RNIC), or with --rdma-provider pyverbs on
            `transport: rdma` over the host's first RDMA device (the soft-RoCE lane's guest:
            `python -m tests.vm.lane --rdma --command ...`, bench/README.md), run beside the tcp path and
            plain TCP in each run; ratios to the tcp path (the goal's reference) and to plain TCP.
            With pyverbs, tsord's default compiled pump (transport/rdma_pump.c) and the Python one
            (`rdma: {pump: python}`) both run, side by side: the "pump" rows. CPU per GB: the
            machine's busy CPU seconds (and the two tsords' own) per GB the one-stream iperf3 moved.
service   — set-up through a Service ClusterIP on one node (and straight to its endpoint beside it):
            quark (tsord's routes from an API stand-in; with --sockmap also the sockmap path, whose
            kernel picks the endpoint at connect(): tsor/service_lb.py) vs runc + bridge with the
            ClusterIP DNATed by an iptables rule as kube-proxy writes it.
native    — the same two nodes, the client's with tsord's sockmap path (its programs see every connect
            and carry none to another node), the server a runc container: what a connection the
            kernel-chosen path leaves alone costs, against plain TCP.
fallback  — the same two nodes with tsords that carry nothing between them (no cluster secret):
            what a quark connection that TSoR does not carry (another node without a path, a runc
            pod, anything outside the cluster) costs over plain TCP — the trap and tsord's answer.

    .venv/bin/python bench/tsor.py [--only nginx,setup,...] [--runs N] [--json F] [--png F]
                                   [--sockmap] [--nginx-no-cork] [--rdma-provider softverbs|pyverbs]

tsord runs without --debug here (a log line per connection is CPU the nginx rows count).
The chart needs matplotlib (`make bench` installs the `bench` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.cleanup import quark_cgroup_dirs, remove_empty_since
from tests.support.nginx import NO_CORK, ensure_nginx, prepare_bundle
from tests.support.testbed import Testbed, python_succeeds, wait_file

from bare_redis import VIAS, BareRedis, redis_rps  # noqa: E402  (bench/)

GOALS = {"iperf3_gbps": (">=", 2.0), "rtt_p50_us": ("<=", 0.75), "redis_c50_rps": (">=", 1.5),
         "redis_c1_rps": (">=", 1.05), "two_node_iperf3_gbps": (">=", 0.95),
         # issue 13: both RTT placements, set-up within 4x of plain TCP, nginx as Debian ships it
         "rtt_same_cpu_p50_us": ("<=", 0.75), "rtt_cross_cpu_p50_us": ("<=", 0.75), "setup_p50_us": ("<=", 4.0),
         "two_node_setup_p50_us": ("<=", 4.0), "nginx_keepalive_rps": (">=", 1.3), "nginx_close_rps": (">=", 1.0),
         # issue 17, against the tcp path: the pump must not be the bottleneck; set-up over the built QP
         "rdma_iperf3_gbps": (">=", 0.5), "rdma_setup_p50_us": ("<=", 1.0),
         # issue 45: set-up through a Service ClusterIP on the kernel-chosen path, against runc + kube-proxy's NAT
         "sockmap_setup_svc_p50_us": ("<=", 0.9), "sockmap_setup_svc_p99_us": ("<=", 0.9),
         # issue 45: a connection TSoR does not carry costs what the kernel's does
         "native_setup_p50_us": ("<=", 1.05)}
NGINX_NO_CORK = False   # --nginx-no-cork
TWO_NODE_REDIS_REQUESTS = 100000   # --redis-requests
PARTS = ("iperf3", "rtt", "rtt_sendmsg", "pinned", "redis", "setup", "nginx", "service", "two_nodes", "rdma",
         "fallback", "native")
# (section, key, label, unit, higher is better): the rows of the report and the bars of the chart, in order
METRICS = [("one_node", "iperf3_gbps", "iperf3", "Gb/s", True),
           ("one_node", "rtt_p50_us", "64 B RTT p50", "us", False),
           ("one_node", "rtt_sendmsg_p50_us", "64 B RTT p50, client's sendmsg", "us", False),
           ("one_node", "rtt_same_cpu_p50_us", "RTT p50, both on CPU 0", "us", False),
           ("one_node", "rtt_cross_cpu_p50_us", "RTT p50, CPUs 0 and 1", "us", False),
           ("one_node", "redis_c50_rps", "redis -c 50", "req/s", True),
           ("one_node", "redis_c1_rps", "redis -c 1", "req/s", True),
           ("one_node", "setup_p50_us", "set-up p50 (local path)", "us", False),
           ("one_node", "nginx_keepalive_rps", "nginx keep-alive", "req/s", True),
           ("one_node", "nginx_close_rps", "nginx Connection: close", "req/s", True),
           ("two_nodes", "two_node_iperf3_gbps", "2 nodes: iperf3", "Gb/s", True),
           ("two_nodes", "two_node_iperf3_p8_gbps", "2 nodes: iperf3 -P 8", "Gb/s", True),
           ("two_nodes", "two_node_redis_c50_rps", "2 nodes: redis -c 50", "req/s", True),
           ("two_nodes", "two_node_rtt_p50_us", "2 nodes: 64 B RTT p50", "us", False),
           ("two_nodes", "two_node_setup_p50_us", "2 nodes: set-up p50", "us", False),
           ("two_nodes", "two_node_cpu_s_per_gb", "2 nodes: CPU per GB (iperf3)", "s/GB", False),
           ("rdma", "rdma_iperf3_gbps", "rdma vs tcp path: iperf3", "Gb/s", True),
           ("rdma", "rdma_iperf3_p8_gbps", "rdma vs tcp: iperf3 -P 8", "Gb/s", True),
           ("rdma", "rdma_redis_c50_rps", "rdma vs tcp: redis -c 50", "req/s", True),
           ("rdma", "rdma_rtt_p50_us", "rdma vs tcp: 64 B RTT p50", "us", False),
           ("rdma", "rdma_setup_p50_us", "rdma vs tcp: set-up p50", "us", False),
           ("rdma", "rdma_cpu_s_per_gb", "rdma vs tcp: CPU per GB (iperf3)", "s/GB", False),
           ("pump", "rdma_iperf3_gbps", "compiled vs python pump: iperf3", "Gb/s", True),
           ("pump", "rdma_iperf3_p8_gbps", "compiled vs python: iperf3 -P 8", "Gb/s", True),
           ("pump", "rdma_redis_c50_rps", "compiled vs python: redis -c 50", "req/s", True),
           ("pump", "rdma_rtt_p50_us", "compiled vs python: 64 B RTT p50", "us", False),
           ("pump", "rdma_setup_p50_us", "compiled vs python: set-up p50", "us", False),
           ("pump", "rdma_cpu_s_per_gb", "compiled vs python: CPU per GB", "s/GB", False),
           ("pump", "rdma_tsord_cpu_s_per_gb", "compiled vs python: tsord CPU per GB", "s/GB", False),
           ("fallback", "fallback_setup_p50_us", "2 nodes, fallback: set-up p50", "us", False),
           ("native", "native_setup_p50_us", "2 nodes, sockmap node, not carried: set-up p50", "us", False),
           ("native", "native_setup_p99_us", "2 nodes, sockmap node, not carried: set-up p99", "us", False),
           ("native", "native_iperf3_gbps", "2 nodes, sockmap node, not carried: iperf3", "Gb/s", True),
           ("native", "native_rtt_p50_us", "2 nodes, sockmap node, not carried: 64 B RTT p50", "us", False),
           ("service", "setup_svc_p50_us", "set-up p50 via a ClusterIP", "us", False),
           ("service", "setup_svc_p99_us", "set-up p99 via a ClusterIP", "us", False),
           ("service_sockmap", "setup_svc_p50_us", "sockmap: set-up p50 via a ClusterIP", "us", False),
           ("service_sockmap", "setup_svc_p99_us", "sockmap: set-up p99 via a ClusterIP", "us", False)]
# section: (quark's configuration, the reference's); the rdma rows are measured against the tcp path
SIDES = {"one_node": ("one_node", "quark_tsor_local", "runc_bridge"),
         "two_nodes": ("two_nodes", "quark_tsor_tcp", "runc_plain_tcp"),
         "rdma": ("two_nodes", "quark_tsor_rdma", "quark_tsor_tcp"),
         "pump": ("two_nodes", "quark_tsor_rdma", "quark_tsor_rdma_python"),
         "fallback": ("two_nodes", "quark_tsor_fallback", "runc_plain_tcp"),
         "native": ("two_nodes", "quark_sockmap_native", "runc_plain_tcp"),
         "service": ("service", "quark_tsor_local", "runc_bridge_dnat"),
         "service_sockmap": ("service", "quark_tsor_sockmap", "runc_bridge_dnat")}
# two-node configurations: runtime and tsord's node-to-node transport (None: tsord's default, auto -> tcp)
# ("none": the tsords have no cluster secret or listen address, so connections between the nodes
# fall back to the kernel's TCP: what every quark connection to a peer TSoR does not carry costs)
# (and the rdma pump: None, tsord's default, compiled)
TWO_NODE_CONFIGS = {"quark_tsor_tcp": ("quark", None), "quark_tsor_rdma": ("quark", "softverbs"),
                    "quark_tsor_rdma_python": ("quark", "rdma", "python"),
                    "quark_tsor_fallback": ("quark", "none"), "quark_sockmap_native": ("quark", "sockmap"),
                    "runc_plain_tcp": ("runc", None)}
WRK = "wrk -t1 -c16 -d10s"


def wait_port(bed: Testbed, pod, port: int, timeout: float = 15) -> None:
    code = f"import socket; socket.create_connection(('{pod.ip}', {port}), timeout=1).close()"
    if not python_succeeds(pod.node.netns, code, timeout):
        raise RuntimeError(f"nothing listens on {pod.ip}:{port}")


def client(bed: Testbed, runtime: str, name: str, pod, shell: str, timeout: float = 180) -> str:
    out = f"/out/{name}.txt"
    r = bed.run(runtime, name, bed.bundle(name, ["sh", "-c", f"{shell} > {out} 2>&1"], pod,
                                          tsor=runtime == "quark"), timeout=timeout)
    with open(bed.out(f"{name}.txt")) as f:
        text = f.read()
    if r.returncode != 0:
        raise RuntimeError(f"{name} ({runtime}) failed: {text[-2000:]} {r.stderr[-2000:]}")
    return text


def busy_seconds(line: str) -> float:
    """CPU time the whole machine spent busy (every process and the kernel: softirqs, rxe), from
    /proc/stat's first line."""
    fields = [int(x) for x in line.split()[1:]]
    idle = fields[3] + fields[4]   # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """utime + stime of each live pid (all its threads), in seconds."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def supervisors(bed: Testbed) -> list[int]:
    """quark's supervisors of this testbed: the processes whose argv carries its `--root`."""
    root, found = os.path.join(bed.dir, "quark").encode(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if root in f.read().split(b"\0"):
                        found.append(int(d))
            except OSError:
                pass
    return found


def wrk(bed: Testbed, runtime: str, name: str, pod, node, url: str, extra: str) -> dict:
    """One wrk run from a detached container; for quark, the CPU time its supervisors (nginx's and
    wrk's) and tsord used during it. The container waits for a go file, so only wrk's run is counted."""
    go, done, stop = (f"{name}-{x}" for x in ("go", "done", "stop"))
    shell = (f"while [ ! -e /out/{go} ]; do sleep 0.05; done; {WRK} {extra} {url} > /out/{name}.txt 2>&1; "
             f"echo $? > /out/{done}; while [ ! -e /out/{stop} ]; do sleep 0.1; done")
    bed.start(runtime, name, bed.bundle(name, ["sh", "-c", shell], pod, tsor=runtime == "quark"))
    try:
        time.sleep(0.5)
        pids = supervisors(bed) + ([node.tsord.pid] if node.tsord else [])
        before = cpu_seconds(pids)
        open(bed.out(go), "w").close()
        wait_file(bed.out(done), 60)
        after = cpu_seconds(pids)
        open(bed.out(stop), "w").close()
    finally:
        bed.stop(runtime, name)
    with open(bed.out(f"{name}.txt")) as f:
        text = f.read()
    with open(bed.out(done)) as f:
        if f.read().strip() != "0":
            raise RuntimeError(f"{name} ({runtime}) failed: {text[-2000:]}")
    requests = int(re.search(r"(\d+) requests in", text)[1])
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    res = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text)[1]), "requests": requests,
           "socket_errors": sum(map(int, errors.groups())) if errors else 0,
           "non_2xx": int(non2xx[1]) if non2xx else 0}
    if runtime == "quark":
        per10k = 10000 / max(requests, 1)
        tsord = node.tsord.pid
        res["supervisor_cpu_s_per_10k"] = per10k * sum(after.get(p, before[p]) - before[p]
                                                       for p in before if p != tsord)
        res["tsord_cpu_s_per_10k"] = per10k * (after.get(tsord, 0) - before.get(tsord, 0))
    return res


def one_node(runtime: str, pp: str, tag: str, parts: set[str], local_path: str | None = None) -> dict:
    bed = Testbed(prefix=f"qb{tag}", octet=215)
    try:
        node = bed.node("n")
        if runtime == "quark":
            node.start_tsord(debug=False, local_path=local_path)
        srv, cli = node.pod("srv"), node.pod("cli")
        tsor = runtime == "quark"
        ports = []
        if "iperf3" in parts:
            bed.start(runtime, "iperf-s", bed.bundle("iperf-s", ["iperf3", "-s", "-p", "5201"], srv, tsor=tsor))
            ports.append(5201)
        if parts & {"rtt", "rtt_sendmsg", "setup"}:
            bed.start(runtime, "pp-s", bed.bundle("pp-s", [pp, "server", "7001"], srv, tsor=tsor))
            ports.append(7001)
        if "pinned" in parts:       # its per-connection threads inherit CPU 0
            bed.start(runtime, "pp-pin", bed.bundle("pp-pin", ["taskset", "-c", "0", pp, "server", "7002"], srv,
                                                    tsor=tsor))
            ports.append(7002)
        if "redis" in parts:
            bed.start(runtime, "redis", bed.bundle("redis", ["redis-server", "--port", "6379", "--save", "",
                                                             "--appendonly", "no", "--protected-mode", "no"],
                                                   srv, tsor=tsor))
            ports.append(6379)
        if "nginx" in parts:
            ngx = bed.bundle("nginx", ["nginx"], srv, tsor=tsor)
            prepare_bundle(ngx, ensure_nginx(), NO_CORK if NGINX_NO_CORK else None)
            bed.start(runtime, "nginx", ngx)
            ports.append(80)
        for port in ports:
            wait_port(bed, srv, port)
        res = {}
        if "iperf3" in parts:
            it = json.loads(client(bed, runtime, "iperf", cli, f"iperf3 -c {srv.ip} -p 5201 -t 5 -J"))
            res["iperf3_gbps"] = it["end"]["sum_received"]["bits_per_second"] / 1e9
        if "rtt" in parts:
            p50, p99 = map(float, client(bed, runtime, "rtt", cli, f"{pp} rtt {srv.ip} 7001 20000").split())
            res["rtt_p50_us"], res["rtt_p99_us"] = p50, p99
        if "rtt_sendmsg" in parts:   # every sendmsg of a TSoR sandbox is trapped (qkernel/syscalls/sys_sendmsg.py)
            p50, p99 = map(float, client(bed, runtime, "rttmsg", cli, f"{pp} rttmsg {srv.ip} 7001 20000").split())
            res["rtt_sendmsg_p50_us"], res["rtt_sendmsg_p99_us"] = p50, p99
        if "pinned" in parts:
            # the server's end on CPU 0; the client's on CPU 0 (same) or 1 (cross): placement like for like
            for place, cpu in (("same_cpu", 0), ("cross_cpu", 1)):
                if cpu < (os.cpu_count() or 1):
                    out = client(bed, runtime, f"rtt-{place}", cli, f"taskset -c {cpu} {pp} rtt {srv.ip} 7002 20000")
                    res[f"rtt_{place}_p50_us"], res[f"rtt_{place}_p99_us"] = map(float, out.split())
        if "redis" in parts:
            for c, n in ((1, 20000), (50, 100000)):
                rps = redis_rps(client(bed, runtime, f"redis{c}", cli,
                                       f"redis-benchmark -h {srv.ip} -p 6379 -t get,set -n {n} -c {c} --csv"))
                res[f"redis_c{c}_rps"] = (rps["GET"] + rps["SET"]) / 2
                res[f"redis_c{c}_get_rps"], res[f"redis_c{c}_set_rps"] = rps["GET"], rps["SET"]
            if runtime == "runc":
                # the kernel alone in the same pods' namespaces, no container: unix socket vs veth +
                # bridge, the most a local path made of AF_UNIX ends can show against runc here
                with BareRedis(srv.netns, srv.ip, bed.dir) as bare:
                    for via in VIAS:
                        res[f"kernel_{via}_c50_rps"] = bare.rps(via, cli.netns, 50, 100000)
        if "setup" in parts:
            p50, p99 = map(float, client(bed, runtime, "setup", cli, f"{pp} connect {srv.ip} 7001 300").split())
            res["setup_p50_us"], res["setup_p99_us"] = p50, p99
        if "nginx" in parts:
            for kind, extra in (("keepalive", ""), ("close", "-H 'Connection: close'")):
                w = wrk(bed, runtime, f"wrk-{kind}", cli, node, f"http://{srv.ip}/", extra)
                res.update({f"nginx_{kind}_{k}": v for k, v in w.items()})
        if runtime == "quark":
            from tsor.metrics import fetch, parse
            res["tsord"] = {k: v for k, v in parse(fetch(node.metrics)).items() if "connections" in k}
        return res
    finally:
        bed.close()
        if local_path == "sockmap":   # tsord leaves its programs attached for the connections they carry
            from tsor import sockmap
            from tsor.sockopt_offload import cgroup2_root
            sockmap.remove_attached(cgroup2_root())


SERVICE_IP = "10.215.250.10"   # the Service part's ClusterIP: of the bed's own range, held by no interface
SERVICE_CONNECTS = 2000        # per side and run: a p99 of 20 samples, not of 3


def service_setup(runtime: str, pp: str, tag: str, local_path: str | None = None) -> dict:
    """Connection set-up (connect + 1-byte echo + close) through a Service ClusterIP, and straight to
    the endpoint's address beside it, on one node. quark: tsord takes its routes, the Service among
    them, from an API stand-in served in the node's namespace (socketpair: tsord picks the endpoint
    of a trapped connect; sockmap: the kernel rewrites the connect, tsor/service_lb.py). runc: the
    ClusterIP DNATed by an iptables rule as kube-proxy writes it, in the client pod's own OUTPUT
    chain (in the node's PREROUTING, as kube-proxy puts it, the reply of a pod on the same bridge
    would need br_netfilter, a setting of the whole host)."""
    from tests.support import fake_kube_api as k8s
    from tsor.kernel_sockets import socket_at
    bed = Testbed(prefix=f"qv{tag}", octet=215)
    api = None
    try:
        node = bed.node("n")
        srv, cli = node.pod("srv"), node.pod("cli")
        if runtime == "quark":
            listener = socket_at(f"/var/run/netns/{node.netns}")
            listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            api = k8s.FakeKubeAPI(listener)
            api.put("nodes", k8s.node("n", "10.215.0.1", [node.subnet]))
            for pod in (srv, cli):
                api.put("pods", k8s.pod(pod.name, [pod.ip], "n"))
            api.put("services", k8s.service("pp", SERVICE_IP, [(None, 7001, 7001)]))
            api.put("endpointslices", k8s.endpoint_slice("pp-1", "pp", [(srv.ip, True, "n")], [(None, 7001)]))
            node.start_tsord(debug=False, local_path=local_path, kubeconfig=k8s.write_kubeconfig(
                os.path.join(bed.dir, "kc"), f"http://127.0.0.1:{api.port}"))
            wait_file(node.metrics)
            from tests.support.testbed import wait_metric
            wait_metric(node, "tsor_route_services", 1, timeout=30)
            if local_path == "sockmap":
                wait_metric(node, "tsor_service_endpoints", 1, timeout=30)
        else:
            subprocess.run(["ip", "netns", "exec", cli.netns, "iptables", "-t", "nat", "-A", "OUTPUT", "-d",
                            f"{SERVICE_IP}/32", "-p", "tcp", "--dport", "7001", "-j", "DNAT",
                            "--to-destination", f"{srv.ip}:7001"], check=True)
        bed.start(runtime, "pp-s", bed.bundle("pp-s", [pp, "server", "7001"], srv, tsor=runtime == "quark"))
        wait_port(bed, srv, 7001)
        res = {}
        for key, ip in (("setup_svc", SERVICE_IP), ("setup_direct", srv.ip)):
            p50, p99 = map(float, client(bed, runtime, key, cli, f"{pp} connect {ip} 7001 {SERVICE_CONNECTS}").split())
            res[f"{key}_p50_us"], res[f"{key}_p99_us"] = p50, p99
        return res
    finally:
        if api is not None:
            api.stop()
        bed.close()   # (the rule goes with the client pod's namespace)
        if local_path == "sockmap":
            from tsor import sockmap
            from tsor.sockopt_offload import cgroup2_root
            sockmap.remove_attached(cgroup2_root())   # (the Service programs too)


def two_nodes(runtime: str, pp: str, tag: str, transport: str | None = None, pump: str | None = None) -> dict:
    """iperf3, 64 B RTT and set-up from a pod on node a to a pod on node b. The keys are the
    two-node section's (two_node_*); the rdma configuration's are renamed rdma_* by its caller."""
    bed = Testbed(prefix=f"qc{tag}", octet=216)
    # "sockmap": the client's node runs tsord's sockmap path, whose programs see every connect and
    # carry none to another node; the server is a runc container (a peer TSoR does not carry)
    srv_runtime = "runc" if transport == "sockmap" else runtime
    try:
        a, b = bed.node("a"), bed.node("b")
        bed.link(a, b)
        tsor = runtime == "quark"
        if transport == "sockmap":
            a.start_tsord(debug=False, local_path="sockmap", peers=False)
        elif tsor:
            peers = transport != "none"
            rdma = {"pump": pump} if pump else None
            a.start_tsord(debug=False, transport=transport if peers else None, peers=peers, rdma=rdma)
            b.start_tsord(debug=False, transport=transport if peers else None, peers=peers, rdma=rdma)
        srv, cli = b.pod("srv"), a.pod("cli")
        on_srv = srv_runtime == "quark"
        bed.start(srv_runtime, "iperf-s", bed.bundle("iperf-s", ["iperf3", "-s", "-p", "5201"], srv, tsor=on_srv))
        bed.start(srv_runtime, "pp-s", bed.bundle("pp-s", [pp, "server", "7001"], srv, tsor=on_srv))
        bed.start(srv_runtime, "redis", bed.bundle("redis", ["redis-server", "--port", "6379", "--save", "",
                                                             "--appendonly", "no", "--protected-mode", "no"],
                                                   srv, tsor=on_srv))
        for port in (5201, 7001, 6379):
            wait_port(bed, srv, port)
        res = {}
        tsords = [n.tsord.pid for n in (a, b) if n.tsord is not None]
        cpu0 = cpu_seconds(tsords)
        # /proc/stat read in the pod just before and after the stream: the machine's busy time
        # while it ran, not the container's start and stop
        it = json.loads(client(bed, runtime, "iperf", cli, f"(head -1 /proc/stat > /out/iperf.stat; iperf3 -c {srv.ip} "
                                                           f"-p 5201 -t 5 -J; head -1 /proc/stat >> /out/iperf.stat)"))
        cpu1 = cpu_seconds(tsords)
        res["two_node_iperf3_gbps"] = it["end"]["sum_received"]["bits_per_second"] / 1e9
        # per GB the stream moved: the whole machine's CPU (both nodes: pods, tsords, the kernel) and
        # both tsords' own (theirs from the container's start to its end)
        gb = it["end"]["sum_received"]["bytes"] / 1e9
        with open(bed.out("iperf.stat")) as f:
            before, after = f.read().splitlines()
        res["two_node_cpu_s_per_gb"] = (busy_seconds(after) - busy_seconds(before)) / gb
        if tsor:
            res["two_node_tsord_cpu_s_per_gb"] = sum(cpu1[p] - cpu0[p] for p in tsords) / gb
        it = json.loads(client(bed, runtime, "iperf8", cli, f"iperf3 -c {srv.ip} -p 5201 -t 5 -P 8 -J"))
        res["two_node_iperf3_p8_gbps"] = it["end"]["sum_received"]["bits_per_second"] / 1e9
        rps = redis_rps(client(bed, runtime, "redis50", cli, f"redis-benchmark -h {srv.ip} -p 6379 -t get,set "
                                                             f"-n {TWO_NODE_REDIS_REQUESTS} -c 50 --csv"))
        res["two_node_redis_c50_rps"] = (rps["GET"] + rps["SET"]) / 2
        p50, p99 = map(float, client(bed, runtime, "rtt", cli, f"{pp} rtt {srv.ip} 7001 5000").split())
        res["two_node_rtt_p50_us"], res["two_node_rtt_p99_us"] = p50, p99
        p50, p99 = map(float, client(bed, runtime, "setup", cli, f"{pp} connect {srv.ip} 7001 300").split())
        res["two_node_setup_p50_us"], res["two_node_setup_p99_us"] = p50, p99
        if tsor:
            from tsor.metrics import fetch, parse
            res["tsord"] = {k: v for k, v in parse(fetch(a.metrics)).items()
                            if "connections" in k or "setup_seconds" in k}
            # the client tsord's own share of a set-up (its connect, the peer tsord's and the
            # listening sandbox's answer included; the two supervisors' trap work not)
            path = {"softverbs": "rdma", "rdma": "rdma", "none": "fallback", "sockmap": "native"}.get(transport, "tcp")
            n = res["tsord"].get(f'tsor_connections_total{{path="{path}"}}', 0)
            if n and path in ("tcp", "rdma"):   # (fallback connects answered from a supervisor's cache never ask)
                res["two_node_tsord_setup_us"] = res["tsord"][f'tsor_setup_seconds_total{{path="{path}"}}'] / n * 1e6
            if path == "rdma":
                res = {k.replace("two_node_", "rdma_"): v for k, v in res.items()}
                if res["tsord"].get('tsor_connections_total{path="rdma"}', 0) < 3:
                    raise RuntimeError(f"the {transport} configuration's connections did not take the rdma path: "
                                       f"{res['tsord']}")
            elif transport == "none":
                res = {k.replace("two_node_", "fallback_"): v for k, v in res.items()}
            elif transport == "sockmap":
                res = {k.replace("two_node_", "native_"): v for k, v in res.items()}
        return res
    finally:
        bed.close()
        if transport == "sockmap":   # tsord leaves its programs attached
            from tsor import sockmap
            from tsor.sockopt_offload import cgroup2_root
            sockmap.remove_attached(cgroup2_root())


def two_node_runs(configs: list[str], pp: str, runs: int) -> dict:
    """Each run measures every configuration in turn (side by side); the medians, every run kept."""
    done: dict[str, list[dict]] = {c: [] for c in configs}
    for _ in range(runs):
        for c in configs:
            runtime, transport, *pump = TWO_NODE_CONFIGS[c]
            done[c].append(two_nodes(runtime, pp, c.split("_")[-1][:1] + runtime[:1], transport, *pump))
    return {c: merge(done[c]) for c in configs}


def rows(results: dict) -> list[dict]:
    """One row per metric measured on both sides: the values, quark / reference, and quark's advantage
    (the ratio turned so that higher is better), with the goal where the project has one. The rdma
    rows' reference is the tcp path; their ratio to plain TCP (runc) is given too."""
    out = []
    for section, key, label, unit, higher in METRICS:
        where, mine, ref = SIDES[section]
        data = results.get(where, {})
        if mine not in data or ref not in data:
            continue
        # the reference's name (the pump rows compare two rdma configurations: the same)
        ref_key = key if section == "pump" else \
            key.replace("rdma_", "two_node_").replace("fallback_", "two_node_").replace("native_", "two_node_")
        q, r = data[mine].get(key), data[ref].get(ref_key)
        if q is None or r is None:
            continue
        ratio = q / r
        goal = GOALS.get(key) if section != "pump" else None   # the pump rows compare two of quark's own
        if section == "service_sockmap":
            goal = GOALS.get(f"sockmap_{key}")
        row = {"key": {"pump": f"pump_{key}", "service_sockmap": f"sockmap_{key}"}.get(section, key), "label": label, "unit": unit, "quark": q, "runc": r, "ratio": ratio,
               "reference": ref, "advantage": ratio if higher else 1 / ratio,
               "goal": None if goal is None else (goal[1] if higher else 1 / goal[1]),
               "met": None if goal is None else (ratio >= goal[1] if goal[0] == ">=" else ratio <= goal[1]),
               "ratio_per_run": [m[key] / x[ref_key] for m, x in zip(data[mine].get("runs", [data[mine]]),
                                                                     data[ref].get("runs", [data[ref]]))
                                 if key in m and ref_key in x]}
        plain = data.get("runc_plain_tcp", {}).get(ref_key) if section == "rdma" else None
        if plain:
            row["ratio_to_plain_tcp"] = q / plain
        out.append(row)
    return out


def chart(path: str, table: list[dict], machine: str) -> None:
    """A bar per row: quark + TSoR's advantage over runc (log scale, higher is better), the ratio and
    both values on the bar, the goal as a black tick, parity as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    def fmt(v: float) -> str:
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"
    fig, ax = plt.subplots(figsize=(max(8, 1.25 * len(table) + 2), 6.5))
    colors = {True: "#2e7d32", False: "#c62828", None: "#1565c0"}
    xs = range(len(table))
    ax.bar(xs, [t["advantage"] for t in table], width=0.6, color=[colors[t["met"]] for t in table])
    ax.set_yscale("log")
    top = max(4.0, *(t["advantage"] * 3 for t in table), *(t["goal"] * 3 for t in table if t["goal"]))
    bottom = min(0.25, *(t["advantage"] / 1.8 for t in table))
    ax.set_ylim(bottom, top)
    ticks = [v for v in (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32) if bottom <= v <= top]
    ax.set_yticks(ticks, [f"{v:g}x" for v in ticks])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    for x, t in zip(xs, table):
        if t["goal"]:
            ax.hlines(t["goal"], x - 0.4, x + 0.4, color="black", linewidth=2.5)
        ax.annotate(f"{t['advantage']:.2f}x\n{fmt(t['quark'])} vs {fmt(t['runc'])}\n{t['unit']}",
                    (x, max(t["advantage"], t["goal"] or 0)), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 3), textcoords="offset points",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
    ax.set_xticks(list(xs), [t["label"] for t in table], rotation=30, ha="right", fontsize=9)
    ax.set_ylabel("quark + TSoR advantage over the reference (x, log scale; higher is better)\n"
                  "throughput: quark / reference; latency: reference / quark")
    ax.set_xlabel("metric (values on each bar: quark vs reference, in the unit shown;\n"
                  "the rdma bars' reference is TSoR's tcp path, the compiled-vs-python bars' the Python pump, the others' runc)")
    ax.set_title(f"TSoR vs runc + bridge (one node), plain TCP (two nodes), rdma vs the tcp path\n{machine}",
                 fontsize=11)
    ax.legend(handles=[Patch(color=colors[True], label="goal met"), Patch(color=colors[False], label="goal not met"),
                       Patch(color=colors[None], label="no goal (reported)"),
                       plt.Line2D([], [], color="black", linewidth=2.5, label="goal"),
                       plt.Line2D([], [], color="black", linestyle="--", linewidth=1, label="parity (1x)")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(runs: list[dict]) -> dict:
    """The median of each number over the runs (the runs themselves kept when there are several)."""
    out = dict(runs[-1])
    for k, v in runs[-1].items():
        if isinstance(v, (int, float)):
            out[k] = statistics.median(r[k] for r in runs if k in r)
    if len(runs) > 1:
        out["runs"] = runs
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=os.path.join(REPO, "bench/results/tsor.json"))
    p.add_argument("--png", default=os.path.join(REPO, "bench/results/tsor.png"))
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts to run (default all): {','.join(PARTS)}")
    p.add_argument("--runs", type=int, default=1, help="repeat each side N times; numbers are medians")
    p.add_argument("--sockmap", action="store_true",
                   help="one node: also quark with tsord's local_path: sockmap (nothing trapped; tsor/sockmap.py)")
    p.add_argument("--rdma-provider", choices=("softverbs", "pyverbs"), default="softverbs",
                   help="the rdma part's verbs: softverbs (any host) or pyverbs on the host's RDMA device")
    p.add_argument("--redis-requests", type=int, default=100000,
                   help="two nodes: redis-benchmark -n (fewer for an emulated guest)")
    p.add_argument("--nginx-no-cork", action="store_true",
                   help="nginx.conf with sendfile off, tcp_nopush off, tcp_nodelay off instead of Debian's as shipped")
    p.add_argument("--report", metavar="JSON", help="measure nothing: the table and chart of an earlier run's "
                   "JSON (one from the RDMA lane's guest, say), written again to --json and --png")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            results = json.load(f)
        args.runs = results["runs"]
        return report(results, args)
    global NGINX_NO_CORK, TWO_NODE_REDIS_REQUESTS
    NGINX_NO_CORK = args.nginx_no_cork
    TWO_NODE_REDIS_REQUESTS = args.redis_requests
    TWO_NODE_CONFIGS["quark_tsor_rdma"] = ("quark", "rdma" if args.rdma_provider == "pyverbs" else "softverbs")
    parts = {x.strip() for x in args.only.split(",") if x.strip()}
    if not parts or parts - set(PARTS):
        p.error(f"--only: unknown part(s) {', '.join(sorted(parts - set(PARTS))) or '(none given)'}; "
                f"choose from {','.join(PARTS)}")
    if args.runs < 1:
        p.error("--runs: must be at least 1")
    if os.geteuid() != 0:
        print("bench/tsor.py needs root (namespaces, containers)", file=sys.stderr)
        return 1
    pp = os.path.join(REPO, "bench", ".pingpong")
    subprocess.run(["gcc", "-O2", "-o", pp, os.path.join(REPO, "bench/pingpong.c"), "-lpthread"], check=True)
    pp_in = "/repo/bench/.pingpong"
    one = parts - {"two_nodes", "rdma", "fallback", "service", "native"}
    cgroups_before = quark_cgroup_dirs()
    machine = {"kernel": platform.release(), "cpus": os.cpu_count()}
    results: dict = {"machine": machine, "parts": sorted(parts), "runs": args.runs, "rdma_provider": args.rdma_provider,
                     "nginx_conf": "sendfile, tcp_nopush, tcp_nodelay off" if NGINX_NO_CORK else "Debian's"}
    try:
        if one:
            results["one_node"] = {
                "quark_tsor_local": merge([one_node("quark", pp_in, "q", one) for _ in range(args.runs)]),
                "runc_bridge": merge([one_node("runc", pp_in, "r", one) for _ in range(args.runs)])}
            if args.sockmap:
                results["one_node"]["quark_tsor_sockmap"] = merge([one_node("quark", pp_in, "m", one, "sockmap")
                                                                   for _ in range(args.runs)])
        if "service" in parts:
            results["service"] = {
                "quark_tsor_local": merge([service_setup("quark", pp_in, "q") for _ in range(args.runs)]),
                "runc_bridge_dnat": merge([service_setup("runc", pp_in, "r") for _ in range(args.runs)])}
            if args.sockmap:
                results["service"]["quark_tsor_sockmap"] = merge([service_setup("quark", pp_in, "m", "sockmap")
                                                                  for _ in range(args.runs)])
        if parts & {"two_nodes", "rdma", "fallback", "native"}:   # the rdma rows need the tcp path beside them
            configs = [*(["quark_tsor_tcp"] if parts & {"two_nodes", "rdma"} else []),
                       *(["quark_tsor_rdma"] if "rdma" in parts else []),
                       *(["quark_tsor_rdma_python"] if "rdma" in parts and args.rdma_provider == "pyverbs" else []),
                       *(["quark_tsor_fallback"] if "fallback" in parts else []),
                       *(["quark_sockmap_native"] if "native" in parts else []), "runc_plain_tcp"]
            results["two_nodes"] = two_node_runs(configs, pp_in, args.runs)
    finally:
        remove_empty_since(cgroups_before)
    return report(results, args)


def report(results: dict, args: argparse.Namespace) -> int:
    """The ratios into `results`, written to --json; the table printed, the chart drawn."""
    machine = results["machine"]
    table = rows(results)
    results["ratios"] = {t["key"]: t["ratio"] for t in table}
    results["ratios_per_run"] = {t["key"]: t["ratio_per_run"] for t in table}
    results["rdma_ratios_to_plain_tcp"] = {t["key"]: t["ratio_to_plain_tcp"]
                                           for t in table if "ratio_to_plain_tcp" in t}
    results["goals_met"] = {t["key"]: t["met"] for t in table if t["met"] is not None}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    print(f"\n{'metric':<36} {'quark+TSoR':>12} {'reference':>12} {'ratio':>7}  per run  goal")
    for t in table:
        goal = "" if t["met"] is None else f"{GOALS[t['key']][0]} {GOALS[t['key']][1]}x: {'met' if t['met'] else 'NOT met'}"
        per_run = " / ".join(f"{x:.2f}" for x in t["ratio_per_run"])
        plain = f" (plain TCP: {t['ratio_to_plain_tcp']:.2f}x)" if "ratio_to_plain_tcp" in t else ""
        print(f"{t['label'] + ' (' + t['unit'] + ')':<36} {t['quark']:>12.1f} {t['runc']:>12.1f} {t['ratio']:>6.2f}x  "
              f"{per_run}  {goal}{plain}")
    r = results.get("one_node", {}).get("runc_bridge", {})
    if "kernel_unix_c50_rps" in r:
        per_run = " / ".join(f"{x['kernel_unix_c50_rps'] / x['kernel_veth_c50_rps']:.2f}" for x in r.get("runs", [r]))
        print(f"redis -c 50, the kernel alone (no container, the same pods' namespaces): unix socket "
              f"{r['kernel_unix_c50_rps']:.0f} vs veth + bridge {r['kernel_veth_c50_rps']:.0f} req/s, "
              f"{r['kernel_unix_c50_rps'] / r['kernel_veth_c50_rps']:.2f}x (per run {per_run})")
    for c, d in results.get("two_nodes", {}).items():
        us = next((d[k] for k in ("two_node_tsord_setup_us", "rdma_tsord_setup_us") if k in d), None)
        if us is not None:
            print(f"2 nodes, {c}: the client tsord's share of a set-up {us:.0f} us per connection "
                  f"(tsor_setup_seconds_total / tsor_connections_total)")
    m = results.get("one_node", {}).get("quark_tsor_sockmap")
    if m is not None:
        print("\nquark with local_path: sockmap against runc + bridge (and the socketpair path's ratio):")
        q = results["one_node"]["quark_tsor_local"]
        for key in sorted(k for k in m if isinstance(m[k], float) and "cpu" not in k and k in r and r[k]):
            per_run = " / ".join(f"{a[key] / b[key]:.2f}" for a, b in zip(m.get("runs", [m]), r.get("runs", [r]))
                                 if a.get(key) and b.get(key))
            print(f"{key:<36} {m[key]:>12.1f} {r[key]:>12.1f} {m[key] / r[key]:>6.2f}x  {per_run}  (socketpair "
                  f"{q[key] / r[key] if key in q else float('nan'):.2f}x)")
    q = results.get("one_node", {}).get("quark_tsor_local", {})
    for kind in ("keepalive", "close"):
        if f"nginx_{kind}_rps" in q:
            print(f"nginx {kind}: quark CPU s per 10k requests: supervisors "
                  f"{q[f'nginx_{kind}_supervisor_cpu_s_per_10k']:.3f}, tsord {q[f'nginx_{kind}_tsord_cpu_s_per_10k']:.3f}")
    if table:
        try:
            chart(args.png, table, f"kernel {machine['kernel']}, {machine['cpus']} CPUs, "
                                   f"{args.runs} run(s), {time.strftime('%Y-%m-%d %H:%M')}")
        except ImportError:
            print(f"no chart: matplotlib is missing (make bench installs it); {args.png} not written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
