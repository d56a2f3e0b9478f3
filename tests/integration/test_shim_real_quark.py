"""The shim's Task service over ttrpc, in-process, driving the real quark (no containerd).

What containerd sees of quark's errors is a status code, chosen by the error's kind wherever it
was raised: in the shim's process, in the `quark` CLI (its JSON log), or in the container's
supervisor (its control-socket reply, then the CLI's log). And a Kill for an exec'd process that
has exited signals nothing, even when its pid already belongs to another process.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
from google.protobuf import any_pb2, empty_pb2

from shim.pb import shim_pb2 as pb
from shim.runtime import Quark
from shim.service import SERVICE, TaskService
from shim.ttrpc import Client, Code, RpcError, Server, listen

pytestmark = pytest.mark.root


class HeldExecWaits(Quark):
    """The real quark, but the shim learns an exec'd process's exit only when the test says: as
    when its output takes a while to drain (up to OUTPUT_DRAIN_S), a window in which containerd
    may still send a Kill for it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.exited = threading.Event()
        self.release = threading.Event()

    def wait(self, cid, pid=None):
        exit_ = super().wait(cid, pid)
        if pid:
            self.exited.set()
            self.release.wait(60)
        return exit_


@pytest.fixture
def shim(quark, tmp_path):
    q = HeldExecWaits(quark.root)
    service = TaskService(q, lambda _event: None, "testns", on_shutdown=lambda: None)
    path = str(tmp_path / "shim.sock")
    server = Server(listen(path))
    service.register(server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield path, q
    q.release.set()
    server.close()


def call(path, method, req, resp_type):
    c = Client(path, timeout=30)
    try:
        return c.call(SERVICE, method, req, resp_type)
    finally:
        c.close()


def code_of(path, method, req, resp_type) -> Code:
    with pytest.raises(RpcError) as e:
        call(path, method, req, resp_type)
    return e.value.code


def unique(name: str) -> str:
    # containers of concurrent tests share /quark/<id> cgroups: ids of this test only
    return f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}"


def exec_spec(bundle: str, args: list[str]) -> any_pb2.Any:
    with open(os.path.join(bundle, "config.json")) as f:
        process = json.load(f)["process"]
    return any_pb2.Any(value=json.dumps(dict(process, args=args, terminal=False)).encode())


def test_quark_errors_reach_containerd_as_status_codes(shim, quark, bundle):
    path, _q = shim
    taken = unique("taken")
    b = bundle(["sleep", "1000"])
    quark("create", "--bundle", b, taken)   # quark has it, the shim does not: the CLI refuses
    assert code_of(path, "Create", pb.CreateTaskRequest(id=taken, bundle=b), pb.CreateTaskResponse) \
        == Code.ALREADY_EXISTS

    cid = unique("codes")
    b2 = bundle(["sleep", "1000"])
    call(path, "Create", pb.CreateTaskRequest(id=cid, bundle=b2), pb.CreateTaskResponse)
    quark("start", cid)   # behind the shim's back: quark refuses a second start
    assert code_of(path, "Start", pb.StartRequest(id=cid), pb.StartResponse) == Code.FAILED_PRECONDITION

    # refused by the supervisor (process.args), reported through the CLI's log
    bad = any_pb2.Any(value=b'{"args": "sh", "cwd": "/"}')
    call(path, "Exec", pb.ExecProcessRequest(id=cid, exec_id="bad", spec=bad), empty_pb2.Empty)
    assert code_of(path, "Start", pb.StartRequest(id=cid, exec_id="bad"), pb.StartResponse) \
        == Code.INVALID_ARGUMENT

    quark("delete", "--force", cid)   # gone from quark: in-process and CLI verbs say NotFound
    assert code_of(path, "Pids", pb.PidsRequest(id=cid), pb.PidsResponse) == Code.NOT_FOUND
    update = pb.UpdateTaskRequest(id=cid, resources=any_pb2.Any(value=b'{"pids": {"limit": 5}}'))
    assert code_of(path, "Update", update, empty_pb2.Empty) == Code.NOT_FOUND


def spawn_with_pid(pid: int, attempts: int = 300) -> subprocess.Popen:
    """A process that gets `pid` (free again), through ns_last_pid as CRIU does; other processes
    forking in between take the pid first now and then, so it tries again."""
    for _ in range(attempts):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "60"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"could not get pid {pid} back: other processes kept forking in between")


def test_kill_of_exited_exec_signals_nothing_even_when_its_pid_is_reused(shim, quark, bundle):
    path, q = shim
    cid = unique("reuse")
    b = bundle(["sleep", "1000"])
    call(path, "Create", pb.CreateTaskRequest(id=cid, bundle=b), pb.CreateTaskResponse)
    call(path, "Start", pb.StartRequest(id=cid), pb.StartResponse)
    call(path, "Exec", pb.ExecProcessRequest(id=cid, exec_id="e1", spec=exec_spec(b, ["true"])), empty_pb2.Empty)
    pid = call(path, "Start", pb.StartRequest(id=cid, exec_id="e1"), pb.StartResponse).pid
    assert q.exited.wait(30)   # reaped by the supervisor; the shim does not know yet
    decoy = spawn_with_pid(pid)
    try:
        code = code_of(path, "Kill", pb.KillRequest(id=cid, exec_id="e1", signal=9), empty_pb2.Empty)
        assert code == Code.NOT_FOUND   # containerd: "process already finished"
        time.sleep(0.1)
        assert decoy.poll() is None, "the shim's Kill hit another process that has the exec's old pid"
    finally:
        decoy.kill()
        decoy.wait()
    q.release.set()
    assert call(path, "Wait", pb.WaitRequest(id=cid, exec_id="e1"), pb.WaitResponse).exit_status == 0
