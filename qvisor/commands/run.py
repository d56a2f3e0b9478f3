"""quark run: create + start, then (unless -d) wait, forward signals, and delete; exits with the
container's exit status (128+N for a signal), as runc does."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from qvisor.container.common import preserved_fds
from qvisor.container.create import create
from qvisor.container.delete import delete
from qvisor.container.kill import kill
from qvisor.container.snapshot import hibernate
from qvisor.container.start import start
from qvisor.container.wait import wait
from qvisor.spec import load_spec

# what runc forwards to the container; SIGCHLD, SIGPIPE and SIGWINCH are its own business
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--bundle", default=".", help="path to the bundle directory (default: current)")
    p.add_argument("-d", "--detach", action="store_true", help="detach from the container's process")
    p.add_argument("--pid-file", default="", help="file to write the container init's pid to")
    p.add_argument("--console-socket", default="", help="unix socket that receives the pty master")
    p.add_argument("--keep", action="store_true", help="do not delete the container after it exits")
    p.add_argument("--no-pivot", action="store_true", help="accepted for runc compatibility")
    p.add_argument("--no-new-keyring", action="store_true", help="accepted for runc compatibility")
    p.add_argument("--preserve-fds", type=int, default=0, metavar="N",
                   help="pass the caller's fds 3 .. 2+N on to the container's process")
    p.add_argument("--snapshot-when", default="", metavar="COND",
                   help="hibernate the container once COND holds: tcp:PORT (a socket listens), file:PATH "
                        "(exists in the container) or exec:CMD (exits 0 in the container)")
    p.add_argument("--snapshot-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long --snapshot-when waits before it fails (and removes the container)")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    from qvisor import console
    preserved_fds(args.preserve_fds)   # checked before quark opens fds of its own
    ready_when = None
    if args.snapshot_when:
        from qvisor import readiness
        ready_when = readiness.parse(args.snapshot_when)   # a bad COND creates nothing
    process = load_spec(os.path.abspath(args.bundle)).process
    terminal = bool(process and process.terminal)
    own_console = terminal and not args.console_socket and not args.detach
    forwarder = None if args.detach else _Forwarder(args.root, args.id)   # before anything is made, as runc
    with (console.console_socket() if own_console else contextlib.nullcontext((args.console_socket, None))) as (path, listener):
        st = create(args.root, args.id, args.bundle, pid_file=args.pid_file, console_socket=path,
                    platform=args.platform, log_file=args.log, log_format=args.log_format,
                    preserve_fds=args.preserve_fds, in_factory=getattr(args, "in_factory", False))
        master = console.receive_master(listener) if listener is not None else -1
    try:
        start(args.root, args.id)
        if ready_when is not None:
            _hibernate_when_ready(args, ready_when)
    except BaseException:
        delete(args.root, args.id, force=True)
        raise
    if forwarder is None:
        return 0
    forwarder.started()
    if master >= 0:
        console.proxy(master)
        os.close(master)
    result = wait(args.root, args.id, st.pid)
    if not args.keep:
        delete(args.root, args.id, force=True)
    return result["exit_status"]


def _hibernate_when_ready(args: argparse.Namespace, cond) -> None:
    from qvisor import readiness, swap
    took = readiness.wait_ready(args.root, args.id, cond, args.snapshot_timeout)
    swap.ensure_swap()
    info = hibernate(args.root, args.id, reason="ready")
    print(f"{args.id}: ready after {took:.2f}s, hibernated: memory {info['warm_bytes'] / 2**20:.1f} MiB -> "
          f"{info['held_bytes'] / 2**20:.1f} MiB", file=sys.stderr)


class _Forwarder:
    """The signals `run` forwards, caught from before the container exists (as runc's handler is):
    one that comes before the container's process has started waits, then follows it, in order;
    none kills the `run` half way through a create."""

    def __init__(self, root: str, cid: str) -> None:
        self.root, self.cid = root, cid
        self.waiting: list[int] | None = []   # None once the container has started
        for sig in FORWARDED:
            signal.signal(sig, self._caught)

    def _caught(self, sig: int, _frame) -> None:
        if self.waiting is None:
            _forward(self.root, self.cid, sig)
        else:
            self.waiting.append(sig)

    def started(self) -> None:
        waiting, self.waiting = self.waiting or [], None
        for sig in waiting:
            _forward(self.root, self.cid, sig)


def _forward(root: str, cid: str, sig: int) -> None:
    try:
        kill(root, cid, sig)
    except Exception:
        pass
