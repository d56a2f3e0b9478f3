"""Feasibility probe for issue 13 (not used by quark): would a local path with no trapped call at
all — connections made by the kernel's own TCP through the pods' veths and bridge, the bytes of an
established connection between two pods moved socket to socket by sockmap (Cilium's and
Merbridge's trick) — meet the goals that trapping connect/accept cannot (set-up <= 4x, nginx
`Connection: close` >= 1.0x, keep-alive >= 1.3x)?

The programs are the ones the answer became, tsor's sockmap local path (tsor/bpf/sockmap.bpf.c,
built by `make install`; tsor/sockmap.py), attached to a scratch cgroup of the unified hierarchy
instead of its root, with every pod the run makes registered as tsord registers quark pods: a
SOCK_OPS program puts both ends of a TCP connection between two registered pods into a SOCKHASH
when it becomes established, and an SK_MSG program on the map redirects each sendmsg to the peer
socket's receive queue (the first message of each direction decides, and the choice sticks).
Connection set-up, and with it the node's packet filters (NetworkPolicy), stays the kernel's: only
an established connection's bytes skip the stack. (The figures in bench/README.md, "A local path
with no trap", were taken with the probe's first programs, assembled in Python, which carried every
IPv4 connection of the cgroup.)

It runs bench/tsor.py's one-node measurements with runc containers (their cgroups put under the
scratch cgroup, so the programs see their sockets) three ways, in turn, per round: runc + bridge
(the reference), runc + bridge + sockmap, and quark + TSoR (today's AF_UNIX local path), and prints
each one's ratio to the reference. Cleans up (programs detached, maps closed, cgroups removed).

Usage (root, cgroup2 at /sys/fs/cgroup/unified or /sys/fs/cgroup):
    .venv/bin/python bench/probe_sockmap.py [--rounds 2] [--only iperf3,rtt,redis,setup,nginx]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.cleanup import quark_cgroup_dirs, remove_empty_since  # noqa: E402
from tests.support import testbed  # noqa: E402
from tsor import kernel_sockets, sockmap  # noqa: E402

SCRATCH = "quark-probe-sockmap"   # quark*: tests/cleanup.py removes it in every hierarchy


def unified_root() -> str:
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            return root
    raise SystemExit("probe_sockmap: no cgroup2 mount")


@contextlib.contextmanager
def carried(cgroup: str):
    """tsor's sockmap programs on `cgroup` while the block runs, and every pod made meanwhile
    registered (its network namespace's cookie with its address, as tsord registers a quark pod's)."""
    path = sockmap.SockmapPath.open(cgroup)
    plain_pod = testbed.Node.pod

    def registered_pod(self, name):
        pod = plain_pod(self, name)
        path.register(pod.ip, kernel_sockets.netns_cookie(pod.netns_path, os.stat(pod.netns_path).st_ino))
        return pod
    testbed.Node.pod = registered_pod
    try:
        yield
    finally:
        testbed.Node.pod = plain_pod
        path.remove()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", default="iperf3,rtt,redis,setup,nginx")
    p.add_argument("--json", help="write every round's results here")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("probe_sockmap: needs root", file=sys.stderr)
        return 1
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_tsor", os.path.join(REPO, "bench", "tsor.py"))
    bt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bt)
    import subprocess
    pp = os.path.join(REPO, "bench", ".pingpong")
    subprocess.run(["gcc", "-O2", "-o", pp, os.path.join(REPO, "bench/pingpong.c"), "-lpthread"], check=True)
    parts = set(a.only.split(","))
    plain_bundle = testbed.Testbed.bundle

    def scratch_bundle(self, name, args, pod, **kw):   # runc's cgroups under the scratch cgroup
        path = plain_bundle(self, name, args, pod, **kw)
        cfg = os.path.join(path, "config.json")
        with open(cfg) as f:
            spec = json.load(f)
        spec["linux"]["cgroupsPath"] = f"/{SCRATCH}/{os.path.basename(self.dir)}-{name}"
        with open(cfg, "w") as f:
            json.dump(spec, f)
        return path
    testbed.Testbed.bundle = scratch_bundle
    before = quark_cgroup_dirs()
    rounds: list[dict] = []
    scratch = os.path.join(unified_root(), SCRATCH)
    os.makedirs(scratch, exist_ok=True)
    try:
        for r in range(a.rounds):
            done = {}
            for config in ("runc", "runc_sockmap", "quark"):
                with carried(scratch) if config == "runc_sockmap" else contextlib.nullcontext():
                    done[config] = bt.one_node("quark" if config == "quark" else "runc", "/repo/bench/.pingpong",
                                               f"s{config[0]}{config[-1]}", parts)
            rounds.append(done)
            print(f"round {r}: " + json.dumps({c: {k: round(v, 1) for k, v in d.items()
                                                   if isinstance(v, float)} for c, d in done.items()}), flush=True)
    finally:
        testbed.Testbed.bundle = plain_bundle
        remove_empty_since(before)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rounds, f, indent=2)
    keys = [k for k in rounds[0]["runc"] if isinstance(rounds[0]["runc"][k], float) and "cpu" not in k]
    print(f"\n{'metric':<34} {'runc':>10} {'sockmap':>10} {'quark':>10}  sockmap/runc  quark/runc  (medians)")
    for k in keys:
        med = {c: statistics.median(r[c][k] for r in rounds if k in r[c]) for c in ("runc", "runc_sockmap", "quark")
               if all(k in r[c] for r in rounds)}
        if len(med) == 3:
            print(f"{k:<34} {med['runc']:>10.1f} {med['runc_sockmap']:>10.1f} {med['quark']:>10.1f}  "
                  f"{med['runc_sockmap'] / med['runc']:>12.2f}  {med['quark'] / med['runc']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
