"""The sockmap local path: no trapped call at all between quark pods of one node.

With `local_path: sockmap` in tsor.yaml, a connection between two quark pods on this node is made by
the kernel's own TCP, through the pods' veths and bridge — so the node's packet filters, and with
them NetworkPolicy, decide it exactly as they do without quark — and the bytes of the established
connection are moved socket to socket by the kernel: a SOCK_OPS program puts both ends into a
SOCKHASH when they become established, and an SK_MSG program on that map hands each `sendmsg` to
the peer's receive queue. The sandboxes trap none of the socket family (qvisor's `_socket_filter`):
set-up, close, every option and TCP_INFO are the kernel's. What it costs and gives, measured against
the socketpair local path, is in bench/README.md ("The sockmap local path, built", and the probe
before it, "A local path with no trap").

Three rules keep it safe (bench/README.md, "A local path with no trap", says how each was found):
- Only quark pods, keyed so that keys cannot collide: the programs sit on the unified hierarchy's
  root (every socket of the node passes them), and an end is inserted only when its local address
  is registered here (`register`) *for that socket's network namespace* (the namespace's cookie)
  and its remote address is registered too. Two pods' loopback connections, or an address reused
  in another namespace, never enter; an existing entry is never replaced (BPF_NOEXIST).
- One way per direction: the first `sendmsg` of an end decides — redirected if the peer's end is in
  the map, else the stack — and the choice sticks (kept in the socket's own storage, freed with it).
  Otherwise a message sent through the stack before the peer's end was inserted could be read after
  a later, redirected one. An end that received bytes before it was established (TCP Fast Open
  data in the SYN) is not inserted, for the same reason.
- Outliving tsord: the programs stay attached, and the maps alive, when tsord exits; sockets stay in
  the map and their bytes in flight are not lost. The next tsord finds them by name and takes them
  over (a newer version replaces older programs; connections made under the old ones keep them).
  Each end keeps the SK_MSG program (and so the storage map with its way) that was attached when it
  entered the sockhash: the kernel copies the map's programs into the socket's psock then. A tsord
  taking over attaches a new program and storage map for the ends to come; the ways of the ends
  already there stay in force (tests/integration/test_tsor_sockmap.py checks it across a restart).

Half-close: the kernel's receive path for a socket in a sockmap (tcp_bpf_recvmsg) takes any wake-up
of a blocking reader that finds no data for a timeout and answers EAGAIN. A reader's own FIN being
acknowledged wakes it so (FIN_WAIT1 -> FIN_WAIT2 is a state change), which is exactly a client that
sends, shuts down its writing side and blocks for the reply (how often: bench/README.md,
"Half-close on the sockmap path"). A sockmap sandbox's filter traps shutdown(SHUT_WR/SHUT_RDWR)
alone of the socket family, and its supervisor (tsor/intercept.py) shuts the socket down and
returns once tsord says the end is in the map (`SockmapPath.holds`) and the FIN is acknowledged, so
that wake-up comes before the next read. A signal that interrupts a blocking read on a carried
socket gets the same EAGAIN (where TCP would restart the read or say EINTR): the kernel's, not
fixed here.

IPv4 only: an AF_INET6 socket is carried when both its addresses are IPv4-mapped (a dual-stack
listener's connection from an IPv4 client); IPv6 connections take the stack. Connections to a
Service ClusterIP are rewritten by the node's NAT, not in the socket, so their ends' keys do not
pair up: they take the stack.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading

from qlib import bpf
from tsor import _sys
from tsor.addr import unmapped
from qlib.bpf import ADD64_K, CALL, EXIT, JEQ_K, JNE_K, LDX_DW, LDX_W, MOV64_K, MOV64_X, STX_W, Asm

log = logging.getLogger("tsor.sockmap")

VERSION = 2          # 2: IPv4-mapped ends of AF_INET6 sockets (dual-stack listeners) carried too
PREFIX = "quark_smap"
OPS_NAME, MSG_NAME = f"{PREFIX}{VERSION}_ops", f"{PREFIX}{VERSION}_msg"
PROG_TYPE_SOCK_OPS, PROG_TYPE_SK_MSG = 13, 16
CGROUP_SOCK_OPS, SK_MSG_VERDICT = 3, 7                  # enum bpf_attach_type
MAP_TYPE_HASH, MAP_TYPE_SOCKHASH = 1, 18
FUNC_MAP_LOOKUP, FUNC_SOCK_HASH_UPDATE, FUNC_MSG_REDIRECT_HASH, FUNC_GET_NETNS_COOKIE = 1, 70, 71, 122
ACTIVE_ESTABLISHED_CB, PASSIVE_ESTABLISHED_CB = 4, 5
NOEXIST, F_INGRESS, SK_PASS = 1, 1, 1
JNE_X, RSH64_K, LSH64_K, TO_BE = 0x5D, 0x77, 0x67, 0xDC
WAY_STACK, WAY_REDIRECT = 1, 2
MAX_PAIRS, MAX_ADDRS = 65536, 16384
# struct bpf_sock_ops: op @0, family @20, remote_ip4 @24, local_ip4 @28, remote_ip6 @32, local_ip6 @48,
# remote_port @64 (network order in the high 16 bits), local_port @68 (host order), bytes_received
# @168 (u64). remote_ip4/local_ip4 read the socket's IPv4 addresses, which an AF_INET6 socket has when
# its addresses are IPv4-mapped (::ffff:a.b.c.d: a dual-stack listener's connection from an IPv4
# peer, as Go's and Java's servers make by default); a truly IPv6 one holds a placeholder there.
# struct sk_msg_md: family @16, remote_ip4 @20, local_ip4 @24, remote_port @60, local_port @64, sk @72
_OPS_FAMILY, _OPS_RIP, _OPS_LIP, _OPS_RPORT, _OPS_LPORT, _OPS_BYTES_RECEIVED = 20, 24, 28, 64, 68, 168
_OPS_RIP6, _OPS_LIP6 = 32, 48
MAPPED_WORD = 0xFFFF0000     # the third 32-bit word of ::ffff:a.b.c.d, as a little-endian load reads it
_MSG_FAMILY, _MSG_RIP, _MSG_LIP, _MSG_RPORT, _MSG_LPORT, _MSG_SK = 16, 20, 24, 60, 64, 72


def sock_ops_program(addrs_fd: int, pairs_fd: int) -> bytes:
    """On an end becoming established: into `pairs` (key: local address, remote address, local port,
    remote port, as the socket has them) when both addresses are registered quark pods' and the local
    one is registered for this socket's network namespace."""
    a = Asm()
    a(MOV64_X, 6, 1)
    a(LDX_W, 2, 6, 0)
    a.j(JEQ_K, 2, ACTIVE_ESTABLISHED_CB, "established").j(JNE_K, 2, PASSIVE_ESTABLISHED_CB, "out")
    a(LDX_DW, 2, 6, _OPS_BYTES_RECEIVED).j(JNE_K, 2, 0, "out")   # Fast Open data already queued
    a.label("established")
    a(LDX_W, 2, 6, _OPS_FAMILY).j(JEQ_K, 2, socket.AF_INET, "ipv4").j(JNE_K, 2, socket.AF_INET6, "out")
    a(MOV64_K, 3, 0, 0, MAPPED_WORD >> 16)(LSH64_K, 3, 0, 0, 16)   # (as an imm it would be sign-extended)
    for base in (_OPS_LIP6, _OPS_RIP6):                        # AF_INET6: both ends IPv4-mapped, or out
        a(LDX_W, 2, 6, base).j(JNE_K, 2, 0, "out")(LDX_W, 2, 6, base + 4).j(JNE_K, 2, 0, "out")
        a(LDX_W, 2, 6, base + 8).j(JNE_X, 2, 0, "out", src=3)
    a.label("ipv4")
    a(MOV64_X, 1, 6)(CALL, 0, 0, 0, FUNC_GET_NETNS_COOKIE)(MOV64_X, 7, 0)          # r7 = this netns
    a(LDX_W, 2, 6, _OPS_LIP)(STX_W, 10, 2, -4)
    a.map_fd(1, addrs_fd)(MOV64_X, 2, 10)(ADD64_K, 2, 0, 0, -4)(CALL, 0, 0, 0, FUNC_MAP_LOOKUP)
    a.j(JEQ_K, 0, 0, "out")
    a(LDX_DW, 2, 0, 0).j(JNE_X, 2, 0, "out", src=7)                                  # another netns's
    a(LDX_W, 2, 6, _OPS_RIP)(STX_W, 10, 2, -8)
    a.map_fd(1, addrs_fd)(MOV64_X, 2, 10)(ADD64_K, 2, 0, 0, -8)(CALL, 0, 0, 0, FUNC_MAP_LOOKUP)
    a.j(JEQ_K, 0, 0, "out")
    for off, slot in ((_OPS_LIP, -24), (_OPS_RIP, -20), (_OPS_LPORT, -16), (_OPS_RPORT, -12)):
        a(LDX_W, 2, 6, off)(STX_W, 10, 2, slot)
    a(MOV64_X, 1, 6).map_fd(2, pairs_fd)(MOV64_X, 3, 10)(ADD64_K, 3, 0, 0, -24)(MOV64_K, 4, 0, 0, NOEXIST)
    a(CALL, 0, 0, 0, FUNC_SOCK_HASH_UPDATE)
    a.label("out")
    return a(MOV64_K, 0, 0, 0, 1)(EXIT).code()


