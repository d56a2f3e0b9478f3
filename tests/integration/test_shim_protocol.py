"""The shim's ttrpc server and Task service in-process, with a fake quark: no root, no containerd.

Framing faults close only the offending connection; unknown ids answer NotFound; unknown
methods Unimplemented; Wait blocks while other calls on the same connection are answered;
events come out in containerd's order even when an exit races its start; floods of requests,
Waits and connections are served by a bounded number of threads.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from google.protobuf import any_pb2, empty_pb2

from shim import metrics
from shim.events import TOPICS, to_any
from shim.pb import cgroups_v1_pb2, cgroups_v2_pb2, ttrpc_pb2
from shim.pb import shim_pb2 as pb
from shim.pb import types_task_pb2 as types
from shim.runtime import Exit, parse_rfc3339
from shim.service import SERVICE, TaskService
from shim.ttrpc import (HEADER, MAX_CONNECTIONS, MAX_PARKED, MAX_WORKERS, MESSAGE_LENGTH_MAX, Client, Code,
                        RpcError, Server, frame, listen, read_frame)
from tests.support.processes import alive


class FakeQuark:
    """Records calls; processes 'exit' when the test says so."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.exits: dict[tuple[str, int | None], threading.Event] = {}
        self.status: dict[tuple[str, int | None], int] = {}
        self.next_pid = 3_999_000
        self.exit_on_start = False
        self.fail_start = False
        self.ps_seconds = 0.0   # how long Pids takes

    def _exit_event(self, cid: str, pid: int | None) -> threading.Event:
        return self.exits.setdefault((cid, pid), threading.Event())

    def finish(self, cid: str, pid: int | None = None, status: int = 0) -> None:
        self.status[(cid, pid)] = status
        self._exit_event(cid, pid).set()

    def create(self, cid, bundle, pid_file, stdio, console_socket):
        self.calls.append(("create", cid))
        if cid == "bad":
            raise RpcError(Code.INVALID_ARGUMENT, "quark create: config.json: process: missing")
        with open(pid_file, "w") as f:
            f.write(str(self.next_pid))
        self.next_pid += 1

    def start(self, cid):
        self.calls.append(("start", cid))
        if self.fail_start:   # the program is missing: quark's init exits a little after start fails
            threading.Timer(0.3, self.finish, (cid, None, 127)).start()
            raise RpcError(Code.UNKNOWN, "quark start: exec: '/no/such/program': executable file not found")
        if self.exit_on_start:
            self.finish(cid, None, 3)
            time.sleep(0.3)  # the exit is noticed before start returns

    def exec(self, cid, process_json, pid_file, stdio, console_socket, log_path):
        self.calls.append(("exec", cid, open(process_json, "rb").read()))
        with open(pid_file, "w") as f:
            f.write(str(self.next_pid))
        self.next_pid += 1

    def wait(self, cid, pid=None):
        self._exit_event(cid, pid).wait()
        return Exit(pid or 0, self.status[(cid, pid)], parse_rfc3339("2024-05-06T07:08:09.123456789Z"))

    def kill(self, cid, signal, all_processes=False):
        self.calls.append(("kill", cid, signal, all_processes))
        self.finish(cid, None, 128 + signal)

    def delete(self, cid, force=False):
        self.calls.append(("delete", cid, force))
        if force:
            self.finish(cid, None, 137)

    def pause(self, cid):
        self.calls.append(("pause", cid))

    def resume(self, cid):
        self.calls.append(("resume", cid))

    def ps(self, cid):
        time.sleep(self.ps_seconds)
        return [1000, 1001]

    def kill_exec(self, cid, pid, signal):
        self.calls.append(("kill_exec", cid, pid, signal))

    def update(self, cid, resources):
        self.calls.append(("update", cid, resources))

    def stats(self, cid):
        return {"memory": {"usage": {"usage": 4096, "limit": 1 << 30}, "raw": {"rss": 8192, "pgfault": 7}},
                "cpu": {"usage": {"total": 5000, "percpu": [2000, 3000]}}, "pids": {"current": 2}}


