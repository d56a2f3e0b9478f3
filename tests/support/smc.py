"""The kernel's SMC-R from Python: AF_SMC sockets (TCP's set-up, then RDMA between the two hosts'
RoCE devices, or a fallback to TCP) and smc_diag, which says which each connection took and why.
Python's socket module knows no address format for AF_SMC (its addresses are sockaddr_in), so bind,
connect and accept go through libc. Debian 12 ships no smc-tools (smcss, smc_run): the diagnostics
are read over netlink here. Used by bench/smc_probe.py and by the two-guest RDMA lane's set-up
(tests/vm/pair.py: a pnet and a UEID, without which SMC-R over soft-RoCE is never tried).
"""
from __future__ import annotations

import ctypes
import os
import socket
import struct
import subprocess

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
_libc = ctypes.CDLL(None, use_errno=True)


def _sockaddr_in(address: str, port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(address) + bytes(8)


def smc_socket() -> socket.socket:
    return socket.socket(AF_SMC, socket.SOCK_STREAM, SMCPROTO_SMC)


def bind(sock: socket.socket, address: str, port: int) -> None:
    _call(_libc.bind, sock, address, port)


def connect(sock: socket.socket, address: str, port: int) -> None:
    """On a blocking socket (a Python timeout makes it non-blocking: EINPROGRESS)."""
    _call(_libc.connect, sock, address, port)


def accept(listener: socket.socket) -> socket.socket:
    fd = _libc.accept(listener.fileno(), None, None)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"accept: {os.strerror(err)}")
    return socket.socket(fileno=fd)


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


# generic netlink: the controller (family ids by name) and SMC-R's pnet table (include/uapi/linux/smc.h)
NETLINK_GENERIC, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 16, 0x10, 3, 1, 2
NLM_F_ACK = 0x4
SMC_PNETID_ADD = 2
SMC_PNETID_NAME, SMC_PNETID_ETHNAME, SMC_PNETID_IBNAME, SMC_PNETID_IBPORT = 1, 2, 3, 4
SMC_NETLINK_ADD_UEID, SMC_NLA_EID_TABLE_ENTRY, SMC_MAX_EID_LEN = 10, 1, 32


def _attr(kind: int, value: bytes) -> bytes:
    return struct.pack("=HH", 4 + len(value), kind) + value + bytes(-len(value) % 4)


def _genl(nl: socket.socket, family: int, cmd: int, attrs: bytes, flags: int = NLM_F_REQUEST | NLM_F_ACK) -> bytes:
    """One request and its answer (an error raised)."""
    body = struct.pack("=BBH", cmd, 1, 0) + attrs
    nl.sendall(struct.pack("=IHHII", 16 + len(body), family, flags, 1, 0) + body)
    data = nl.recv(65536)
    _, kind = struct.unpack_from("=IH", data, 0)
    if kind == NLMSG_ERROR:
        err = -struct.unpack_from("=i", data, 16)[0]
        if err:
            raise OSError(err, os.strerror(err))
    return data


def _family(nl: socket.socket, name: str) -> int:
    """A generic netlink family's id, by its name."""
    reply = _genl(nl, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, _attr(CTRL_ATTR_FAMILY_NAME, name.encode() + b"\0"),
                  NLM_F_REQUEST)
    pos = 20
    while pos + 4 <= len(reply):
        alen, atype = struct.unpack_from("=HH", reply, pos)
        if atype == CTRL_ATTR_FAMILY_ID:
            return struct.unpack_from("=H", reply, pos + 4)[0]
        pos += max(4, (alen + 3) & ~3)
    raise OSError(f"no {name} generic netlink family (is the smc module loaded?)")


def add_ueid(ueid: str) -> None:
    """Add a User Enterprise ID (what smc-tools' `smcd ueid add` does). SMC-R version 2, the one
    that runs over RoCE v2 (routable, IPv4 GIDs: soft-RoCE's only kind), is proposed and accepted
    only between hosts that share one; version 1 needs RoCE v1 GIDs, which rxe does not have.
    Upper-case letters, digits and dots, padded to 32 characters with blanks as the CLC carries it."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC) as nl:
        _genl(nl, _family(nl, "SMC_GEN_NETLINK"), SMC_NETLINK_ADD_UEID,
              _attr(SMC_NLA_EID_TABLE_ENTRY, ueid.ljust(SMC_MAX_EID_LEN).encode() + b"\0"))


def add_pnetid(pnetid: str, netdev: str, ibdev: str, port: int = 1) -> None:
    """Put `netdev` and `ibdev`'s `port` in one physical network (what smc-tools' `smc_pnet -a` does):
    SMC-R then takes that RoCE port for connections over that netdev. A soft-RoCE port has no
    pnetid of its own, and rxe gives SMC no way to match it to its netdev otherwise (the
    connection falls back to TCP, "no SMC-R device found")."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC) as nl:
        family = _family(nl, "SMC_PNETID")
        _genl(nl, family, SMC_PNETID_ADD,
              _attr(SMC_PNETID_NAME, pnetid.encode() + b"\0") + _attr(SMC_PNETID_ETHNAME, netdev.encode() + b"\0")
              + _attr(SMC_PNETID_IBNAME, ibdev.encode() + b"\0") + _attr(SMC_PNETID_IBPORT, bytes([port])))


if __name__ == "__main__":   # the pair lane's set-up (tests/vm/pair.py)
    import sys
    if len(sys.argv) >= 5 and sys.argv[1] == "pnet":
        add_pnetid(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 1)
    elif len(sys.argv) == 3 and sys.argv[1] == "ueid":
        add_ueid(sys.argv[2])
    else:
        sys.exit("usage: python -m tests.support.smc pnet PNETID NETDEV IBDEV [PORT] | ueid UEID")
