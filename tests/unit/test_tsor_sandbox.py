"""The sandbox side of TSoR on the supervisor's loop: its upkeep never holds the loop, which also
answers the sandbox's trapped syscalls."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from qlib.eventloop import Loop
from tests.unit.loop_probe import watch_loop
from tsor import sandbox as sb

FDS_PER_PROC, PROCS = 15000, 4   # 60,000 fds (the hard RLIMIT_NOFILE here is 20,000 a process)
HOLDER = ("import os, resource, socket, sys; n = int(sys.argv[1]);"
          "resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, n + 64));"
          "a, b = socket.socketpair(); fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(n)];"
          "print(os.fstat(a.fileno()).st_ino, flush=True); sys.stdin.read()")


@pytest.fixture
def holders():
    """Processes holding many fds (one of them a socket): a sandbox's processes, as tsord's sweep sees them."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < FDS_PER_PROC + 64:
        pytest.skip(f"needs a hard RLIMIT_NOFILE of {FDS_PER_PROC + 64}: processes holding {FDS_PER_PROC} fds each")
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(FDS_PER_PROC)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(PROCS)]
    try:
        inodes = [int(p.stdout.readline()) for p in procs]
        yield [p.pid for p in procs], inodes
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_sweep_of_closed_sockets_never_holds_the_loop(holders, monkeypatch, tmp_path):
    """The periodic sweep reads every fd of the sandbox's processes: 60,000 of them are spread over
    many turns of the loop (a timer every 10 ms keeps firing), and the sweep still drops the state of
    a socket nobody holds and keeps that of one still held."""
    monkeypatch.setattr(sb, "SWEEP_S", 0.05)
    pids, inodes = holders
    loop = Loop()
    net = sb.SandboxNet(loop, "sweep", os.getpid(), lambda: pids, path=str(tmp_path / "no-tsord.sock"))
    gone = 999_999_999   # an inode no process holds
    state = sb.Redirected(socket.AF_INET, ("10.0.0.1", 1), ("10.0.0.2", 2), "local", socket.AF_UNIX)
    net.sockets[gone] = state
    net.redirected(inodes[-1], state)   # held by the last process: its fds are read last
    try:
        gaps = watch_loop(loop)
        deadline = time.monotonic() + 30
        while gone in net.sockets and time.monotonic() < deadline:
            loop.run_once(0.05)
        assert gone not in net.sockets, "the sweep did not finish"
        for _ in range(3):   # the tick after the sweep's last step records how long that step held the loop
            loop.run_once(0.05)
        assert inodes[-1] in net.sockets
        assert max(gaps) < 0.2, f"the loop was held for {max(gaps) * 1000:.0f} ms"
    finally:
        net.close()