@pytest.fixture
def shim(tmp_path):
    events: list = []
    quark = FakeQuark()
    shut = threading.Event()
    service = TaskService(quark, events.append, "testns", on_shutdown=shut.set)
    sock_path = str(tmp_path / "shim.sock")
    server = Server(listen(sock_path))
    service.register(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    yield sock_path, quark, events, str(bundle), shut
    server.close()


def call(path, method, req, resp_type):
    c = Client(path, timeout=10)
    try:
        return c.call(SERVICE, method, req, resp_type)
    finally:
        c.close()


def topics(events):
    return [TOPICS[e.DESCRIPTOR.name] for e in events]


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_unknown_id_is_not_found_and_shim_keeps_serving(shim):
    path, *_ = shim
    for method, req, resp in [("State", pb.StateRequest(id="nope"), pb.StateResponse),
                              ("Start", pb.StartRequest(id="nope"), pb.StartResponse),
                              ("Kill", pb.KillRequest(id="nope", signal=9), empty_pb2.Empty),
                              ("Delete", pb.DeleteRequest(id="nope"), pb.DeleteResponse),
                              ("Wait", pb.WaitRequest(id="nope"), pb.WaitResponse),
                              ("Pids", pb.PidsRequest(id="nope"), pb.PidsResponse)]:
        with pytest.raises(RpcError) as e:
            call(path, method, req, resp)
        assert e.value.code == Code.NOT_FOUND, method
    assert call(path, "Connect", pb.ConnectRequest(id="nope"), pb.ConnectResponse).shim_pid == os.getpid()


def test_unknown_method_and_checkpoint_are_unimplemented(shim):
    path, *_ = shim
    c = Client(path, timeout=10)
    with pytest.raises(RpcError) as e:
        c.call(SERVICE, "Frobnicate", empty_pb2.Empty(), empty_pb2.Empty)
    assert e.value.code == Code.UNIMPLEMENTED
    with pytest.raises(RpcError) as e:
        c.call("containerd.task.v3.Task", "State", pb.StateRequest(id="x"), pb.StateResponse)
    assert e.value.code == Code.UNIMPLEMENTED
    with pytest.raises(RpcError) as e:
        c.call(SERVICE, "Checkpoint", pb.CheckpointTaskRequest(id="x"), empty_pb2.Empty)
    assert e.value.code == Code.UNIMPLEMENTED
    c.close()


def _raw_conn(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _closed(s) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("bad", [
    HEADER.pack(4, 1, 7, 0) + b"abcd",                      # not a request
    HEADER.pack(MESSAGE_LENGTH_MAX + 1, 1, 1, 0),           # oversize
    frame(1, 1, b"\xff\xff\xff\xff\xff"),                    # not a protobuf Request
    HEADER.pack(3, 2, 1, 0) + b"\x0a\x01x",                  # even (server-side) stream id
])
def test_malformed_frame_closes_only_that_connection(shim, bad):
    path, *_ = shim
    good = Client(path, timeout=10)
    s = _raw_conn(path)
    s.sendall(bad)
    assert _closed(s)
    s.close()
    assert good.call(SERVICE, "Connect", pb.ConnectRequest(), pb.ConnectResponse).shim_pid == os.getpid()
    assert call(path, "Connect", pb.ConnectRequest(), pb.ConnectResponse).shim_pid == os.getpid()
    good.close()


def test_undecodable_method_payload_is_invalid_argument(shim):
    path, *_ = shim
    s = _raw_conn(path)
    req = ttrpc_pb2.Request(service=SERVICE, method="State", payload=b"\xff\xff\xff")
    s.sendall(frame(1, 1, req.SerializeToString()))
    sid, kind, _flags, payload = read_frame(s)
    resp = ttrpc_pb2.Response.FromString(payload)
    assert (sid, kind, resp.status.code) == (1, 2, Code.INVALID_ARGUMENT)
    s.close()


def _create(path, bundle, cid="c1", **kw):
    return call(path, "Create", pb.CreateTaskRequest(id=cid, bundle=bundle, **kw), pb.CreateTaskResponse)


def test_lifecycle_events_in_order_and_wait_before_start(shim):
    path, quark, events, bundle, _ = shim
    pid = _create(path, bundle).pid
    assert pid == 3_999_000
    with pytest.raises(RpcError) as e:
        _create(path, bundle)
    assert e.value.code == Code.ALREADY_EXISTS

    # Wait is sent before Start and blocks; State on the same connection is answered meanwhile.
    s = _raw_conn(path)
    s.sendall(frame(1, 1, ttrpc_pb2.Request(service=SERVICE, method="Wait",
                                            payload=pb.WaitRequest(id="c1").SerializeToString()).SerializeToString()))
    s.sendall(frame(3, 1, ttrpc_pb2.Request(service=SERVICE, method="State",
                                            payload=pb.StateRequest(id="c1").SerializeToString()).SerializeToString()))
    sid, _k, _f, payload = read_frame(s)
    assert sid == 3
    state = pb.StateResponse.FromString(ttrpc_pb2.Response.FromString(payload).payload)
    assert (state.status, state.pid) == (types.CREATED, 3_999_000)

    assert call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse).pid == 3_999_000
    with pytest.raises(RpcError) as e:
        call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse)
    assert e.value.code == Code.FAILED_PRECONDITION
    with pytest.raises(RpcError) as e:
        call(path, "Delete", pb.DeleteRequest(id="c1"), pb.DeleteResponse)
    assert e.value.code == Code.FAILED_PRECONDITION

    quark.finish("c1", None, 7)
    sid, _k, _f, payload = read_frame(s)
    waited = pb.WaitResponse.FromString(ttrpc_pb2.Response.FromString(payload).payload)
    assert (sid, waited.exit_status) == (1, 7)
    assert waited.exited_at.nanos == 123456789
    s.close()
    state = call(path, "State", pb.StateRequest(id="c1"), pb.StateResponse)
    assert (state.status, state.exit_status) == (types.STOPPED, 7)
    deleted = call(path, "Delete", pb.DeleteRequest(id="c1"), pb.DeleteResponse)
    assert (deleted.pid, deleted.exit_status) == (3_999_000, 7)
    assert topics(events) == ["/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete"]
    assert events[2].exit_status == 7 and events[2].id == "c1" and events[2].pid == 3_999_000
    with pytest.raises(RpcError) as e:
        call(path, "State", pb.StateRequest(id="c1"), pb.StateResponse)
    assert e.value.code == Code.NOT_FOUND


