"""tsord's tcp-path byte counters: the kernel's TCP_INFO of handed-out sockets, read with sock_diag,
live (a dump per scrape) and after the socket is gone (destroy events as root, else the last scrape)."""
from __future__ import annotations

import os
import socket
import time

import pytest

from tsor.bytecount import TcpByteCounter, cookie_of, tcp_bytes


def pair() -> tuple[socket.socket, socket.socket]:
    lst = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(lst.getsockname())
    s, _ = lst.accept()
    lst.close()
    return c, s


def pump(src: socket.socket, dst: socket.socket, n: int) -> None:
    src.sendall(b"x" * n)
    got = 0
    while got < n:
        got += len(dst.recv(1 << 20))


def wait_acked(sock: socket.socket, n: int) -> None:
    deadline = time.monotonic() + 5
    while tcp_bytes(sock)[0] < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_counts_only_what_was_carried_after_hand_off_live_and_after_close():
    counter = TcpByteCounter()
    counter.start()
    try:
        c, s = pair()
        pump(c, s, 1000)                   # before hand-off: the set-up, not the application's
        wait_acked(c, 1000)
        counter.track(c)
        pump(c, s, 300_000)
        pump(s, c, 7_000)
        wait_acked(c, 301_000)
        assert counter.totals() == {("tcp", "sent"): 300_000, ("tcp", "received"): 7_000}
        untracked_cookie = cookie_of(s)
        assert untracked_cookie != cookie_of(c)
        c.close()
        s.close()
        deadline = time.monotonic() + 5
        while counter._tracked and time.monotonic() < deadline:   # destroy event, or 3 scrapes
            counter.totals()
            time.sleep(0.05)
        final = counter.totals()   # TCP counts each FIN as one byte
        assert final[("tcp", "sent")] in (300_000, 300_001) and final[("tcp", "received")] in (7_000, 7_001)
        assert not counter._tracked
    finally:
        counter.close()


def test_greeting_byte_and_untrack():
    counter = TcpByteCounter()
    c, s = pair()
    try:
        counter.track(s, greeting=True)    # the server side: its supervisor writes one byte first
        pump(s, c, 1 + 500)
        wait_acked(s, 501)
        assert counter.totals()[("tcp", "sent")] == 500
        counter.untrack(s)
        assert counter.totals() == {("tcp", "sent"): 0, ("tcp", "received"): 0}
    finally:
        c.close()
        s.close()
        counter.close()


def test_destroy_events_need_cap_net_admin_and_are_used_as_root():
    counter = TcpByteCounter()
    counter.start()
    try:
        assert (counter._events is not None) == (os.geteuid() == 0)
    finally:
        counter.close()


def destroy_groups(sock: socket.socket) -> int:
    """The kernel's view of a netlink socket's groups (/proc/net/netlink, found by inode): 0x5 is
    SKNLGRP_INET_TCP_DESTROY and SKNLGRP_INET6_TCP_DESTROY."""
    ino = os.fstat(sock.fileno()).st_ino
    with open("/proc/net/netlink") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[-1]) == ino:
                return int(fields[3], 16)
    raise AssertionError("netlink socket not listed")


@pytest.mark.skipif(os.geteuid() != 0, reason="destroy groups need CAP_NET_ADMIN (run as root)")
def test_in_the_destroy_groups_only_while_a_socket_is_tracked():
    # while anyone is in those groups every TCP socket of the host is freed through a kworker
    # that broadcasts its TCP_INFO: a tsord with no tcp-path socket (the sockmap path, a node with
    # no peers) must not put that on the node's other pods
    counter = TcpByteCounter()
    counter.start()
    try:
        assert destroy_groups(counter._events) == 0 and not counter.joined
        c, s = pair()
        counter.track(c)
        assert destroy_groups(counter._events) == 0x5 and counter.joined
        pump(c, s, 50_000)
        wait_acked(c, 50_000)
        c.close()
        s.close()
        deadline = time.monotonic() + 5
        while counter._tracked and time.monotonic() < deadline:   # its destroy event retires it
            time.sleep(0.02)
        assert not counter._tracked
        assert destroy_groups(counter._events) == 0 and not counter.joined
        assert counter.totals()[("tcp", "sent")] in (50_000, 50_001)   # counted by the event
        c, s = pair()
        counter.track(s)
        counter.untrack(s)
        assert destroy_groups(counter._events) == 0
        c.close()
        s.close()
    finally:
        counter.close()
