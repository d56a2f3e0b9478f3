"""The two-guest RDMA lane: two of the RDMA lane's guests, a and b, joined by a wire, each with a
soft-RoCE device on its own end of it — two RDMA hosts, as two nodes of a cluster are.

    python -m tests.vm.pair [--timeout S] [--memory MiB] [--smp N] [--out DIR]
                            [--a COMMAND] [--b COMMAND] [--kernel-suite bookworm-backports]

(`make test-rdma-pair` runs the default.) Each guest is tests/vm/lane.py's (Debian 12's 6.1 kernel
under TCG, the host's / read-only over 9p, a results share of its own), plus:
- a virtio NIC, eth0, on one wire: qemu's socket netdev, guest a listening and guest b connecting on
  an ephemeral port of 127.0.0.1 (the host's loopback: nothing else is reached); 10.212.0.1/24 on a,
  10.212.0.2/24 on b;
- `rdma link add rxe0 type rxe netdev eth0` in each: RoCE v2 frames between the two guests' kernels,
  the only way to a RoCE path at both ends of a connection (in one guest the kernel's SMC-R finds
  none: bench/README.md);
- the smc and smc_diag modules (the kernel's SMC-R, the reference TSoR's rdma path is measured
  against);
- a third 9p share, "pair", the same host directory in both at /.quark-vm/pair ($QUARK_PAIR_DIR),
  for what the two sides must agree on (a secret, "ready" files).
The environment of each command: QUARK_PAIR_ROLE (a or b), QUARK_PAIR_SELF and QUARK_PAIR_PEER
(the wire's addresses), QUARK_PAIR_DIR, QUARK_VM_OUT (what is written there comes back with --out:
DIR/a, DIR/b). By default a runs pytest on tests/pair and b serves it (tests/pair/peer.py) until a
is done. The lane's status is a's, or b's when a's is 0.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.vm.kernel import LaneError
from tests.vm.lane import (GUEST_OUT, PROJECT, PYTEST_FIXED, Console, _stop, guest_status, prepare, qemu_argv,
                           share_argv, summary_line)

WIRE = {"a": "10.212.0.1", "b": "10.212.0.2"}
MACS = {"a": "52:54:00:51:20:01", "b": "52:54:00:51:20:02"}
GUEST_PAIR = "/.quark-vm/pair"
DEFAULT_A = shlex.join([sys.executable, "-m", "pytest", *PYTEST_FIXED, "tests/pair"])
DEFAULT_B = shlex.join([sys.executable, "-m", "tests.pair.peer"])
# virtio_net: the wire's NIC; rdma_rxe, ib_uverbs: soft-RoCE on it (loaded by name: busybox's
# modprobe does not follow the aliases `rdma link add` asks for); smc, smc_diag: SMC-R and its
# sockets' diagnostics. iproute2's ip and rdma by path (busybox's sh runs its own `ip` applet).
SETUP = """set -e
/.quark-vm/modprobe virtio_net
/.quark-vm/modprobe rdma_rxe
/.quark-vm/modprobe ib_uverbs
/.quark-vm/modprobe smc
/.quark-vm/modprobe smc_diag
IP=/usr/sbin/ip
$IP addr add {address}/24 dev eth0
$IP link set eth0 up
/usr/bin/rdma link add rxe0 type rxe netdev eth0
/usr/bin/rdma link show rxe0/1
set +e
"""
B_GRACE_S = 120   # after a is done, b's command has this long to finish
LISTENING = re.compile(r"^\s*\d+: 0100007F:([0-9A-F]{4}) 00000000:0000 0A ", re.M)


def run_script(role: str, command: str) -> str:
    peer = "b" if role == "a" else "a"
    env = {"QUARK_PAIR_ROLE": role, "QUARK_PAIR_SELF": WIRE[role], "QUARK_PAIR_PEER": WIRE[peer],
           "QUARK_PAIR_DIR": GUEST_PAIR, "QUARK_VM_OUT": GUEST_OUT, "PYTHONDONTWRITEBYTECODE": "1"}
    return (SETUP.format(address=WIRE[role]) + f"cd {shlex.quote(str(PROJECT))} || exit 4\nmkdir -p {GUEST_OUT}\n"
            # SMC-R takes rxe0 for eth0's connections only once both are in one pnet (tests/support/smc.py)
            # (and SMC-R version 2, the one for RoCE v2, only between hosts with a common UEID)
            + f"{shlex.quote(sys.executable)} -m tests.support.smc pnet QUARKPAIR eth0 rxe0 || exit 5\n"
            + f"{shlex.quote(sys.executable)} -m tests.support.smc ueid QUARK.PAIR || exit 5\n"
            + f"exec env {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} sh -c {shlex.quote(command)}\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with open("/proc/net/tcp") as f:
        return any(int(p, 16) == port for p in LISTENING.findall(f.read()))


def run(commands: dict[str, str], timeout: float, memory: int, smp: int, out: Path | None = None,
        suite: str = "bookworm") -> int:
    start = time.monotonic()
    kernel, initramfs = prepare(suite)
    pair = Path(tempfile.mkdtemp(prefix="quark-pair-"))
    results = {role: Path(tempfile.mkdtemp(prefix=f"quark-vm-{role}-")) for role in ("a", "b")}
    keep = [str(PROJECT)] + ([sys.prefix] if not Path(sys.prefix).is_relative_to(PROJECT) else [])
    for role, res in results.items():
        (res / "run.sh").write_text(run_script(role, commands[role]))
        (res / "keep").write_text("".join(p + "\n" for p in keep))
        (res / "modules").write_text(f"{kernel.modules}\n")
        (res / "hostname").write_text(f"quark-pair-{role}\n")
    port = _free_port()
    guests: dict[str, subprocess.Popen] = {}
    consoles: dict[str, Console] = {}
    try:
        for role in ("a", "b"):
            wire = f"listen=127.0.0.1:{port}" if role == "a" else f"connect=127.0.0.1:{port}"
            extra = ("-netdev", f"socket,id=wire,{wire}", "-device", f"virtio-net-pci,netdev=wire,mac={MACS[role]}",
                     *share_argv("pair", str(pair)))
            guests[role] = subprocess.Popen(qemu_argv(kernel, initramfs, results[role], memory, smp, extra),
                                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            consoles[role] = Console(guests[role].stdout, prefix=f"[{role}] ".encode())
            if role == "a":   # b's qemu connects to a's at start-up: a must listen first
                deadline = time.monotonic() + 30
                while not _listening(port):
                    if guests["a"].poll() is not None or time.monotonic() > deadline:
                        raise LaneError("guest a's qemu did not listen for the wire")
                    time.sleep(0.05)
        launched = time.monotonic()
        guests["a"].wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
        (pair / "a-done").touch()   # (also when a's command never got to say so): b's peer stops
        guests["b"].wait(timeout=max(1.0, min(B_GRACE_S, timeout - (time.monotonic() - start))))
    except subprocess.TimeoutExpired:
        print(f"\nquark-pair: TIMEOUT: the guests ran past {timeout:.0f} s; killed their qemus. "
              f"Their files: {results['a']}, {results['b']}", flush=True)
        return 124
    finally:   # never leave a guest running (a timeout, ^C, one guest that failed to start)
        for role, qemu in guests.items():
            _stop(qemu)
            consoles[role].thread.join(5)
        shutil.rmtree(pair, ignore_errors=True)
    statuses = {}
    for role, res in results.items():
        statuses[role], why = guest_status(res, guests[role])
        if why:
            print(f"\nquark-pair: guest {role} reported no status ({why}). Its files: {res}", flush=True)
        if out is not None and (res / "out").is_dir():
            shutil.copytree(res / "out", out / role, dirs_exist_ok=True)
    output = (results["a"] / "output.log").read_text(errors="replace") if (results["a"] / "output.log").exists() else ""
    status = statuses["a"] or statuses["b"]
    print(f"\nrdma pair lane: {summary_line(output) or 'no pytest summary line'} | exit a {statuses['a']}, "
          f"b {statuses['b']} | lane {time.monotonic() - start:.0f} s (prepare {launched - start:.0f} s, "
          f"kernel {kernel.version}, TCG)", flush=True)
    for role, res in results.items():
        if status == 0:
            shutil.rmtree(res, ignore_errors=True)
        else:
            print(f"quark-pair: guest {role}'s output and dmesg kept in {res}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.vm.pair", description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=float(os.environ.get("QUARK_VM_TIMEOUT", "1800")),
                   help="seconds for the whole lane, boots included (default 1800, env QUARK_VM_TIMEOUT)")
    p.add_argument("--memory", type=int, default=1536, help="each guest's memory in MiB (default 1536)")
    p.add_argument("--smp", type=int, default=2, help="each guest's CPUs (default 2)")
    p.add_argument("--a", default=DEFAULT_A, help="guest a's shell command (default: pytest tests/pair)")
    p.add_argument("--b", default=DEFAULT_B, help="guest b's shell command (default: tests/pair/peer.py)")
    p.add_argument("--out", type=Path, help="copy what each command wrote under $QUARK_VM_OUT to DIR/a, DIR/b")
    p.add_argument("--kernel-suite", default="bookworm", choices=["bookworm", "bookworm-backports"],
                   help="whose kernel the guests boot (default bookworm's 6.1; backports' carries SMC-R over rxe)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # as ^C: run() kills both qemus
    try:
        return run({"a": a.a, "b": a.b}, a.timeout, a.memory, a.smp, a.out, a.kernel_suite)
    except (LaneError, OSError) as e:
        print(f"quark-pair: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