def test_exit_racing_start_is_published_after_start(shim):
    path, quark, events, bundle, _ = shim
    _create(path, bundle)
    quark.exit_on_start = True
    call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse)
    assert wait_for(lambda: len(events) == 3)
    assert topics(events) == ["/tasks/create", "/tasks/start", "/tasks/exit"]
    assert events[2].exit_status == 3


def test_failed_start_answers_once_the_task_is_stopped(shim):
    # containerd's CRI kills and deletes a task whose start failed; its client refuses to delete a
    # task still "created" ("task must be stopped before deletion"), which left the container
    # behind and RemovePodSandbox failing
    path, quark, events, bundle, _ = shim
    _create(path, bundle)
    quark.fail_start = True
    with pytest.raises(RpcError) as e:
        call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse)
    assert "/no/such/program" in str(e.value)
    state = call(path, "State", pb.StateRequest(id="c1"), pb.StateResponse)
    assert (state.status, state.exit_status) == (types.STOPPED, 127)
    call(path, "Delete", pb.DeleteRequest(id="c1"), pb.DeleteResponse)
    assert topics(events) == ["/tasks/create", "/tasks/exit", "/tasks/delete"]


def test_exec_pause_resume_stats_update_and_shutdown(shim):
    path, quark, events, bundle, shut = shim
    _create(path, bundle)
    call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse)
    spec = any_pb2.Any(type_url="types.containerd.io/opencontainers/runtime-spec/1/Process",
                       value=b'{"args":["sh"],"cwd":"/"}')
    call(path, "Exec", pb.ExecProcessRequest(id="c1", exec_id="e1", spec=spec), empty_pb2.Empty)
    with pytest.raises(RpcError) as e:
        call(path, "Exec", pb.ExecProcessRequest(id="c1", exec_id="e1", spec=spec), empty_pb2.Empty)
    assert e.value.code == Code.ALREADY_EXISTS
    epid = call(path, "Start", pb.StartRequest(id="c1", exec_id="e1"), pb.StartResponse).pid
    assert ("exec", "c1", b'{"args":["sh"],"cwd":"/"}') in quark.calls
    state = call(path, "State", pb.StateRequest(id="c1", exec_id="e1"), pb.StateResponse)
    assert (state.status, state.pid, state.exec_id) == (types.RUNNING, epid, "e1")
    quark.finish("c1", epid, 42)
    assert call(path, "Wait", pb.WaitRequest(id="c1", exec_id="e1"), pb.WaitResponse).exit_status == 42
    assert call(path, "Delete", pb.DeleteRequest(id="c1", exec_id="e1"), pb.DeleteResponse).exit_status == 42

    call(path, "Pause", pb.PauseRequest(id="c1"), empty_pb2.Empty)
    assert call(path, "State", pb.StateRequest(id="c1"), pb.StateResponse).status == types.PAUSED
    call(path, "Resume", pb.ResumeRequest(id="c1"), empty_pb2.Empty)
    assert [p.pid for p in call(path, "Pids", pb.PidsRequest(id="c1"), pb.PidsResponse).processes] == [1000, 1001]
    call(path, "Update", pb.UpdateTaskRequest(id="c1", resources=any_pb2.Any(value=b'{"pids":{"limit":5}}')),
         empty_pb2.Empty)
    assert ("update", "c1", b'{"pids":{"limit":5}}') in quark.calls
    stats = call(path, "Stats", pb.StatsRequest(id="c1"), pb.StatsResponse).stats
    assert stats.type_url in ("io.containerd.cgroups.v1.Metrics", "io.containerd.cgroups.v2.Metrics")

    call(path, "Shutdown", pb.ShutdownRequest(id="c1"), empty_pb2.Empty)
    assert not shut.is_set()  # a container is still there
    call(path, "Kill", pb.KillRequest(id="c1", signal=15), empty_pb2.Empty)
    assert call(path, "Wait", pb.WaitRequest(id="c1"), pb.WaitResponse).exit_status == 143
    call(path, "Delete", pb.DeleteRequest(id="c1"), pb.DeleteResponse)
    call(path, "Shutdown", pb.ShutdownRequest(id="c1"), empty_pb2.Empty)
    assert shut.is_set()
    assert topics(events) == ["/tasks/create", "/tasks/start", "/tasks/exec-added", "/tasks/exec-started",
                              "/tasks/exit", "/tasks/paused", "/tasks/resumed", "/tasks/exit", "/tasks/delete"]


