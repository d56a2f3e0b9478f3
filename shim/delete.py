"""`containerd-shim-quark-v1 delete`: what containerd runs when a shim is gone (killed, or never up).

Leaves nothing behind: the container is force-deleted in quark (its supervisor and processes
end), the rootfs is unmounted, a dead shim's socket is removed. containerd reads a binary
DeleteResponse on stdout and reports the container as killed.
"""
from __future__ import annotations

import os
import signal
import socket
import sys

from shim import mount, paths
from shim.pb import shim_pb2
from shim.runtime import Quark, now, read_pid
from shim.ttrpc import Code, RpcError, socket_path


def delete(container_id: str, namespace: str, bundle: str) -> int:
    warnings = []
    pid = _init_pid(bundle)
    if os.path.exists(os.path.join(bundle, paths.INIT_PID)):  # else the shim deleted it cleanly
        try:
            Quark(paths.quark_root(bundle, namespace)).delete(container_id, force=True)
        except RpcError as e:
            if e.code != Code.NOT_FOUND:
                warnings.append(str(e))
    mount.unmount_all(os.path.join(bundle, "rootfs"))
    _remove_dead_socket(bundle)
    resp = shim_pb2.DeleteResponse(pid=pid,
                                   exit_status=128 + signal.SIGKILL)
    resp.exited_at.CopyFrom(now())
    for w in warnings:  # containerd logs stderr as cleanup warnings
        print(w, file=sys.stderr)
    sys.stdout.buffer.write(resp.SerializeToString())
    sys.stdout.flush()
    return 0


def _remove_dead_socket(bundle: str) -> None:
    try:
        with open(os.path.join(bundle, "address"), encoding="ascii") as f:
            path = socket_path(f.read().strip())
    except OSError:
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return  # a live shim (a pod's other containers) still serves there
    except OSError:
        pass
    finally:
        s.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass



def _init_pid(bundle: str) -> int:
    try:
        return read_pid(os.path.join(bundle, paths.INIT_PID))
    except RpcError:
        return 0