def sk_msg_program(pairs_fd: int, ways_fd: int) -> bytes:
    """Each sendmsg of an end in `pairs`: to the peer end's receive queue (the key reversed) if the
    end's first message went there, through the stack if its first message did."""
    a = Asm()
    a(MOV64_X, 6, 1)
    # only ends the sock_ops program put in the map come here: IPv4, or IPv4-mapped AF_INET6
    a(LDX_W, 2, 6, _MSG_FAMILY).j(JEQ_K, 2, socket.AF_INET, "ipv4").j(JNE_K, 2, socket.AF_INET6, "pass")
    a.label("ipv4")
    a(LDX_DW, 2, 6, _MSG_SK).j(JEQ_K, 2, 0, "pass")
    a.map_fd(1, ways_fd)(MOV64_K, 3, 0, 0, 0)(MOV64_K, 4, 0, 0, bpf.SK_STORAGE_GET_F_CREATE)
    a(CALL, 0, 0, 0, bpf.FUNC_SK_STORAGE_GET).j(JEQ_K, 0, 0, "pass")                # no memory: the stack
    a(MOV64_X, 7, 0)(LDX_W, 8, 7, 0).j(JEQ_K, 8, WAY_STACK, "pass")
    a(LDX_W, 2, 6, _MSG_RIP)(STX_W, 10, 2, -16)                  # the peer's local address: our remote
    a(LDX_W, 2, 6, _MSG_LIP)(STX_W, 10, 2, -12)
    a(LDX_W, 2, 6, _MSG_RPORT)(RSH64_K, 2, 0, 0, 16)(TO_BE, 2, 0, 0, 16)(STX_W, 10, 2, -8)   # its port, host order
    a(LDX_W, 2, 6, _MSG_LPORT)(TO_BE, 2, 0, 0, 16)(LSH64_K, 2, 0, 0, 16)(STX_W, 10, 2, -4)   # ours, network << 16
    a(MOV64_X, 1, 6).map_fd(2, pairs_fd)(MOV64_X, 3, 10)(ADD64_K, 3, 0, 0, -16)(MOV64_K, 4, 0, 0, F_INGRESS)
    a(CALL, 0, 0, 0, FUNC_MSG_REDIRECT_HASH)
    a.j(JNE_K, 0, SK_PASS, "not_found")
    a.j(JEQ_K, 8, WAY_REDIRECT, "redirect")
    a(MOV64_K, 2, 0, 0, WAY_REDIRECT)(STX_W, 7, 2, 0)
    a.label("redirect")
    a(MOV64_K, 0, 0, 0, SK_PASS)(EXIT)
    a.label("not_found")
    # undecided: the stack from now on; decided for redirect and the peer gone from the map (it
    # closed): the stack too, where its kernel answers with a reset as it would have
    a.j(JNE_K, 8, 0, "pass")
    a(MOV64_K, 2, 0, 0, WAY_STACK)(STX_W, 7, 2, 0)
    a.label("pass")
    return a(MOV64_K, 0, 0, 0, SK_PASS)(EXIT).code()