def test_delete_of_created_container_forces_and_reports_exit(shim):
    path, quark, events, bundle, _ = shim
    _create(path, bundle)
    resp = call(path, "Delete", pb.DeleteRequest(id="c1"), pb.DeleteResponse)
    assert resp.exit_status == 137
    assert ("delete", "c1", True) in quark.calls
    assert topics(events) == ["/tasks/create", "/tasks/exit", "/tasks/delete"]


def test_failed_create_maps_code_and_leaves_nothing(shim):
    path, quark, events, bundle, _ = shim
    with pytest.raises(RpcError) as e:
        _create(path, bundle, cid="bad")
    assert e.value.code == Code.INVALID_ARGUMENT
    assert events == []
    _create(path, bundle, cid="c1")  # the shim still works


def test_metrics_conversion():
    data = {"memory": {"usage": {"usage": 4096, "limit": 2**64 - 1}, "raw": {"rss": 8192, "pgfault": 7}},
            "cpu": {"usage": {"total": 5000, "kernel": 1000, "user": 4000, "percpu": [2000, 3000]},
                    "throttling": {"periods": 3}},
            "pids": {"current": 2, "limit": 10}}
    m1 = cgroups_v1_pb2.Metrics.FromString(metrics.to_any(data, unified=False).value)
    assert (m1.memory.usage.usage, m1.memory.rss, m1.memory.pg_fault) == (4096, 8192, 7)
    assert (list(m1.cpu.usage.per_cpu), m1.cpu.throttling.periods, m1.pids.limit) == ([2000, 3000], 3, 10)
    a2 = metrics.to_any(data, unified=True)
    assert a2.type_url == "io.containerd.cgroups.v2.Metrics"
    m2 = cgroups_v2_pb2.Metrics.FromString(a2.value)
    assert (m2.memory.usage, m2.cpu.usage_usec, m2.pids.current) == (4096, 5, 2)


