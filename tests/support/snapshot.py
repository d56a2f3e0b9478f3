"""What the hibernation tests and bench/snapshot.py share: a bundle running the host's python3
(its /usr bound read-only) in a network namespace of its own, HTTP to a container's port from the
test (a socket made in the container's netns, so nothing but loopback in there is touched), and
a swap file that is switched off and removed afterwards."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from typing import Iterator

from qvisor.spec import default_spec
from tests.support.busybox import make_bundle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVER = "/repo/tests/progs/snapshot_server.py"


def python_bundle(bundle: str, args: list[str], annotations: dict[str, str] | None = None) -> str:
    rootfs = os.path.join(bundle, "rootfs")
    for d in ("usr", "etc", "proc", "sys", "dev", "tmp", "repo"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if not os.path.lexists(os.path.join(rootfs, link)):
            os.symlink(f"usr/{link}", os.path.join(rootfs, link))
    spec = default_spec()
    mounts = spec["mounts"] + [
        {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
        {"destination": "/etc", "type": "bind", "source": "/etc", "options": ["rbind", "ro"]},
        {"destination": "/repo", "type": "bind", "source": REPO, "options": ["rbind", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]}]
    process = spec["process"]
    process["terminal"], process["args"] = False, list(args)
    process["env"] = list(process["env"]) + ["HOME=/tmp", "PYTHONDONTWRITEBYTECODE=1"]
    make_bundle(bundle, args, rootfs=rootfs, mounts=mounts, process=process, annotations=annotations or {})
    return bundle


def connect(pid: int, port: int, timeout: float = 10.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:port in the network namespace of process `pid`."""
    from tsor.kernel_sockets import socket_at
    s = socket_at(f"/proc/{pid}/ns/net")
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


def http_get(pid: int, port: int, path: str = "/", timeout: float = 10.0) -> bytes:
    """GET path over a new connection; the response body (HTTP/1.x with Content-Length or close)."""
    with connect(pid, port, timeout) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.") or b" 200 " not in head.split(b"\r\n")[0]:
        raise AssertionError(f"unexpected response: {data[:200]!r}")
    return body


def wait_listening(pid: int, port: int, timeout: float = 30.0) -> None:
    from qvisor.readiness import listening_on
    deadline = time.monotonic() + timeout
    while not listening_on(pid, port):
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on {port} after {timeout}s")
        time.sleep(0.05)


def state_digest(pid: int, port: int) -> dict:
    return json.loads(http_get(pid, port, "/"))


@contextlib.contextmanager
def swapfile(path: str, size_mib: int = 768) -> Iterator[str]:
    """A swap file switched on for the block, then off and removed."""
    from qlib import linux as L
    subprocess.run(["fallocate", "-l", f"{size_mib}M", path], check=True)
    os.chmod(path, 0o600)
    subprocess.run(["mkswap", path], check=True, capture_output=True)
    try:
        L.swapon(path)
        try:
            yield path
        finally:
            L.swapoff(path)
    finally:
        os.unlink(path)