def _addr_key(ip: str) -> bytes:
    return socket.inet_aton(ip)


class Registrar:
    """Keeps the programs' address map equal to what tsord asks for: the addresses of the quark
    sandboxes registered with it (their hellos), each with its namespace's cookie."""

    def __init__(self, path: SockmapPath) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._cookies: dict[int, int] = {}     # netns inode -> cookie
        self._set: dict[str, int] = {}         # address -> cookie, as the map holds them

    def sync(self, want: dict[str, tuple[str, int]]) -> None:
        """`want`: address -> (a path naming its network namespace, that namespace's inode)."""
        with self._lock:
            cookies = {}
            wanted: dict[str, int] = {}
            for ip, (ns_path, inode) in want.items():
                if ":" in ip:
                    continue
                cookie = self._cookies.get(inode) or cookies.get(inode) or _sys.netns_cookie(ns_path, inode)
                if cookie is None:
                    log.debug("sockmap: %s not carried: its network namespace %s is gone", ip, ns_path)
                    continue   # the namespace is gone (or the path names another one now)
                cookies[inode] = cookie
                wanted[ip] = cookie
            for ip in set(self._set) - set(wanted):
                self.path.unregister(ip)
                del self._set[ip]
            for ip, cookie in wanted.items():
                if self._set.get(ip) != cookie:
                    log.debug("sockmap: %s carried (network namespace cookie %d)", ip, cookie)
                    self.path.register(ip, cookie)
                    self._set[ip] = cookie
            self._cookies = cookies