def test_event_any_uses_bare_type_name():
    from shim.pb import events_task_pb2
    a = to_any(events_task_pb2.TaskOOM(container_id="x"))
    assert a.type_url == "containerd.events.TaskOOM"


def test_go_style_flags():
    from shim.main import build_parser
    a = build_parser().parse_args(["-namespace", "k8s.io", "-address", "/run/c.sock", "-publish-binary",
                                   "/usr/bin/containerd", "-debug", "-id=abc", "start"])
    assert (a.namespace, a.address, a.id, a.debug, a.action) == ("k8s.io", "/run/c.sock", "abc", True, "start")


def test_paths(tmp_path):
    from shim import paths
    b = tmp_path / "state" / "io.containerd.runtime.v2.task" / "ns1" / "c1"
    b.mkdir(parents=True)
    assert paths.quark_root(str(b), "ns1") == str(tmp_path / "state" / "quark" / "ns1")
    assert paths.quark_root("/somewhere/else", "ns1") == "/run/containerd/quark/ns1"
    (b / "config.json").write_text('{"annotations": {"io.kubernetes.cri.sandbox-id": "pod1"}}')
    assert paths.shim_group(str(b), "c1") == "pod1"
    a1 = paths.socket_address("/run/c.sock", "ns1", "pod1")
    assert a1.startswith("unix:///run/containerd/s/") and len(a1) < 108
    assert a1 != paths.socket_address("/run/c.sock", "ns2", "pod1")


def test_lingering_shim_leaves_the_next_shims_socket_alone(tmp_path):
    """After Shutdown a shim lingers ~0.2 s; a new shim for the same id started meanwhile takes
    over the socket path, and the old one must not remove it on its way out."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the shim's socket lives under /run/containerd/s")
    import subprocess
    import sys
    from shim.ttrpc import socket_path
    shim_bin = os.path.join(os.path.dirname(sys.executable), "containerd-shim-quark-v1")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    argv = [shim_bin, "-namespace", "t", "-address", str(tmp_path / "no-containerd.sock"), "-id", "same", "start"]
    env = dict(os.environ, TTRPC_ADDRESS=str(tmp_path / "no-containerd.sock.ttrpc"))
    pids = []
    try:
        first = subprocess.run(argv, cwd=bundle, env=env, capture_output=True, text=True, check=True).stdout
        pids.append(int((bundle / "shim.pid").read_text()))
        path = socket_path(first)
        call(path, "Shutdown", pb.ShutdownRequest(id="same"), empty_pb2.Empty)   # no tasks: it exits soon
        second = subprocess.run(argv, cwd=bundle, env=env, capture_output=True, text=True, check=True).stdout
        pids.append(int((bundle / "shim.pid").read_text()))
        assert second == first and pids[0] != pids[1]
        assert wait_for(lambda: not alive(pids[0]), timeout=5)
        time.sleep(0.1)
        assert os.path.exists(path), "the old shim removed the new shim's socket"
        with pytest.raises(RpcError) as e:
            call(path, "State", pb.StateRequest(id="nope"), pb.StateResponse)
        assert e.value.code == Code.NOT_FOUND   # the new shim answers
    finally:
        if len(pids) == 2:
            try:
                call(socket_path(first), "Shutdown", pb.ShutdownRequest(id="same"), empty_pb2.Empty)
            except (OSError, RpcError):
                pass
        for pid in pids:
            wait_for(lambda: not alive(pid), timeout=5)
            if alive(pid):
                os.kill(pid, 9)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _ttrpc_threads() -> int:
    """The shim's request workers (named after their method; the readers are "ttrpc-conn")."""
    return sum(t.name.startswith("ttrpc-") and t.name != "ttrpc-conn" for t in threading.enumerate())


