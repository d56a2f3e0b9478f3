"""Does the kernel's SMC-R (AF_SMC: TCP's set-up, then RDMA) take the RoCE path here, and if not, why?

    .venv/bin/python -m tests.vm.lane --rdma --out /tmp/smc --command \
        '.venv/bin/python bench/smc_probe.py --json $QUARK_VM_OUT/smc.json'

Meant for the RDMA lane's guest (a soft-RoCE device, rxe0, on qrv0 10.211.0.1 in the root netns;
tests/vm/README.md), where it is the reference bench/tsor.py's rdma part is to be compared with. A
server and a client AF_SMC socket on ADDRESS exchange 1 MiB each way; then smc_diag (netlink
sock_diag, family AF_SMC) says for each socket whether the connection runs over SMC-R or fell back to
TCP, and the decline reason codes (SMC_CLC_DECL_*, include/uapi/linux/smc.h) of both sides. Debian 12
ships no smc-tools (smcss, smc_run), hence the netlink reading here (tests/support/smc.py). Between
two hosts with a RoCE path at both ends (the two-guest lane, tests/vm/pair.py) SMC-R negotiates but
its link does not come up on 6.1's rxe: tests/vm/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.smc import accept, bind, connect, load_modules, smc_diag, smc_socket  # noqa: E402

PAYLOAD = 1 << 20


def exchange(address: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A connected AF_SMC pair on address:port that moved PAYLOAD bytes each way; both ends open."""
    lst = smc_socket()
    bind(lst, address, port)
    lst.listen(1)
    got: list[socket.socket] = []

    def serve() -> None:
        conn = accept(lst)
        n = 0
        while n < PAYLOAD:
            n += len(conn.recv(PAYLOAD - n))
        conn.sendall(b"y" * PAYLOAD)
        got.append(conn)
    t = threading.Thread(target=serve)
    t.start()
    cli = smc_socket()
    connect(cli, address, port)
    cli.settimeout(60)
    cli.sendall(b"x" * PAYLOAD)
    n = 0
    while n < PAYLOAD:
        n += len(cli.recv(PAYLOAD - n))
    t.join(60)
    lst.close()
    return cli, got[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="10.211.0.1", help="where server and client meet (default: the "
                                                          "RDMA lane's rxe netdev)")
    p.add_argument("--port", type=int, default=7610)
    p.add_argument("--json")
    a = p.parse_args()
    load_modules()
    res: dict = {"address": a.address, "rdma_devices": sorted(os.listdir("/sys/class/infiniband"))
                 if os.path.isdir("/sys/class/infiniband") else []}
    try:
        cli, srv = exchange(a.address, a.port)
    except OSError as e:
        res["error"] = f"AF_SMC exchange failed: {e}"
    else:
        res["sockets"] = smc_diag()
        cli.close()
        srv.close()
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if "sockets" in res else 1


if __name__ == "__main__":
    sys.exit(main())
