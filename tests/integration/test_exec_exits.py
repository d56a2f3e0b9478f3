"""The supervisor's book of exec'd processes: their exits are kept only until a wait collects
them, so a long-lived container that runs many execs holds nothing for the ones that are over;
and a signal for an exec'd process reaches it only while it is one (never a reused pid)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from qlib.errors import NotFound
from qvisor.container.kill import kill_exec
from qvisor.container.wait import wait
from qvisor.client import Connection
from qvisor.state import SOCK_NAME, StateStore

pytestmark = pytest.mark.root


def tables(quark, cid: str) -> dict:
    """The supervisor's read-only account of what it holds."""
    with Connection(StateStore(quark.root).dir(cid)) as c:
        return c.call({"op": "tables"})[0]


def unique(name: str) -> str:
    # containers of concurrent tests share /quark/<id> cgroups: ids of this test only
    return f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**6}"


def run_sleeper(quark, bundle) -> str:
    cid = unique("exits")
    quark("run", "-d", "--bundle", bundle(["sleep", "1000"]), cid)
    return cid


def test_many_execs_leave_nothing_in_the_supervisor(quark, bundle):
    cid = run_sleeper(quark, bundle)
    for _ in range(50):
        assert quark("exec", cid, "true").returncode == 0
    assert tables(quark, cid) == {"execs": 0, "exits": 0, "waiters": 0}


def test_detached_exec_exit_is_kept_for_one_wait_then_dropped(quark, bundle, tmp_path):
    cid = run_sleeper(quark, bundle)
    pid_file = tmp_path / "pid"
    quark("exec", "-d", "--pid-file", str(pid_file), cid, "sh", "-c", "exit 7")
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while tables(quark, cid)["exits"] != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tables(quark, cid) == {"execs": 0, "exits": 1, "waiters": 0}
    assert json.loads(quark("wait", "--pid", str(pid), cid).stdout)["exit_status"] == 7
    assert tables(quark, cid)["exits"] == 0
    again = quark("wait", "--pid", str(pid), cid, check=False)
    assert again.returncode == 1 and "exit status was collected already" in again.stderr


def test_signal_reaches_a_running_exec_and_not_an_exited_one(quark, bundle, tmp_path):
    cid = run_sleeper(quark, bundle)
    pid_file = tmp_path / "pid"
    quark("exec", "-d", "--pid-file", str(pid_file), cid, "sleep", "100")
    pid = int(pid_file.read_text())
    kill_exec(quark.root, cid, pid, signal.SIGTERM)
    assert wait(quark.root, cid, pid)["exit_status"] == 128 + signal.SIGTERM
    with pytest.raises(NotFound):
        kill_exec(quark.root, cid, pid, signal.SIGKILL)
    quark("kill", cid, "KILL")
    deadline = time.monotonic() + 10
    while os.path.exists(StateStore(quark.root).path(cid, SOCK_NAME)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(StateStore(quark.root).path(cid, SOCK_NAME))
    with pytest.raises(NotFound):   # the supervisor is gone with its container
        kill_exec(quark.root, cid, pid, signal.SIGKILL)
