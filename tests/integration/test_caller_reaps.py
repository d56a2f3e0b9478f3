"""A caller that reaps the container's processes itself, as containerd's runc shim and conmon do: a
child subreaper that runs `quark create --pid-file` and waits for that pid. On Linux 6.15+ the
supervisor reads the exit status from the pidfd; before (the cgroup v2 lane's 6.1 guest) it learns
only that the process ended. Either way the caller reaps and quark's state follows."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

from tests.integration.test_lifecycle import wait_status

CALLER = r"""
import ctypes, json, os, subprocess, sys
quark, bundle, cid, pidfile = json.loads(sys.argv[1])
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER, as the runc shim is
env = dict(os.environ, QUARK_INIT_REAPER="caller")
subprocess.run(quark + ["create", "--bundle", bundle, "--pid-file", pidfile, cid], env=env, check=True)
pid = int(open(pidfile).read())
subprocess.run(quark + ["start", cid], check=True)
_, status = os.waitpid(pid, 0)   # ECHILD if the supervisor had kept the init for itself
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_subreaper_caller_reaps_the_init_and_quark_sees_it_stop(quark, bundle, tmp_path) -> None:
    cid = f"reap-{uuid.uuid4().hex[:8]}"
    args = [quark.argv0 + ["--root", quark.root], bundle(["sh", "-c", "sleep 0.3; exit 7"]), cid,
            str(tmp_path / "pid")]
    r = subprocess.run([sys.executable, "-c", CALLER, json.dumps(args)], capture_output=True, text=True, check=False,
                       timeout=60)
    assert (r.returncode, r.stdout) == (0, "7\n"), r.stderr
    deadline = time.monotonic() + 10
    while quark.state(cid)["status"] != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert quark.state(cid)["status"] == "stopped"
    quark("delete", cid)
    assert cid not in quark.ids()


EXEC_CALLER = r"""
import ctypes, json, os, subprocess, sys
quark, cid, pidfile, args = json.loads(sys.argv[1])
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER: podman runs one conmon per exec
subprocess.run(quark + ["exec", "-d", "--pid-file", pidfile, cid] + args, check=True)
_, status = os.waitpid(int(open(pidfile).read()), 0)   # ECHILD if it went to the container's reaper
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_an_exec_goes_to_its_own_callers_subreaper(quark, bundle, tmp_path) -> None:
    # podman: the container's conmon reaps the init, and each `podman exec` has a conmon of its
    # own that waits for the pid `quark exec -d --pid-file` wrote; with runc that process is its
    # child. A process the supervisor forked went to the container's conmon: podman exec said 255.
    cid = f"reap-{uuid.uuid4().hex[:8]}"
    args = [quark.argv0 + ["--root", quark.root], bundle(["sleep", "60"]), cid, str(tmp_path / "pid")]
    init_caller = subprocess.Popen([sys.executable, "-c", CALLER, json.dumps(args)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    try:
        assert wait_status(quark, cid, "running", timeout=30)["status"] == "running"
        for command, status in ((["sh", "-c", "exit 6"], "6\n"), (["sh", "-c", "kill -9 $$"], "-9\n")):
            r = subprocess.run([sys.executable, "-c", EXEC_CALLER,
                                json.dumps([args[0], cid, str(tmp_path / "exec.pid"), command])],
                               capture_output=True, text=True, check=False, timeout=60)
            assert (r.returncode, r.stdout) == (0, status), r.stderr
        # a failed exec leaves nothing behind in the supervisor, which still serves the container
        r = quark("exec", cid, "/no/such/program", check=False)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        assert quark("exec", cid, "true", check=False).returncode == 0
        quark("kill", cid, "KILL")
        init_caller.wait(timeout=30)
    finally:
        if init_caller.poll() is None:
            init_caller.kill()
            init_caller.wait()
    quark("delete", "--force", cid)
    assert cid not in quark.ids()
