"""Does the kernel's SMC-R (AF_SMC: TCP's set-up, then RDMA) take the RoCE path here, and if not, why?

    .venv/bin/python -m tests.vm.lane --rdma --out /tmp/smc --command \
        '.venv/bin/python bench/smc_probe.py --json $QUARK_VM_OUT/smc.json'

Meant for the RDMA lane's guest (a soft-RoCE device, rxe0, on qrv0 10.211.0.1 in the root netns;
tests/vm/README.md), where it is the reference bench/tsor.py's rdma part is to be compared with. A
server and a client AF_SMC socket on ADDRESS exchange 1 MiB each way; then smc_diag (netlink
sock_diag, family AF_SMC) says for each socket whether the connection runs over SMC-R or fell back to
TCP, and the decline reason codes (SMC_CLC_DECL_*, include/uapi/linux/smc.h) of both sides. Debian 12
ships no smc-tools (smcss, smc_run), hence the netlink reading here.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import struct
import subprocess
import sys
import threading

AF_SMC = 43
SMCPROTO_SMC = 0
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
SMC_DIAG_FALLBACK = 5
MODES = {0: "SMC-R", 1: "fallback to TCP", 2: "SMC-D"}
# include/uapi/linux/smc.h (6.1)
DECLINES = {0x01010000: "insufficient memory", 0x02010000: "timeout waiting for QP confirm link",
            0x02020000: "timeout waiting for QP add link", 0x03000000: "configuration error",
            0x03010000: "peer did not indicate SMC", 0x03020000: "IPsec in use",
            0x03030000: "no SMC device found (R or D)", 0x03030001: "no SMC-D device found",
            0x03030002: "no SMC-R device found", 0x03030003: "hardware has no ISMv2 support",
            0x03030004: "peer sent no CLC v2 extension", 0x03030005: "peer sent no SMC-Dv2 extension",
            0x03030006: "peer sent no SEID", 0x03030007: "no SMC-Dv2 device found",
            0x03030008: "peer sent no UEID", 0x03040000: "SMC modes do not match (R or D)",
            0x03050000: "peer has eyecatcher in RMBE", 0x03060000: "fastopen sockopt not supported",
            0x03070000: "IP prefix / subnet mismatch", 0x03080000: "cannot get the VLAN id of the IP device",
            0x030a0000: "no active SMC-R link in the link group", 0x030b0000: "SMC-R link from server not found",
            0x030c0000: "SMC version mismatch", 0x030e0000: "no route", 0x030f0000: "no indirect route",
            0x04000000: "synchronization error", 0x05000000: "peer declined during handshake",
            0x09990000: "internal error", 0x09990001: "rtoken handling failed",
            0x09990002: "ib ready link failed"}
PAYLOAD = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _sockaddr_in(address: str, port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(address) + bytes(8)


def _call(fn, sock: socket.socket, address: str, port: int) -> None:
    """bind/connect an AF_SMC socket: Python's socket module knows no address format for AF_SMC,
    whose addresses are sockaddr_in (SMCPROTO_SMC)."""
    addr = _sockaddr_in(address, port)
    if fn(sock.fileno(), addr, len(addr)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{fn.__name__}({address}:{port}): {os.strerror(err)}")


def load_modules() -> None:
    """The guest's modprobe (busybox, from the lane) for smc and smc_diag; elsewhere the host's."""
    modprobe = "/.quark-vm/modprobe" if os.path.exists("/.quark-vm/modprobe") else "modprobe"
    for mod in ("smc", "smc_diag"):
        subprocess.run([modprobe, mod], capture_output=True)


def exchange(address: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A connected AF_SMC pair on address:port that moved PAYLOAD bytes each way; both ends open."""
    lst = socket.socket(AF_SMC, socket.SOCK_STREAM, SMCPROTO_SMC)
    _call(_libc.bind, lst, address, port)
    lst.listen(1)
    got: list[socket.socket] = []

    def serve() -> None:
        conn = socket.socket(fileno=_libc.accept(lst.fileno(), None, None))
        n = 0
        while n < PAYLOAD:
            n += len(conn.recv(PAYLOAD - n))
        conn.sendall(b"y" * PAYLOAD)
        got.append(conn)
    t = threading.Thread(target=serve)
    t.start()
    cli = socket.socket(AF_SMC, socket.SOCK_STREAM, SMCPROTO_SMC)
    _call(_libc.connect, cli, address, port)
    cli.settimeout(60)
    cli.sendall(b"x" * PAYLOAD)
    n = 0
    while n < PAYLOAD:
        n += len(cli.recv(PAYLOAD - n))
    t.join(60)
    lst.close()
    return cli, got[0]


def smc_diag() -> list[dict]:
    """Every AF_SMC socket of this netns: ports, mode, and the fallback reasons (smc_diag)."""
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4)   # NETLINK_SOCK_DIAG
    # smc_diag_req: family, pad[2], diag_ext, inet_diag_sockid (48 bytes of zeros: every socket)
    req = struct.pack("=BBBB", AF_SMC, 0, 0, 0xFF) + bytes(48)
    nl.sendall(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
    out = []
    while True:
        data = nl.recv(65536)
        pos = 0
        while pos < len(data):
            length, kind, _, _, _ = struct.unpack_from("=IHHII", data, pos)
            if kind == NLMSG_DONE:
                nl.close()
                return out
            if kind == NLMSG_ERROR:
                err = -struct.unpack_from("=i", data, pos + 16)[0]
                nl.close()
                raise OSError(err, f"smc_diag: {os.strerror(err)}")
            body = data[pos + 16:pos + length]
            # smc_diag_msg: family, state, mode, shutdown, sockid (sport, dport big-endian first), uid, inode
            _, state, mode, _ = struct.unpack_from("=BBBB", body, 0)
            sport, dport = struct.unpack_from("!HH", body, 4)
            entry = {"sport": sport, "dport": dport, "state": state, "mode": MODES.get(mode, str(mode))}
            apos = 4 + 48 + 4 + 8   # the attributes after the fixed part
            while apos + 4 <= len(body):
                alen, atype = struct.unpack_from("=HH", body, apos)
                if alen < 4:
                    break
                if atype == SMC_DIAG_FALLBACK:
                    reason, peer = struct.unpack_from("=II", body, apos + 4)
                    entry["fallback_reason"] = f"{reason:#010x} {DECLINES.get(reason, '')}".strip()
                    entry["peer_diagnosis"] = f"{peer:#010x} {DECLINES.get(peer, '')}".strip()
                apos += (alen + 3) & ~3
            out.append(entry)
            pos += (length + 3) & ~3


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
