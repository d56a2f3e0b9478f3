"""The sockmap local path: no trapped call at all between quark pods of one node.

With `local_path: sockmap` in tsor.yaml, a connection between two quark pods on this node is made by
the kernel's own TCP, through the pods' veths and bridge — so the node's packet filters, and with
them NetworkPolicy, decide it exactly as they do without quark — and the bytes of the established
connection are moved socket to socket by the kernel: a SOCK_OPS program puts both ends into a
SOCKHASH when they become established, and an SK_MSG program on that map hands each `sendmsg` to
the peer's receive queue. The sandboxes trap none of the socket family (qvisor's `_socket_filter`):
set-up, close, every option and TCP_INFO are the kernel's. What it costs and gives, measured against
the socketpair local path, is in bench/README.md ("The sockmap local path, built", and the probe
before it, "A local path with no trap"). The programs are C, tsor/bpf/sockmap.bpf.c, compiled by
`make install` and loaded with libbpf (qlib/libbpf.py); this module attaches them and keeps their
maps.

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
  the map and their bytes in flight are not lost. The next tsord finds them by name among the root's
  sock_ops programs (bpf(2)'s query: the attached program holds its maps, so nothing is pinned) and
  takes them over (a newer version replaces older programs; connections made under the old ones
  keep them).
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
listener's connection from an IPv4 client); IPv6 connections take the stack. A quark pod's
connection to a Service ClusterIP is rewritten to one of its endpoints at connect() (tsor/service_lb.py),
so its ends are the two pods' own addresses and pair up here like any other; a Service the node's
NAT rewrites instead (those service_lb.py leaves alone) takes the stack: its ends' keys do not pair.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from qlib import bpf, libbpf
from tsor import kernel_sockets
from tsor.addr import unmapped

log = logging.getLogger("tsor.sockmap")

# The programs are tsor/bpf/sockmap.bpf.c, compiled by `make install`; their names there carry the
# version (bump both when a program changes: a newer version replaces older programs).
VERSION = 2          # 2: IPv4-mapped ends of AF_INET6 sockets (dual-stack listeners) carried too
PREFIX = "quark_smap"
OPS_NAME, MSG_NAME = f"{PREFIX}{VERSION}_ops", f"{PREFIX}{VERSION}_msg"
ADDRS_MAP, PAIRS_MAP, WAYS_MAP = "quark_smap_addrs", "quark_smap_pairs", "quark_smap_ways"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bpf", "sockmap.bpf.c")
OBJECT = SOURCE[:-1] + "o"
CGROUP_SOCK_OPS, SK_MSG_VERDICT = 3, 7                  # enum bpf_attach_type
# how a tsord taking over tells the maps of an attached sock_ops program apart: (type, key size)
ADDRS_KIND, PAIRS_KIND = (1, 4), (18, 16)               # BPF_MAP_TYPE_HASH, BPF_MAP_TYPE_SOCKHASH


def _addr_key(ip: str) -> bytes:
    return socket.inet_aton(ip)


class Registrar:
    """Keeps the programs' address map equal to what tsord asks for: the addresses of the quark
    sandboxes registered with it (their hellos), each with its namespace's cookie."""

    def __init__(self, path: SockmapPath, namespaces: Callable[[set[int]], None] | None = None) -> None:
        self.path = path
        self.namespaces = namespaces   # told the cookies of the namespaces registered (tsor/service_lb.py)
        self._lock = threading.Lock()
        self._cookies: dict[int, int] = {}     # netns inode -> cookie
        self._set: dict[str, int] = {}         # address -> cookie, as the map holds them
        self._by_cookie: dict[int, str] = {}   # ... and the other way (the remote path's verdicts)
        self.left_native: set[str] = set()     # addresses the map had no room for

    def address_of(self, cookie: int) -> str | None:
        """The IPv4 address of the registered pod whose network namespace has this cookie."""
        return self._by_cookie.get(cookie)

    def sync(self, want: dict[str, tuple[str, int]]) -> None:
        """`want`: address -> (a path naming its network namespace, that namespace's inode)."""
        with self._lock:
            cookies = {}
            wanted: dict[str, int] = {}
            for ip, (ns_path, inode) in want.items():
                if ":" in ip:
                    continue
                cookie = self._cookies.get(inode) or cookies.get(inode) or kernel_sockets.netns_cookie(ns_path, inode)
                if cookie is None:
                    log.debug("sockmap: %s not carried: its network namespace %s is gone", ip, ns_path)
                    continue   # the namespace is gone (or the path names another one now)
                cookies[inode] = cookie
                wanted[ip] = cookie
            for ip in set(self._set) - set(wanted):
                self.path.unregister(ip)
                del self._set[ip]
            full = set()
            for ip, cookie in wanted.items():
                if self._set.get(ip) != cookie:
                    try:
                        self.path.register(ip, cookie)
                    except OSError as e:
                        if not bpf.full(e):
                            raise
                        full.add(ip)   # its connections take the stack, as a runc pod's
                        continue
                    log.debug("sockmap: %s carried (network namespace cookie %d)", ip, cookie)
                    self._set[ip] = cookie
            if full and not self.left_native:
                log.warning("sockmap: the address map is full: %d pod addresses (e.g. %s) are not carried, their "
                            "connections take the stack, until there is room", len(full), sorted(full)[0])
            elif self.left_native and not full:
                log.info("sockmap: every registered pod address is carried again")
            self.left_native = full
            self._cookies = cookies
            self._by_cookie = {c: ip for ip, c in self._set.items()}
            if self.namespaces is not None:
                self.namespaces(set(wanted.values()))


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
        live: dict[tuple[int, int], int] = {}
        try:
            found = _attached(root_fd)
            reuse = None
            if OPS_NAME in found:
                ops, map_ids = found.pop(OPS_NAME)
                fds.append(ops)
                live = _maps(map_ids)
                reuse = {ADDRS_MAP: live[ADDRS_KIND], PAIRS_MAP: live[PAIRS_KIND]}
                log.info("sockmap: took over the programs already attached")
            # Taking over, the attached sock_ops program stays and with it its maps: only a new SK_MSG
            # program and storage map are loaded, for the ends to come (each end in the map keeps its own)
            loaded = libbpf.load(OBJECT, SOURCE, [MSG_NAME] if reuse else [OPS_NAME, MSG_NAME], reuse)
            fds += [*loaded.programs.values(), *loaded.maps.values()]
            if reuse is None:
                ops = loaded.programs[OPS_NAME]
            msg = loaded.programs[MSG_NAME]
            addrs, pairs, ways = (loaded.maps[name] for name in (ADDRS_MAP, PAIRS_MAP, WAYS_MAP))
            # to the map (replacing the verdict program a tsord before us attached), then to the root
            bpf.attach(pairs, msg, SK_MSG_VERDICT, what=f"attaching {MSG_NAME} to the sockhash")
            if OPS_NAME not in _attached_names(root_fd):
                bpf.attach(root_fd, ops, CGROUP_SOCK_OPS, bpf.F_ALLOW_MULTI,
                           what=f"attaching {OPS_NAME} to {cgroup_root}")
            for name, (old, _) in found.items():   # an older version's: no new connections under it
                bpf.detach(root_fd, old, CGROUP_SOCK_OPS)
                log.info("sockmap: replaced %s", name)
        except BaseException:
            for fd in fds + [root_fd]:
                os.close(fd)
            raise
        finally:
            for fd in [old for old, _ in found.values()] + list(live.values()):
                os.close(fd)
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


def _maps(map_ids: list[int]) -> dict[tuple[int, int], int]:
    """fds of the maps with these ids (an attached program's), by (type, key size)."""
    out: dict[tuple[int, int], int] = {}
    try:
        for map_id in map_ids:
            fd = bpf.map_by_id(map_id)
            out[bpf.map_info(fd)[:2]] = fd
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
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
            maps: dict[tuple[int, int], int] = {}
            try:
                maps = _maps(map_ids)
                addrs, pairs = maps.get(ADDRS_KIND), maps.get(PAIRS_KIND)
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
    """Detach every program of quark's from the root, the Service programs that go with this path
    (tsor/service_lb.py) included (tests' clean-up; an operator turning the sockmap path off for
    good): how many."""
    from tsor import service_lb
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        found = _attached(root_fd)
        for fd, _ in found.values():
            try:
                bpf.detach(root_fd, fd, CGROUP_SOCK_OPS)
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return len(found) + service_lb.remove_attached(cgroup_root)