def _request(stream_id: int, method: str, req) -> bytes:
    return frame(stream_id, 1, ttrpc_pb2.Request(service=SERVICE, method=method,
                                                 payload=req.SerializeToString()).SerializeToString())


def _answers(s, n: int) -> dict[int, ttrpc_pb2.Response]:
    out = {}
    while len(out) < n:
        sid, _k, _f, payload = read_frame(s)
        out[sid] = ttrpc_pb2.Response.FromString(payload)
    return out


def test_request_flood_is_answered_by_a_bounded_number_of_threads(shim):
    path, quark, _events, bundle, _ = shim
    _create(path, bundle)
    quark.ps_seconds = 0.05
    base, base_ttrpc = _threads(), _ttrpc_threads()
    s = _raw_conn(path)
    s.settimeout(60)
    n = 500
    s.sendall(b"".join(_request(2 * i + 1, "Pids", pb.PidsRequest(id="c1")) for i in range(n)))
    peak = peak_ttrpc = 0
    stop = threading.Event()

    def sample():
        nonlocal peak, peak_ttrpc
        while not stop.is_set():
            peak, peak_ttrpc = max(peak, _threads()), max(peak_ttrpc, _ttrpc_threads())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        answers = _answers(s, n)
    finally:
        stop.set()
        sampler.join()
    assert sorted(answers) == [2 * i + 1 for i in range(n)]
    assert all(r.status.code == Code.OK for r in answers.values())
    # the shim's request workers (unbounded, 500 requests made ~127; the slack: workers that have
    # freed their slot and not yet ended); and all the process's tasks,
    # which also count the connection readers, the sampler and short-lived threads of the test
    # process the shim shares (the fake quark's pipes), with room for those
    assert peak_ttrpc - base_ttrpc <= MAX_WORKERS + 8, f"{peak_ttrpc - base_ttrpc} workers for {n} requests"
    assert peak - base <= MAX_WORKERS + 16, f"{peak - base} threads for {n} requests"
    s.close()
    assert call(path, "Connect", pb.ConnectRequest(), pb.ConnectResponse).shim_pid == os.getpid()


def test_wait_flood_holds_no_threads_and_is_refused_beyond_the_bound(shim):
    path, quark, _events, bundle, _ = shim
    _create(path, bundle)
    base = _threads()
    s = _raw_conn(path)
    s.settimeout(60)
    n = MAX_PARKED + 20
    s.sendall(b"".join(_request(2 * i + 1, "Wait", pb.WaitRequest(id="c1")) for i in range(n)))
    refused = _answers(s, 20)   # at once, while the others wait for the exit
    assert all(r.status.code == Code.RESOURCE_EXHAUSTED for r in refused.values())
    assert sorted(refused) == [2 * i + 1 for i in range(MAX_PARKED, n)]
    assert wait_for(lambda: _threads() - base <= 1), f"{_threads() - base} threads hold {MAX_PARKED} Waits"
    quark.finish("c1", None, 5)
    waited = _answers(s, MAX_PARKED)
    assert {pb.WaitResponse.FromString(r.payload).exit_status for r in waited.values()} == {5}
    s.close()