class SockmapPath:
    """The programs and maps, attached to the unified hierarchy's root; tsord's registrations."""

    def __init__(self, root_fd: int, ops: int, msg: int, addrs: int, pairs: int, ways: int) -> None:
        self.root_fd, self.ops, self.msg, self.addrs, self.pairs, self.ways = root_fd, ops, msg, addrs, pairs, ways

    @classmethod
    def open(cls, cgroup_root: str) -> SockmapPath:
        """Take over the programs a tsord before us left attached, or attach new ones. OSError (its
        message names the step) when the kernel cannot: no cgroup2, no BPF, a helper missing."""
        root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fds: list[int] = []
        found: dict[str, tuple[int, list[int]]] = {}
        try:
            found = _attached(root_fd)
            if OPS_NAME in found:
                ops, map_ids = found.pop(OPS_NAME)
                fds.append(ops)
                maps = {}
                for map_id in map_ids:
                    fd = bpf.map_by_id(map_id)
                    fds.append(fd)
                    maps[bpf.map_info(fd)[:2]] = fd
                addrs, pairs = maps[(MAP_TYPE_HASH, 4)], maps[(MAP_TYPE_SOCKHASH, 16)]
                log.info("sockmap: took over the programs already attached")
            else:
                addrs = bpf.map_create(MAP_TYPE_HASH, 4, 8, MAX_ADDRS, "quark_smap_addrs", bpf.F_NO_PREALLOC)
                fds.append(addrs)
                pairs = bpf.map_create(MAP_TYPE_SOCKHASH, 16, 8, MAX_PAIRS, "quark_smap_pairs")
                fds.append(pairs)
                ops = bpf.load(PROG_TYPE_SOCK_OPS, sock_ops_program(addrs, pairs), OPS_NAME)
                fds.append(ops)
            ways = bpf.sk_storage_map("quark_smap_ways")
            fds.append(ways)
            msg = bpf.load(PROG_TYPE_SK_MSG, sk_msg_program(pairs, ways), MSG_NAME)
            fds.append(msg)
            # to the map (replacing the verdict program a tsord before us attached), then to the root
            bpf.attach(pairs, msg, SK_MSG_VERDICT, what="attaching the sk_msg program to the sockhash")
            if OPS_NAME not in _attached_names(root_fd):
                bpf.attach(root_fd, ops, CGROUP_SOCK_OPS, bpf.F_ALLOW_MULTI,
                           what=f"attaching the sock_ops program to {cgroup_root}")
            for name, (old, _) in found.items():   # an older version's: no new connections under it
                bpf.detach(root_fd, old, CGROUP_SOCK_OPS)
                log.info("sockmap: replaced %s", name)
        except BaseException:
            for fd in fds + [root_fd]:
                os.close(fd)
            raise
        finally:
            for old, _ in found.values():
                os.close(old)
        return cls(root_fd, ops, msg, addrs, pairs, ways)

    def register(self, ip: str, cookie: int) -> None:
        """Connections from `ip` in the network namespace `cookie` (IPv4; others are not carried)."""
        if ":" in ip:
            return
        bpf.map_update(self.addrs, _addr_key(ip), struct.pack("Q", cookie))

    def unregister(self, ip: str) -> None:
        if ":" not in ip:
            bpf.map_delete(self.addrs, _addr_key(ip))

    def registered(self) -> dict[str, int]:
        out = {}
        for key in bpf.map_keys(self.addrs, 4):
            value = bpf.map_lookup(self.addrs, key, 8)
            if value is not None:
                out[socket.inet_ntoa(key)] = struct.unpack("Q", value)[0]
        return out

    def clear(self) -> None:
        for key in bpf.map_keys(self.addrs, 4):
            bpf.map_delete(self.addrs, key)

    def holds(self, local: tuple[str, int], remote: tuple[str, int], cookie: int) -> bool:
        """Is this end (the socket whose SO_COOKIE is `cookie`) in the map: are its bytes moved socket
        to socket? A user-space lookup of a sockhash answers the socket's cookie."""
        key = _pair_key(local, remote)
        return key is not None and bpf.map_lookup(self.pairs, key, 8) == struct.pack("Q", cookie)

    def connections(self) -> int:
        """Ends in the map now (two per carried connection)."""
        return len(bpf.map_keys(self.pairs, 16))

    def close(self) -> None:
        """tsord exits: the programs stay attached (connections keep their way), the fds go."""
        for fd in (self.ops, self.msg, self.addrs, self.pairs, self.ways, self.root_fd):
            os.close(fd)

    def remove(self) -> None:
        """Detach from the root and close: new connections take the stack. Ends still in the map lose
        the bytes waiting in their message queues when it is freed, so tsord does this only when
        none is left (`connections() == 0`), and tests after their connections are closed."""
        try:
            bpf.detach(self.root_fd, self.ops, CGROUP_SOCK_OPS)
        except OSError as e:
            log.warning("sockmap: %s", e)
        self.close()


