"""quark create: set up the sandbox and leave its process waiting for `start`."""
from __future__ import annotations

import argparse

from qvisor.container.create import create


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--bundle", default=".", help="path to the bundle directory (default: current)")
    p.add_argument("--pid-file", default="", help="file to write the container init's pid to")
    p.add_argument("--console-socket", default="", help="unix socket that receives the pty master")
    p.add_argument("--no-pivot", action="store_true", help="accepted for runc compatibility; quark always pivots")
    p.add_argument("--no-new-keyring", action="store_true", help="accepted for runc compatibility")
    p.add_argument("--preserve-fds", type=int, default=0, metavar="N",
                   help="pass the caller's fds 3 .. 2+N on to the container's process")
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    create(args.root, args.id, args.bundle, pid_file=args.pid_file, console_socket=args.console_socket,
                     platform=args.platform, log_file=args.log, log_format=args.log_format,
                     preserve_fds=args.preserve_fds,
                     in_factory=args.in_factory)
    return 0
