"""Supervisor seeds: processes forked ahead of a create that become its supervisor.

A process forked from the factory pays a private page for every page of the factory's it writes;
CPython writes to every object it touches (reference counts). A supervisor forked from the worker
that ran `quark create` inherited the pages that worker wrote (the rehearsal, argument parsing,
loading and checking the spec: pages it never touches again) and kept them for the container's
life (measured: bench/README.md, "Start-up and supervisor memory"). So a seed is forked ahead by
the zygote — a process that does nothing but fork seeds, and so writes little of what its seeds
share with it — and waits; the worker that runs the create hands it what its fork would have
given it (qvisor/birth.py: start, supervise_handed_over) and it becomes the supervisor.
A create that gets no seed forks its supervisor as before.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Callable

MAX_HAND_OVER = 1 << 20
# what a seed becomes once a worker hands it a create: (the hand-over's data, its fds) -> never returns
Become = Callable[[bytes, list[int]], None]

# in a worker handed a seed with its request: the channel to it (take_seed)
_seed_channel: socket.socket | None = None


def keep_seed(fd: int) -> None:
    """In a worker: the seed that came with this request (SCM_RIGHTS gave it without O_CLOEXEC)."""
    global _seed_channel
    os.set_inheritable(fd, False)
    _seed_channel = socket.socket(fileno=fd)


def take_seed() -> socket.socket | None:
    """In a factory worker: the channel to a pristine supervisor-to-be, if this request came with
    one (only once: a create forks one supervisor)."""
    global _seed_channel
    seed, _seed_channel = _seed_channel, None
    return seed


def zygote(sock: socket.socket, become: Become) -> None:
    """Fork a seed for each byte the factory sends, and send it back our end of the seed's
    socket; exit on EOF. Its children (the seeds, then the supervisors they become) are reaped by
    the kernel (SIGCHLD ignored here, and set back to the default in each of them)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    fill_free_blocks()
    while True:
        try:
            if not sock.recv(16):
                os._exit(0)
        except OSError:
            os._exit(0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            ours.close()
            await_hand_over(theirs, become)   # never returns
        theirs.close()
        try:
            socket.send_fds(sock, [b"s"], [ours.fileno()] if pid > 0 else [])
        except OSError:
            os._exit(0)
        finally:
            ours.close()


def await_hand_over(sock: socket.socket, become: Become) -> None:
    """The seed: wait for a worker's hand-over and become that create's supervisor; exit on EOF
    (the factory is gone, or the worker that had us created nothing)."""
    try:
        data, fds, flags, _ = socket.recv_fds(sock, MAX_HAND_OVER, 8)
    except OSError:
        os._exit(0)
    sock.close()
    if not data or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        os._exit(0)
    become(data, fds)   # never returns


_fillers: list = []   # the zygote's: objects that fill the free blocks of the allocator's pools


def fill_free_blocks() -> None:
    """Fill every free block of pymalloc's partly used pools with an object kept for good, so that
    what a seed allocates goes to fresh pools instead. Each free block sits on a page the seed
    shares with us; an object a supervisor allocates there costs it that whole 4 KiB page, and
    the few thousand objects it keeps were spread over as many pages. In fresh pools they lie
    side by side, and a supervisor keeps fewer private pages (measured: bench/README.md, "Start-up
    and supervisor memory")."""
    for size, free in free_blocks().items():
        if size == 32:
            _fillers.extend(1_000_000_000 + i for i in range(free))   # a one-digit int: 28 bytes
        elif size >= 48:
            _fillers.extend(bytes(size - 33) for _ in range(free))   # bytes(n): a block of n + 33
        # (16: no object of CPython's is that small; a few such blocks stay free)


def free_blocks() -> dict[int, int]:
    """Free blocks in used pools per block size, from sys._debugmallocstats (which prints to fd 2:
    nothing of it is shown). Empty when the interpreter does not report them (PYTHONMALLOC=malloc)."""
    import tempfile   # only the zygote, once: not worth every create's import of this module
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    free = {}
    for line in text.splitlines():   # "class size pools in-use free", after its header
        fields = line.split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            free[int(fields[1])] = int(fields[4])
    return free
