"""`containerd-shim-quark-v1`: containerd's runtime v2 shim for quark (runtime_type io.containerd.quark.v1).

containerd runs it with Go-style flags and a verb, in the bundle directory:
  -namespace NS -address ADDR -publish-binary BIN [-debug] -id ID start
      bind the shim's socket, fork the server into its own session, write `address` (and
      `shim.pid`) into the bundle, print only the address and exit. A container of a pod whose
      sandbox already has a shim gets that shim's address; with `shim: {scope: node}` in quark's
      host configuration every container gets the node's shim (one per containerd and namespace).
  ... -id ID delete
      clean up after a shim that died: force-delete the container in quark, unmount its rootfs,
      write a binary DeleteResponse on stdout.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from shim import paths

log = logging.getLogger("quark.shim")

CONNECT_TIMEOUT_S = 10.0   # a shim answers Connect at once; this only bounds a stuck one


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="containerd-shim-quark-v1", allow_abbrev=False,
                                description="containerd runtime v2 shim for quark")
    p.add_argument("-namespace", "--namespace", default=os.environ.get("NAMESPACE", ""), help="containerd namespace")
    p.add_argument("-id", "--id", default="", help="container id")
    p.add_argument("-address", "--address", default="", help="containerd's grpc address")
    p.add_argument("-publish-binary", "--publish-binary", default="", help="containerd binary (unused: events go over ttrpc)")
    p.add_argument("-bundle", "--bundle", default="", help="bundle directory (default: the working directory)")
    p.add_argument("-socket", "--socket", default="", help="accepted for compatibility; the socket is derived")
    p.add_argument("-debug", "--debug", action="store_true", help="debug logging")
    p.add_argument("action", nargs="?", choices=("start", "delete"), help="start or delete (none: serve)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.namespace:
        print("containerd-shim-quark-v1: -namespace is required", file=sys.stderr)
        return 2
    if not args.id:
        print("containerd-shim-quark-v1: -id is required", file=sys.stderr)
        return 2
    bundle = os.path.abspath(args.bundle or os.getcwd())
    if args.action == "start":
        return start(args, bundle)
    if args.action == "delete":
        from shim.delete import delete
        return delete(args.id, args.namespace, bundle)
    print("containerd-shim-quark-v1: run by containerd with `start` or `delete`", file=sys.stderr)
    return 2


def _served_by_factory(argv: list[str]) -> bool:
    # containerd's `... -id ID start`, and `... -id ID delete`, which containerd 1.6 runs after
    # every shim exit, clean ones too, and waits for before a task's Delete returns
    return bool(argv) and argv[-1] in ("start", "delete")


# The sandbox factory (qvisor/factory/) runs containerd's `start` and `delete` in a pre-imported
# worker (the front end, qvisor/frontend.c, installed as this command, sends them there): the
# shim's server is then forked with its modules loaded and shares their pages, and the clean-up
# costs no Python start. Registered as an entry point of the "quark.factory" group
# (pyproject.toml), so qvisor never imports the shim.
def _starts_server(argv: list[str]) -> bool:
    # containerd's `start`: the server it starts lives in the caller's cgroups, and is a seed
    return bool(argv) and argv[-1] == "start"


SHIM_PROGRAM = "containerd-shim-quark-v1"   # its name in the group (pyproject.toml)
FACTORY_PROGRAM = {"main": main, "serves": _served_by_factory, "adopts_cgroups": _starts_server,
                   "preload": ("shim.serve", "shim.service", "shim.ttrpc", "shim.runtime"),
                   "wants_seed": _starts_server,
                   "become": lambda data, fds: _become_server(data, fds)}   # (defined below)


def _write_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, path)


def start(args: argparse.Namespace, bundle: str) -> int:
    from qlib.errors import QuarkError
    try:
        shim_scope = paths.scope()
    except QuarkError as e:   # a host setting quark cannot take: containerd shows this line
        print(f"containerd-shim-quark-v1: {e}", file=sys.stderr)
        return 1
    group = paths.group_of(bundle, args.id, shim_scope)
    address = paths.socket_address(args.address, args.namespace, group)
    if shim_scope == "node":
        # the node's shim exits once idle (shim/serve.py): deciding to go and a `start` finding it
        # up are serialized by this lock, so an answer here is a shim that stays for this container
        # (held only while looking: a forked server must not inherit it)
        with paths.sockets_locked():
            listener = _bind_or_join(bundle, address, args.id)
    else:   # (a container that is its own group never finds its shim up: that one is a dead one's)
        listener = _bind_or_join(bundle, address, args.id, joins=group != args.id)
    if listener is not None:
        # in the sandbox factory's worker: a seed forked ahead becomes the server, so it shares the
        # factory's pages and none of those this worker wrote (measured: bench/README.md, "Pod overhead")
        from qvisor.factory import seeds
        pid = seeds.hand_over(SHIM_PROGRAM, {"address": address, "namespace": args.namespace, "bundle": bundle,
                                             "debug": args.debug, "scope": shim_scope}, [listener.fileno()])
        if pid is None:
            pid = os.fork()
            if pid == 0:
                _serve(listener, address, args.namespace, bundle, args.debug, shim_scope)
        listener.close()
        _write_file(os.path.join(bundle, "address"), address)
        _write_file(os.path.join(bundle, "shim.pid"), str(pid))
    sys.stdout.write(address)
    sys.stdout.flush()
    return 0


def _bind_or_join(bundle: str, address: str, container_id: str, joins: bool = True) -> socket.socket | None:
    """The listening socket for a new shim at `address`, or None when the shim already there serves
    this container too (if it `joins` one), its address and pid then written in the bundle."""
    from shim.ttrpc import listen, socket_path

    path = socket_path(address)
    try:
        return listen(path)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
    pid = _shim_pid(path, container_id) if joins else 0
    if pid:   # the pod's (or the node's) shim is up: it serves this container too
        _write_file(os.path.join(bundle, "address"), address)
        _write_file(os.path.join(bundle, "shim.pid"), str(pid))
        return None
    os.unlink(path)  # a dead shim's socket
    return listen(path)


def _shim_pid(path: str, container_id: str) -> int:
    """The pid of the shim answering at `path` (0: none answers). For the node's shim this answer
    to Connect also keeps it up for the container containerd is about to create there
    (shim/serve.py, NODE_IDLE_S)."""
    from shim.pb import shim_pb2 as pb
    from shim.service import SERVICE
    from shim.ttrpc import Client, RpcError
    try:
        client = Client(path, timeout=CONNECT_TIMEOUT_S)
    except OSError:
        return 0
    try:
        return client.call(SERVICE, "Connect", pb.ConnectRequest(id=container_id), pb.ConnectResponse).shim_pid
    except (OSError, ConnectionError, RpcError):
        return 0
    finally:
        client.close()


def _serve(listener: socket.socket, address: str, namespace: str, bundle: str, debug: bool,
           shim_scope: str) -> None:
    """Be the shim's server. Never returns."""
    try:
        _become_daemon()
        from shim.serve import serve
        code = serve(listener, address, namespace, bundle, debug, shim_scope)
    except BaseException:
        logging.getLogger("quark.shim").exception("shim server failed")
        code = 1
    os._exit(code)


def _become_server(data: bytes, fds: list[int]) -> None:
    """A seed of the factory's handed a `start` (qvisor/factory/seeds.py) becomes the shim's server."""
    from qvisor.factory import seeds
    try:
        if len(fds) != seeds.CONTEXT_FDS + 1:
            raise ValueError(f"{len(fds)} fds handed over, not {seeds.CONTEXT_FDS + 1}")
        payload = seeds.take_on(data, fds[:seeds.CONTEXT_FDS])
        listener = socket.socket(fileno=fds[seeds.CONTEXT_FDS])
        listener.set_inheritable(False)
    except BaseException:   # `start` has answered containerd already: its connect finds no server
        os._exit(1)
    _serve(listener, payload["address"], payload["namespace"], payload["bundle"], payload["debug"],
           payload.get("scope", "pod"))


def _become_daemon() -> None:
    """Leave containerd's session and let go of the pipes it reads `start`'s output from."""
    if os.getsid(0) != os.getpid():   # (a seed that took on a `start` has a session of its own)
        os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


if __name__ == "__main__":
    sys.exit(main())