SO_COOKIE = 57


def end_of(sock: socket.socket) -> tuple[tuple[str, int], tuple[str, int], int] | None:
    """(local, remote, cookie) of a connected TCP socket: what `SockmapPath.holds` asks about."""
    try:
        return sock.getsockname()[:2], sock.getpeername()[:2], struct.unpack(
            "Q", sock.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]
    except OSError:
        return None


def _pair_key(local: tuple[str, int], remote: tuple[str, int]) -> bytes | None:
    """The pairs map's key of an end, as the sock_ops program writes it (local and remote address,
    local port in host order, remote port in network order in the high half); None when it is not
    an IPv4 (or IPv4-mapped) connection, which the map never holds."""
    lip, rip = unmapped(local[0]), unmapped(remote[0])
    if ":" in lip or ":" in rip:
        return None
    return socket.inet_aton(lip) + socket.inet_aton(rip) + struct.pack("=I", local[1]) + struct.pack("!xxH", remote[1])


def _attached(root_fd: int) -> dict[str, tuple[int, list[int]]]:
    """quark's sock_ops programs on the root: name -> (an fd of it, the ids of its maps)."""
    out = {}
    for pid in bpf.query(root_fd, CGROUP_SOCK_OPS)[1]:
        try:
            fd = bpf.prog_by_id(pid)
        except OSError:
            continue
        name, maps = bpf.prog_info(fd)
        if name.startswith(PREFIX):
            out[name] = (fd, maps)
        else:
            os.close(fd)
    return out


def _attached_names(root_fd: int) -> set[str]:
    found = _attached(root_fd)
    for fd, _ in found.values():
        os.close(fd)
    return set(found)


def attached_names(cgroup_root: str) -> set[str]:
    """The names of quark's sock_ops programs attached to the root (a tsord's, running or gone)."""
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _attached_names(root_fd)
    finally:
        os.close(root_fd)


def retire(cgroup_root: str) -> str | None:
    """A tsord with the socketpair local path found a sockmap one's programs attached: detach them
    if no connection is carried any more, else stop new ones (the address map emptied) and leave
    them for the connections that still use them. What it did, for the log; None: nothing there."""
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = _attached(root_fd)
        said = []
        for name, (fd, map_ids) in found.items():
            maps = {}
            try:
                for map_id in map_ids:
                    mfd = bpf.map_by_id(map_id)
                    maps[bpf.map_info(mfd)[:2]] = mfd
                addrs, pairs = maps.get((MAP_TYPE_HASH, 4)), maps.get((MAP_TYPE_SOCKHASH, 16))
                ends = len(bpf.map_keys(pairs, 16)) if pairs is not None else 0
                if ends == 0:
                    bpf.detach(root_fd, fd, CGROUP_SOCK_OPS)
                    said.append(f"{name} detached")
                else:
                    for key in bpf.map_keys(addrs, 4) if addrs is not None else ():
                        bpf.map_delete(addrs, key)
                    said.append(f"{name} left attached for the {ends // 2} connections it still carries "
                                "(no new ones); a later tsord detaches it")
            finally:
                os.close(fd)
                for mfd in maps.values():
                    os.close(mfd)
        return "; ".join(said) or None
    finally:
        os.close(root_fd)


def remove_attached(cgroup_root: str) -> int:
    """Detach every program of quark's from the root (tests' clean-up; an operator turning the
    sockmap path off for good): how many."""
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = _attached(root_fd)
        for fd, _ in found.values():
            try:
                bpf.detach(root_fd, fd, CGROUP_SOCK_OPS)
            finally:
                os.close(fd)
        return len(found)
    finally:
        os.close(root_fd)
