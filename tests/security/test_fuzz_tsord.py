"""Fuzzing tsord's protocol (tsor/protocol.py): garbage and mutated messages on its socket.

A tsord of our own (private socket, no network) gets random bytes, mutated valid requests and
replies, oversize records and records carrying more fds than allowed. After every message the
fuzzing connection either got an error reply or was dropped; every 25 messages, and at the end, a
well-behaved sandbox (hello with a real process in a network namespace of its own, then a connect)
is still served. Memory (RSS), fds and threads stay bounded.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.conftest import record

pytestmark = pytest.mark.root

EXAMPLES = int(os.environ.get("QUARK_FUZZ_TSORD_EXAMPLES", 400))
VALID = [
    {"op": "hello", "id": 1, "sandbox": "s", "pid": 1, "addrs": ["10.1.0.2"]},
    {"op": "listen", "id": 2, "token": 7, "addr": "10.1.0.2", "port": 80, "v6only": False},
    {"op": "unlisten", "id": 3, "token": 7},
    {"op": "connect", "id": 4, "dst": ["10.1.0.3", 80], "src_port": 4000},
    {"op": "incoming", "id": 5, "token": 7, "peer": ["10.1.0.3", 4000], "local": ["10.1.0.2", 80],
     "path": "local", "greet": True},
    {"re": 1, "ok": True},
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=16) | st.sampled_from(["10.1.0.2", "::1", "::ffff:10.0.0.1", "0.0.0.0", "hello", "local"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


@st.composite
def mutated(draw) -> bytes:
    msg = dict(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(msg) + ["op", "id", "re", "extra"]))
        action = draw(st.sampled_from(["replace", "delete"]))
        if action == "delete":
            msg.pop(key, None)
        else:
            msg[key] = draw(json_values)
    return json.dumps(msg).encode()


messages = st.one_of(mutated(), st.binary(max_size=300),
                     st.text(max_size=200).map(str.encode),
                     st.sampled_from([b"", b"{}", b"[]", b"null", b'{"op": "hello"}', b'{"re": "x"}',
                                      b'{"op": "connect", "id": true}', b"\xff\xfe", b'{"id": 1e400}']))
NESTED = b"[" * 5000 + b"]" * 5000    # deeper than json's recursion limit


class Sandbox:
    """A well-behaved client: a process in its own network namespace, registered, asking to connect."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "--net", "sleep", "600"])
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{self.proc.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def served(self, path: str, n: int) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(path)
            s.send(json.dumps({"op": "hello", "id": 1, "sandbox": f"good{n}", "pid": self.proc.pid,
                               "addrs": []}).encode())
            hello = json.loads(s.recv(65536))
            s.send(json.dumps({"op": "connect", "id": 2, "dst": ["192.0.2.1", 80], "src_port": 0}).encode())
            conn = json.loads(s.recv(65536))
        return hello.get("ok") is True and hello.get("re") == 1 and conn == {"re": 2, "path": "fallback"}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """Run the whole fuzz once against one tsord; the tests below judge the outcome."""
    from tests.security.conftest import Tsord, needs_root
    needs_root()
    tsord = Tsord(tmp_path_factory.mktemp("tsord-fuzz"))
    good = Sandbox()
    stats = {"answered": 0, "dropped": 0, "silent": 0, "sent": 0, "good": 0, "bad_replies": []}
    fuzz: list[socket.socket] = []
    null = os.open(os.devnull, os.O_RDONLY)

    def conn() -> socket.socket:
        if not fuzz:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(tsord.socket)
            s.settimeout(0.3)
            fuzz.append(s)
        return fuzz[0]

    def drop() -> None:
        fuzz.pop().close()
        stats["dropped"] += 1

    def check_good() -> None:
        assert good.served(tsord.socket, stats["sent"]), "tsord stopped serving a good sandbox"
        stats["good"] += 1

    try:
        for _ in range(3):   # also warms up the daemon's allocator before the baseline
            check_good()
        rss0, fds0, threads0 = tsord.rss_kib(), tsord.fd_count(), tsord.threads()

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(messages, st.integers(0, 6))
        def one(data: bytes, nfds: int) -> None:
            stats["n"] = stats.get("n", 0) + 1
            try:
                send_one(data, nfds)
            finally:
                if stats["n"] % 25 == 0:
                    check_good()

        def send_one(data: bytes, nfds: int) -> None:
            s = conn()
            try:
                if nfds:
                    socket.send_fds(s, [data], [null] * nfds)
                else:
                    s.send(data)
                stats["sent"] += 1
                reply = s.recv(65536)
            except socket.timeout:
                stats["silent"] += 1      # a reply to a reply, or an empty record: nothing to answer
                return
            except OSError:
                return drop()
            if not reply:
                return drop()
            msg = json.loads(reply)
            if not ("error" in msg or msg.get("ok") or msg.get("path")):
                stats["bad_replies"].append(msg)
            stats["answered"] += 1

        one()
        for data in (b"x" * (64 * 1024 + 1), b"x" * (1 << 20), NESTED):   # over MAX_MSG; too deep for json
            s = conn()
            try:
                s.send(data)
                stats["answered"] += bool(s.recv(65536))
            except OSError:
                drop()
        while fuzz:
            drop()
        check_good()
        time.sleep(0.3)
        stats.update(rss=(rss0, tsord.rss_kib()), fds=(fds0, tsord.fd_count()), threads=(threads0, tsord.threads()),
                     alive=tsord.proc.poll() is None)
    finally:
        os.close(null)
        for s in fuzz:
            s.close()
        good.close()
        tsord.stop()
    with open(tsord.log) as f:
        stats["log"] = f.read()
    stats["crashes"] = stats["log"].count("Traceback")
    record("fuzz: tsord protocol", "quark",
           f"{stats['sent']} messages (+2 oversize, 1 deeply nested): {stats['answered']} answered with an error, "
           f"{stats['dropped']} connections dropped, {stats['silent']} unanswered; good sandbox served "
           f"{stats['good']} times; RSS {stats['rss'][0]}->{stats['rss'][1]} KiB, fds {stats['fds'][0]}->{stats['fds'][1]}; "
           f"{stats['crashes']} handler tracebacks in the log")
    return stats


def test_tsord_answers_or_drops_and_keeps_serving(fuzzed):
    assert fuzzed["alive"], "tsord died"
    assert fuzzed["bad_replies"] == []
    assert fuzzed["good"] >= EXAMPLES // 25
    rss0, rss1 = fuzzed["rss"]
    assert rss1 - rss0 < 20 * 1024, f"tsord RSS grew from {rss0} to {rss1} KiB"
    fds0, fds1 = fuzzed["fds"]
    assert fds1 <= fds0 + 2, f"tsord fds {fds0} -> {fds1}: fds sent to it leak"
    t0, t1 = fuzzed["threads"]
    assert t1 <= t0 + 2, f"tsord threads {t0} -> {t1}"


def test_tsord_handlers_never_crash(fuzzed):
    log = fuzzed["log"]
    assert fuzzed["crashes"] == 0, log[max(0, log.find("Traceback") - 200):][:1500]
