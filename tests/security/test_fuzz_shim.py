"""Fuzzing the shim's ttrpc server: malformed frames and oversize payloads to a real
`containerd-shim-quark-v1` (started with `start`, as containerd does, under a namespace of our own).

Inputs: raw garbage, frames with random header fields (length, stream id, type, flags), well-framed
requests with random services, methods, payloads and metadata (never Create, whose rootfs mounts
act on the host, nor Shutdown), oversize frames, and half-sent frames left open. Each connection gets
an answer or is closed; every 25 inputs, and while 32 half-sent 4 MiB frames hang, a well-behaved
client is served. The shim's memory and threads stay bounded; it shuts down cleanly at the end.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.conftest import record, wait_for

pytestmark = pytest.mark.root

EXAMPLES = int(os.environ.get("QUARK_FUZZ_SHIM_EXAMPLES", 300))
SHIM = os.path.join(os.path.dirname(sys.executable), "containerd-shim-quark-v1")
SAFE_METHODS = ["State", "Start", "Delete", "Pids", "Pause", "Resume", "Checkpoint", "Kill", "Exec", "ResizePty",
                "CloseIO", "Update", "Wait", "Stats", "Connect", "Frobnicate", ""]


def _proc(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith(key + ":")).split()[1])


class Shim:
    def __init__(self, tmp) -> None:
        self.ns = f"secfuzz{os.getpid()}"
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        r = subprocess.run([SHIM, "-namespace", self.ns, "-address", str(tmp / "containerd.sock"),
                            "-publish-binary", "/bin/true", "-id", f"shim-{os.getpid()}", "start"],
                           cwd=self.bundle, capture_output=True, text=True, timeout=30,
                           env={k: v for k, v in os.environ.items() if k != "TTRPC_ADDRESS"})
        assert r.returncode == 0 and r.stdout.startswith("unix://"), (r.stdout, r.stderr)
        self.path = r.stdout[len("unix://"):]
        self.pid = int((self.bundle / "shim.pid").read_text())

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    def rss_kib(self) -> int:
        return _proc(self.pid, "VmRSS")

    def threads(self) -> int:
        return _proc(self.pid, "Threads")

    def stop(self) -> None:
        from google.protobuf import empty_pb2
        from shim.pb import shim_pb2 as pb
        from shim.service import SERVICE
        from shim.ttrpc import Client
        try:
            c = Client(self.path, timeout=5)
            c.call(SERVICE, "Shutdown", pb.ShutdownRequest(id=""), empty_pb2.Empty)
            c.close()
        except OSError:
            pass
        try:
            wait_for(lambda: not self.alive(), timeout=5, what="the shim to exit")
        except AssertionError:
            os.kill(self.pid, 9)   # ours: started above
        shutil.rmtree(f"/run/containerd/quark/{self.ns}", ignore_errors=True)


def served(shim: Shim) -> bool:
    from shim.pb import shim_pb2 as pb
    from shim.service import SERVICE
    from shim.ttrpc import Client
    c = Client(shim.path, timeout=10)
    try:
        return c.call(SERVICE, "Connect", pb.ConnectRequest(id="x"), pb.ConnectResponse).shim_pid == shim.pid
    finally:
        c.close()


@st.composite
def inputs(draw) -> bytes:
    from shim.pb import ttrpc_pb2
    from shim.ttrpc import HEADER, MESSAGE_LENGTH_MAX
    kind = draw(st.sampled_from(["garbage", "header", "request"]))
    if kind == "garbage":
        return draw(st.binary(max_size=300))
    if kind == "header":
        payload = draw(st.binary(max_size=200))
        length = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32 - 1),
                                st.sampled_from([MESSAGE_LENGTH_MAX, MESSAGE_LENGTH_MAX + 1, 2**32 - 1])))
        return HEADER.pack(length, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 255)),
                           draw(st.integers(0, 255))) + payload
    req = ttrpc_pb2.Request(service=draw(st.sampled_from(["containerd.task.v2.Task", "x.y", ""]) | st.text(max_size=20)),
                            method=draw(st.sampled_from(SAFE_METHODS)), payload=draw(st.binary(max_size=300)),
                            timeout_nano=draw(st.integers(0, 2**63 - 1)))
    for _ in range(draw(st.integers(0, 3))):
        req.metadata.add(key=draw(st.text(max_size=10)), value=draw(st.text(max_size=10)))
    body = req.SerializeToString()
    return HEADER.pack(len(body), draw(st.integers(0, 2**31 - 1)) * 2 + 1, 1, draw(st.integers(0, 255))) + body


def _answered_or_closed(s: socket.socket) -> str:
    """Read until the server answers (a response frame), closes, or stays silent (waits for more)."""
    from shim.ttrpc import HEADER
    try:
        head = s.recv(HEADER.size)
    except socket.timeout:
        return "waiting"
    except ConnectionResetError:
        return "closed"
    if not head:
        return "closed"
    assert len(head) >= 1 and (len(head) < HEADER.size or HEADER.unpack(head)[2] == 2), head
    return "answered"


def test_shim_survives_malformed_ttrpc(tmp_path):
    from tests.security.conftest import needs_root
    needs_root()
    if not os.access(SHIM, os.X_OK):
        pytest.skip("containerd-shim-quark-v1 is not installed in the venv")
    from shim.ttrpc import HEADER, MESSAGE_LENGTH_MAX
    shim = Shim(tmp_path)
    stats = {"answered": 0, "closed": 0, "waiting": 0, "good": 0}
    hanging: list[socket.socket] = []
    try:
        for _ in range(3):
            assert served(shim)
        rss0, threads0 = shim.rss_kib(), shim.threads()

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(inputs())
        def one(data: bytes) -> None:
            try:
                send_one(data)
            finally:
                if (stats["answered"] + stats["closed"] + stats["waiting"]) % 25 == 0:
                    assert served(shim), "the shim stopped serving"
                    stats["good"] += 1

        def send_one(data: bytes) -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.08)
                s.connect(shim.path)
                try:
                    s.sendall(data)
                except (BrokenPipeError, ConnectionResetError):
                    stats["closed"] += 1
                    return
                stats[_answered_or_closed(s)] += 1

        one()
        # oversize: announced over the limit (closed at once), and a full 4 MiB of garbage (read, refused)
        for data in (HEADER.pack(MESSAGE_LENGTH_MAX + 1, 1, 1, 0), HEADER.pack(MESSAGE_LENGTH_MAX, 1, 1, 0)
                     + os.urandom(MESSAGE_LENGTH_MAX)):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(shim.path)
                s.sendall(data)
                assert _answered_or_closed(s) == "closed"
        # half-sent frames left hanging: each holds a connection thread; others are still served
        for _ in range(32):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(shim.path)
            s.sendall(HEADER.pack(MESSAGE_LENGTH_MAX, 1, 1, 0) + b"x" * 65536)
            hanging.append(s)
        assert served(shim), "half-sent frames starved the shim"
        rss_hanging = shim.rss_kib()
        for s in hanging:
            s.close()
        hanging.clear()
        time.sleep(0.5)
        assert served(shim)
        rss1, threads1 = shim.rss_kib(), shim.threads()
        alive = shim.alive()
    finally:
        for s in hanging:
            s.close()
        shim.stop()
    record("fuzz: shim ttrpc frames", "quark",
           f"{EXAMPLES} inputs: {stats['answered']} answered, {stats['closed']} connections closed, "
           f"{stats['waiting']} waiting for the rest of a frame; good client served {stats['good'] + 3} times; "
           f"oversize closed; RSS {rss0}->{rss1} KiB (peak with 32 half-sent frames {rss_hanging}), "
           f"threads {threads0}->{threads1}")
    assert alive
    assert rss1 - rss0 < 64 * 1024, f"shim RSS {rss0} -> {rss1} KiB"
    assert threads1 <= threads0 + 4, f"shim threads {threads0} -> {threads1}"
    assert not shim.alive(), "Shutdown did not stop the shim"
    assert not os.path.exists(shim.path), "the shim left its socket behind"
