"""Guest b of the two-guest RDMA lane (tests/vm/pair.py): the far host the tests on guest a
(tests/pair) talk to, over the wire between them.

It serves, on its wire address, until guest a writes $QUARK_PAIR_DIR/a-done (or PEER_TIMEOUT_S):
- ECHO_PORT, TCP: each connection's bytes back (the wire works);
- APP_PORT, TCP: what a connection the rdma transport carries is served (rdma_node.serve_app: echo
  or hash by its first byte), for plain TCP side by side with the link (bench/pair_rdma.py);
- with --smc, SMC_APP_PORT, AF_SMC: the same, over the kernel's SMC-R (bench/pair_rdma.py --smc;
  not by default: on 6.1's rxe an SMC-R connection hangs, tests/vm/README.md);
- rdma_node.CONTROL_PORT, TCP: each connection sets up a node of TSoR's rdma transport on this
  guest's RoCE device, linked to guest a's (tests/pair/rdma_node.py), serving what it carries.
Ready once $QUARK_PAIR_DIR/b-ready exists. Beside that, unless --no-node, quark node b of the remote path
(tests/pair/remote_node.py: a tsord, and a quark pod serving remote_node.SERVER); its pod's address
is in $QUARK_PAIR_DIR/b-node once it serves ($QUARK_PAIR_DIR/b-node-failed: why it does not).
When guest a writes $QUARK_PAIR_DIR/b-kill-tsord, node b's tsord is killed (SIGKILL) and, after
KILLED_FOR seconds, started again; $QUARK_PAIR_DIR/b-tsord-back says when it serves again.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.pair import rdma_node, remote_node  # noqa: E402

ECHO_PORT, APP_PORT, SMC_APP_PORT = 7601, 7604, 7605
PEER_TIMEOUT_S = 1500
KILLED_FOR = 3.0


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _serve(listener: socket.socket, handle, accept=lambda s: s.accept()[0]) -> None:
    while True:
        try:
            conn = accept(listener)
        except OSError:
            return
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def _node_b(pair: str, nodes: list) -> None:
    """Node b and its server pod; what guest a's tests/pair/test_remote_path.py dials."""
    try:
        node = remote_node.PairNode("b", *remote_node.wire())
        nodes.append(node)
        pod = node.pod("srv", remote_node.SERVER)
        deadline = time.monotonic() + 120
        while not os.path.exists(node.out("server-ready")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server pod never served; tsord's log: {node.node.log()[-2000:]}")
            time.sleep(0.1)
    except Exception as e:   # (guest a's test reads why)
        with open(os.path.join(pair, "b-node-failed"), "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        return
    with open(os.path.join(pair, "b-node.tmp"), "w") as f:
        f.write(pod.ip)
    os.replace(os.path.join(pair, "b-node.tmp"), os.path.join(pair, "b-node"))
    print("peer: node b serves", flush=True)


def main() -> int:
    address, pair = os.environ["QUARK_PAIR_SELF"], os.environ["QUARK_PAIR_DIR"]
    echo = socket.create_server((address, ECHO_PORT))
    app = socket.create_server((address, APP_PORT), backlog=128)
    control = socket.create_server((address, rdma_node.CONTROL_PORT))
    threading.Thread(target=_serve, args=(echo, _echo), daemon=True).start()
    threading.Thread(target=_serve, args=(control, rdma_node.serve_control), daemon=True).start()
    threading.Thread(target=_serve, args=(app, rdma_node.serve_app), daemon=True).start()
    if "--smc" in sys.argv[1:]:
        from tests.support import smc
        over_smc = smc.smc_socket()
        smc.bind(over_smc, address, SMC_APP_PORT)
        over_smc.listen(128)
        threading.Thread(target=_serve, args=(over_smc, rdma_node.serve_app, smc.accept), daemon=True).start()
    nodes: list = []
    if "--no-node" not in sys.argv[1:]:   # (a benchmark's quiet peer)
        threading.Thread(target=_node_b, args=(pair, nodes), daemon=True).start()
    open(os.path.join(pair, "b-ready"), "w").close()
    print("peer: serving", flush=True)
    try:
        return _wait_for_a(pair, nodes)
    finally:
        for node in nodes:
            node.close()


def _wait_for_a(pair: str, nodes: list) -> int:
    deadline = time.monotonic() + PEER_TIMEOUT_S
    while not os.path.exists(os.path.join(pair, "a-done")):
        if nodes and os.path.exists(os.path.join(pair, "b-kill-tsord")):
            os.unlink(os.path.join(pair, "b-kill-tsord"))
            nodes[0].kill_tsord()
            print("peer: node b's tsord killed", flush=True)
            time.sleep(KILLED_FOR)
            nodes[0].start_tsord()
            open(os.path.join(pair, "b-tsord-back"), "w").close()
            print("peer: node b's tsord back", flush=True)
        if time.monotonic() > deadline:
            print("peer: guest a never said it was done", flush=True)
            return 1
        time.sleep(0.2)
    print("peer: guest a is done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
