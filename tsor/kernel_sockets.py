"""TSoR's own kernel-facing helpers: a socket made in another network namespace, and the /proc
readers that tell which sockets a task holds and which addresses a network namespace has. The
Linux calls themselves (setns, pidfds) are qlib.linux's. Everything else in tsor/ is plain Python."""
from __future__ import annotations

import fcntl
import ipaddress
import os
import functools
import logging
import socket
import struct
from typing import Iterator

from qlib import procfs
from qlib.linux import CLONE_NEWNET, setns


def socket_in_netns(netns_fd: int, family: int) -> socket.socket:
    """A TCP socket created in another network namespace (sockets keep the netns they were made
    in). The calling thread enters that netns for the one socket() call and comes back."""
    return sockets_in_netns(netns_fd, family, 1)[0]


def socket_at(netns_path: str, family: int = socket.AF_INET) -> socket.socket:
    """A blocking TCP socket created in the network namespace at `netns_path` (/proc/PID/ns/net,
    /var/run/netns/NAME)."""
    fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        s = socket_in_netns(fd, family)
    finally:
        os.close(fd)
    s.setblocking(True)
    return s


SO_NETNS_COOKIE = 71


def netns_cookie(path: str, inode: int) -> int | None:
    """The cookie of the network namespace at `path` (/proc/PID/ns/net, /var/run/netns/NAME) —
    what BPF programs know a namespace by — or None when that is no longer the namespace `inode`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_ino != inode:
            return None
        with socket_in_netns(fd, socket.AF_INET) as s:
            return struct.unpack("Q", s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0]
    finally:
        os.close(fd)


def sockets_in_netns(netns_fd: int, family: int, count: int) -> list[socket.socket]:
    """`count` non-blocking TCP sockets made in another network namespace, for one pair of setns."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    made: list[socket.socket] = []
    try:
        setns(netns_fd, CLONE_NEWNET)
        try:
            for _ in range(count):
                made.append(socket.socket(family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC))
        except OSError:
            for s in made:
                s.close()
            raise
        finally:
            setns(own, CLONE_NEWNET)
    finally:
        os.close(own)
    return made


def socket_inode(pid: int, fd: int) -> int | None:
    """The inode of the socket at the task's `fd`, or None if it is not a socket (or is gone)."""
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    if not link.startswith("socket:["):
        return None
    return int(link[8:-1])


def held_elsewhere(pid: int, fd: int, ino: int) -> bool:
    """Whether the socket `ino` at the task's `fd` is also reachable another way in the task: by
    another fd number (dup) or as an entry of an epoll set. Such a socket cannot be swapped for
    another one under the application's feet (the other references would keep the old one)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    want = f"ino:{ino:x}"
    for name in fds:
        if int(name) == fd:
            continue
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link == f"socket:[{ino}]":
            return True
        if link == "anon_inode:[eventpoll]":
            try:
                if any(line.startswith("tfd:") and want in line.split() for line in procfs.fdinfo_lines(name, pid)):
                    return True
            except OSError:
                continue
    return False


def held_sockets(pids: list[int]) -> Iterator[int | None]:
    """The socket inode at every fd of `pids`, one fd at a time (None: not a socket, or gone), so a
    caller on an event loop can spread a scan of many fds over many turns of its loop."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            yield socket_inode(pid, int(fd))


def socket_inodes(pids: list[int]) -> set[int]:
    """Every socket inode any of `pids` holds open."""
    return {ino for ino in held_sockets(pids) if ino is not None}


def netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def netns_addresses(pid: int) -> set[str]:
    """The unicast addresses configured in `pid`'s network namespace, loopback excluded (read from
    /proc/PID/net, which shows that process's netns, so no helper has to enter it)."""
    return _addresses(f"/proc/{pid}/net")


NS_GET_NSTYPE = 0xb703   # _IO(0xb7, 0x3): which kind of namespace an nsfs file is


def netns_file(path: str) -> tuple[int, set[str]]:
    """A network namespace named by a file (a CNI_NETNS path such as /var/run/netns/cni-...):
    its inode and its addresses. The calling thread enters it to read /proc/thread-self/net (there
    is no process of the pod to read through yet) and comes back. ValueError if `path` is not a
    network namespace."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
        except OSError:
            raise ValueError(f"{path} is not a namespace") from None
        if kind != CLONE_NEWNET:
            raise ValueError(f"{path} is not a network namespace")
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(fd, CLONE_NEWNET)
            try:
                addrs = _addresses("/proc/thread-self/net")
            finally:
                setns(own, CLONE_NEWNET)
        finally:
            os.close(own)
        return os.fstat(fd).st_ino, addrs
    finally:
        os.close(fd)


def _addresses(net: str) -> set[str]:
    addrs: set[str] = set()
    last = None
    try:
        with open(f"{net}/fib_trie") as f:
            for line in f:
                s = line.strip()
                if s.startswith("|--"):
                    last = s[3:].strip()
                elif s.startswith("/32 host LOCAL") and last:
                    addrs.add(last)
    except FileNotFoundError:
        pass
    try:
        with open(f"{net}/if_inet6") as f:
            for line in f:
                hexaddr = line.split()[0]
                addrs.add(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    except FileNotFoundError:
        pass
    return {a for a in addrs if not ipaddress.ip_address(a).is_loopback
            and not ipaddress.ip_address(a).is_link_local}


def peer_pid(sock: socket.socket) -> int:
    """SO_PEERCRED's pid: who is on the other end of a unix socket (the kernel says, not the peer)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


SO_PASSRIGHTS = 83   # Linux 6.16: 0 refuses SCM_RIGHTS sent to this socket (the sender gets EPERM)


@functools.cache
def passrights_supported() -> bool:
    """Can an AF_UNIX socket refuse fds here (SO_PASSRIGHTS, Linux 6.16)? Said once in the log if not."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with a, b:
        try:
            a.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
            return True
        except OSError as e:
            logging.getLogger("tsor").warning(
                "this kernel has no SO_PASSRIGHTS (%s; Linux 6.16): local-path ends cannot refuse fds, so the "
                "sandboxes' supervisors send every sendmsg on them themselves (slower; SECURITY.md)", e.strerror)
            return False


def refuse_rights(*socks: socket.socket) -> bool:
    """No fd crosses these AF_UNIX ends (a local-path socketpair between two pods): TCP carries none.
    False where the kernel has no SO_PASSRIGHTS (before 6.16), where nothing stops SCM_RIGHTS."""
    if not passrights_supported():
        return False
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    return True
