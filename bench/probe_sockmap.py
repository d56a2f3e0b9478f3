"""Feasibility probe for issue 13 (not used by quark): would a local path with no trapped call at
all — connections made by the kernel's own TCP through the pods' veths and bridge, the bytes of an
established connection between two pods moved socket to socket by sockmap (Cilium's and
Merbridge's trick) — meet the goals that trapping connect/accept cannot (set-up <= 4x, nginx
`Connection: close` >= 1.0x, keep-alive >= 1.3x)?

Two hand-assembled programs (no compiler): a BPF_PROG_TYPE_SOCK_OPS program on a scratch cgroup of
the unified hierarchy puts every IPv4 TCP socket of that cgroup into a SOCKHASH when it becomes
established (key: local address, remote address, local port, remote port); a BPF_PROG_TYPE_SK_MSG
program on the map redirects each sendmsg to the peer socket's receive queue when the peer is in the
map (the reversed key), else lets it take the stack. Connection set-up, and with it the node's
packet filters (NetworkPolicy), stays the kernel's: only an established connection's bytes skip
the stack.

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

from qlib import bpf  # noqa: E402
from qlib.bpf import ADD64_K, CALL, EXIT, JEQ_K, JNE_K, LDX_W, MOV64_K, MOV64_X, STX_W, Asm  # noqa: E402
from tests.cleanup import quark_cgroup_dirs, remove_empty_since  # noqa: E402
from tests.support import testbed  # noqa: E402

PROG_TYPE_SOCK_OPS, PROG_TYPE_SK_MSG = 13, 16
CGROUP_SOCK_OPS, SK_MSG_VERDICT = 3, 7                  # enum bpf_attach_type
MAP_TYPE_SOCKHASH = 18
FUNC_SOCK_HASH_UPDATE, FUNC_MSG_REDIRECT_HASH = 70, 71
ACTIVE_ESTABLISHED_CB, PASSIVE_ESTABLISHED_CB = 4, 5
F_INGRESS, SK_PASS, AF_INET = 1, 1, 2
RSH64_K, LSH64_K, TO_BE = 0x77, 0x67, 0xDC
# struct bpf_sock_ops: op @0, family @20, remote_ip4 @24, local_ip4 @28, remote_port @64 (network
# order in the high 16 bits), local_port @68 (host order); struct sk_msg_md: family @16,
# remote_ip4 @20, local_ip4 @24, remote_port @60, local_port @64, the same encodings
SCRATCH = "quark-probe-sockmap"   # quark*: tests/cleanup.py removes it in every hierarchy


def sock_ops_program(map_fd: int) -> bytes:
    a = Asm()
    a(MOV64_X, 6, 1)
    a(LDX_W, 2, 6, 0)
    a.j(JEQ_K, 2, ACTIVE_ESTABLISHED_CB, "established").j(JEQ_K, 2, PASSIVE_ESTABLISHED_CB, "established")
    a.j(0x05, 0, 0, "out")
    a.label("established")
    a(LDX_W, 2, 6, 20).j(JNE_K, 2, AF_INET, "out")
    for off, slot in ((28, -16), (24, -12), (68, -8), (64, -4)):   # this socket's own key
        a(LDX_W, 2, 6, off)(STX_W, 10, 2, slot)
    a(MOV64_X, 1, 6).map_fd(2, map_fd)(MOV64_X, 3, 10)(ADD64_K, 3, 0, 0, -16)(MOV64_K, 4, 0, 0, 0)
    a(CALL, 0, 0, 0, FUNC_SOCK_HASH_UPDATE)
    a.label("out")
    return a(MOV64_K, 0, 0, 0, 1)(EXIT).code()


def sk_msg_program(map_fd: int) -> bytes:
    a = Asm()
    a(MOV64_X, 6, 1)
    a(LDX_W, 2, 6, 16).j(JNE_K, 2, AF_INET, "pass")
    a(LDX_W, 2, 6, 20)(STX_W, 10, 2, -16)                      # the peer's local address: our remote
    a(LDX_W, 2, 6, 24)(STX_W, 10, 2, -12)
    a(LDX_W, 2, 6, 60)(RSH64_K, 2, 0, 0, 16)(TO_BE, 2, 0, 0, 16)(STX_W, 10, 2, -8)        # its port, host order
    a(LDX_W, 2, 6, 64)(TO_BE, 2, 0, 0, 16)(LSH64_K, 2, 0, 0, 16)(STX_W, 10, 2, -4)        # ours, network << 16
    a(MOV64_X, 1, 6).map_fd(2, map_fd)(MOV64_X, 3, 10)(ADD64_K, 3, 0, 0, -16)(MOV64_K, 4, 0, 0, F_INGRESS)
    a(CALL, 0, 0, 0, FUNC_MSG_REDIRECT_HASH)   # peer not in the map: no redirect, and PASS below
    a.label("pass")
    return a(MOV64_K, 0, 0, 0, SK_PASS)(EXIT).code()


def unified_root() -> str:
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            return root
    raise SystemExit("probe_sockmap: no cgroup2 mount")


@contextlib.contextmanager
def sockmap_cgroup():
    """The scratch cgroup with the two programs loaded (yielded: a function that attaches or detaches
    the sock_ops program, so one set-up serves both the with and the without runs)."""
    path = os.path.join(unified_root(), SCRATCH)
    os.makedirs(path, exist_ok=True)
    cg = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fds = [cg]
    try:
        smap = bpf.map_create(MAP_TYPE_SOCKHASH, 16, 4, 65535, "qprobe_pairs")
        fds.append(smap)
        ops = bpf.load(PROG_TYPE_SOCK_OPS, sock_ops_program(smap), "qprobe_ops")
        msg = bpf.load(PROG_TYPE_SK_MSG, sk_msg_program(smap), "qprobe_msg")
        fds += [ops, msg]
        bpf.attach(smap, msg, SK_MSG_VERDICT, what="attaching the sk_msg program to the map")
        state = {"on": False}

        def switch(on: bool) -> None:
            if on != state["on"]:
                (bpf.attach if on else bpf.detach)(cg, ops, CGROUP_SOCK_OPS)
                state["on"] = on
        try:
            yield switch
        finally:
            switch(False)
    finally:
        for fd in reversed(fds):
            os.close(fd)


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
    try:
        with sockmap_cgroup() as switch:
            for r in range(a.rounds):
                done = {}
                for config in ("runc", "runc_sockmap", "quark"):
                    switch(config == "runc_sockmap")
                    done[config] = bt.one_node("quark" if config == "quark" else "runc", "/repo/bench/.pingpong",
                                               f"s{config[0]}{config[-1]}", parts)
                    switch(False)
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