def test_waits_of_a_closed_connection_are_let_go(shim):
    path, quark, _events, bundle, _ = shim
    _create(path, bundle)
    s = _raw_conn(path)
    s.sendall(b"".join(_request(2 * i + 1, "Wait", pb.WaitRequest(id="c1")) for i in range(MAX_PARKED)))
    s.sendall(_request(2 * MAX_PARKED + 1, "Connect", pb.ConnectRequest()))
    assert read_frame(s)[0] == 2 * MAX_PARKED + 1   # the Waits before it have all taken their places
    assert _waits_refused(path)
    s.close()
    assert wait_for(lambda: not _waits_refused(path)), "a closed connection's Waits still count"


def _waits_refused(path) -> bool:
    """Whether a Wait sent now is refused (else it is parked, and answered only at the exit)."""
    s = _raw_conn(path)
    try:
        s.sendall(_request(1, "Wait", pb.WaitRequest(id="c1")))
        s.settimeout(0.2)
        try:
            _sid, _k, _f, payload = read_frame(s)
        except socket.timeout:
            return False
        return ttrpc_pb2.Response.FromString(payload).status.code == Code.RESOURCE_EXHAUSTED
    finally:
        s.close()


def test_connection_flood_is_refused_beyond_the_bound(shim):
    path, *_ = shim
    conns = [_raw_conn(path) for _ in range(MAX_CONNECTIONS + 5)]
    served = []
    for s in conns:
        try:
            s.sendall(_request(1, "Connect", pb.ConnectRequest()))
            served.append(read_frame(s) is not None)
        except (ConnectionResetError, BrokenPipeError):
            served.append(False)
    assert served == [True] * MAX_CONNECTIONS + [False] * 5
    for s in conns:
        s.close()
    assert wait_for(lambda: _connects(path))


def _connects(path) -> bool:
    try:
        return call(path, "Connect", pb.ConnectRequest(), pb.ConnectResponse).shim_pid == os.getpid()
    except (ConnectionError, OSError):
        return False


def test_client_that_reads_no_answers_is_disconnected(shim, monkeypatch):
    """Its answers fill the socket and block the workers sending them, until SEND_TIMEOUT_S: then
    the shim hangs up (its sender sees EPIPE) and serves others again."""
    from shim import ttrpc
    monkeypatch.setattr(ttrpc, "SEND_TIMEOUT_S", 1)
    path, *_ = shim
    s = _raw_conn(path)
    s.settimeout(None)
    flood = b"".join(_request(2 * i + 1, "Connect", pb.ConnectRequest()) for i in range(20000))
    hung_up = []

    def send():
        try:
            s.sendall(flood)   # more than the socket holds, as the shim stops reading
        except OSError as e:
            hung_up.append(e)
    sender = threading.Thread(target=send)
    sender.start()
    try:
        sender.join(15)
        assert hung_up, "the shim kept a connection that reads no answers"
        assert call(path, "Connect", pb.ConnectRequest(), pb.ConnectResponse).shim_pid == os.getpid()
    finally:
        s.close()
        sender.join()


def test_kill_of_an_exec_goes_through_quark_and_not_after_its_exit(shim):
    path, quark, _events, bundle, _ = shim
    _create(path, bundle)
    call(path, "Start", pb.StartRequest(id="c1"), pb.StartResponse)
    spec = any_pb2.Any(value=b'{"args":["sh"],"cwd":"/"}')
    call(path, "Exec", pb.ExecProcessRequest(id="c1", exec_id="e1", spec=spec), empty_pb2.Empty)
    epid = call(path, "Start", pb.StartRequest(id="c1", exec_id="e1"), pb.StartResponse).pid
    call(path, "Kill", pb.KillRequest(id="c1", exec_id="e1", signal=15), empty_pb2.Empty)
    assert ("kill_exec", "c1", epid, 15) in quark.calls
    quark.finish("c1", epid, 143)
    call(path, "Wait", pb.WaitRequest(id="c1", exec_id="e1"), pb.WaitResponse)
    with pytest.raises(RpcError) as e:
        call(path, "Kill", pb.KillRequest(id="c1", exec_id="e1", signal=9), empty_pb2.Empty)
    assert e.value.code == Code.NOT_FOUND
    assert [c for c in quark.calls if c[0] == "kill_exec"] == [("kill_exec", "c1", epid, 15)]
