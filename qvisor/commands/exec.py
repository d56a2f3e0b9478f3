"""quark exec: run another process in a running container."""
from __future__ import annotations

import argparse
import json
import os
import signal

from qlib.errors import InvalidArgument, QuarkError
from qvisor.container.common import config_process
from qvisor.container.create import write_pid_file
from qvisor.container.exec import exec_process
from qvisor.container.kill import kill_exec
from qvisor.container.wait import wait


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--process", default="", help="path to a process.json (OCI process object)")
    p.add_argument("-t", "--tty", action="store_true", help="allocate a pseudo-TTY")
    p.add_argument("-d", "--detach", action="store_true", help="detach from the process")
    p.add_argument("--pid-file", default="", help="file to write the process's pid to")
    p.add_argument("--console-socket", default="", help="unix socket that receives the pty master")
    p.add_argument("--cwd", default="", help="working directory in the container")
    p.add_argument("-e", "--env", action="append", default=[], help="set an environment variable (K=V)")
    p.add_argument("-u", "--user", default="", help="UID[:GID]")
    p.add_argument("-g", "--additional-gids", action="append", type=int, default=[])
    p.add_argument("-c", "--cap", action="append", default=[], help="add a capability")
    p.add_argument("--no-new-privs", action="store_true", help="set no_new_privs")
    p.add_argument("--preserve-fds", type=int, default=0, metavar="N",
                   help="pass the caller's fds 3 .. 2+N on to the process")
    p.add_argument("id")
    p.add_argument("command", nargs=argparse.REMAINDER)


def build_process(args: argparse.Namespace) -> dict:
    if args.process:
        try:
            with open(args.process) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise QuarkError(f"--process {args.process}: {e}") from None
    if not args.command:
        raise QuarkError("exec: give a command or --process")
    proc = config_process(args.root, args.id)
    proc["args"] = args.command
    proc["terminal"] = args.tty
    env = {e.split("=", 1)[0]: e for e in proc.get("env", [])}
    env.update({e.split("=", 1)[0]: e for e in args.env})
    proc["env"] = list(env.values())
    if args.cwd:
        proc["cwd"] = args.cwd
    if args.user:
        uid, _, gid = args.user.partition(":")
        if not uid.isdigit() or not (gid or "0").isdigit():
            raise InvalidArgument(f"--user {args.user}: must be UID[:GID] in numbers, as runc takes it")
        proc["user"] = dict(proc.get("user") or {}, uid=int(uid), gid=int(gid or 0))
    if args.additional_gids:
        proc.setdefault("user", {})["additionalGids"] = args.additional_gids
    if args.cap:
        caps = dict(proc.get("capabilities") or {})
        for k in ("bounding", "effective", "permitted"):
            caps[k] = sorted(set(caps.get(k, [])) | set(args.cap))
        proc["capabilities"] = caps
    if args.no_new_privs:
        proc["noNewPrivileges"] = True
    proc.pop("consoleSize", None)
    return proc


def _forward(args: argparse.Namespace, pid: int, sig: int) -> None:
    """A signal to `quark exec` goes on to the process it runs, through the supervisor (never by
    bare pid, which may be another process's once this one is reaped); one that has exited is left."""
    try:
        kill_exec(args.root, args.id, pid, sig)
    except QuarkError:
        pass


def run(args: argparse.Namespace) -> int:
    from qvisor import console
    proc = build_process(args)
    tty = bool(proc.get("terminal"))
    if tty and args.detach and not args.console_socket:
        raise QuarkError("exec -t -d needs --console-socket to hand the pty master to")
    pid, fds = exec_process(args.root, args.id, proc, [] if tty else [0, 1, 2],
                                      preserve_fds=args.preserve_fds, wait_here=not args.detach)
    if args.pid_file:
        write_pid_file(args.pid_file, pid)
    master = fds[0] if fds else -1
    if master >= 0 and args.console_socket:
        import socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(args.console_socket)
            socket.send_fds(s, [b"/dev/ptmx"], [master])
        os.close(master)
        master = -1
    if args.detach:
        return 0
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _f: _forward(args, pid, s))
    if master >= 0:
        console.proxy(master)
        os.close(master)
    return wait(args.root, args.id, pid)["exit_status"]
