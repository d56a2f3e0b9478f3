"""`quark events`: statistics in runc's layout and OOM events, on whichever cgroup version the host
has (the cgroup v2 lane runs this file in a qemu guest)."""
from __future__ import annotations

import json
import subprocess
import time
import uuid

from tests.integration.conftest import edit_config

MiB = 1 << 20


def _limit_memory(limit: int):
    # memory+swap = memory: the hog cannot escape into swap, so the OOM killer must act
    def edit(spec: dict) -> None:
        spec["linux"].setdefault("resources", {})["memory"] = {"limit": limit, "swap": limit}
    return edit


def test_stats_in_runc_layout(quark, bundle) -> None:
    b = bundle(["sh", "-c", "while :; do :; done & sleep 100"])
    edit_config(b, _limit_memory(64 * MiB))
    cid = f"ev-{uuid.uuid4().hex[:8]}"
    quark("run", "-d", "--bundle", b, cid)
    time.sleep(0.5)   # let the busy loop burn some CPU
    event = json.loads(quark("events", "--stats", cid).stdout)
    assert (event["type"], event["id"]) == ("stats", cid)
    data = event["data"]
    assert data["memory"]["usage"]["limit"] == 64 * MiB
    assert 0 < data["memory"]["usage"]["usage"] < 64 * MiB
    assert data["memory"]["raw"], "memory.stat is reported as raw"
    assert data["cpu"]["usage"]["total"] > 100_000_000   # >= 0.1 s of the busy loop, in ns
    assert data["cpu"]["usage"]["user"] > 0
    assert data["pids"]["current"] >= 2   # the loop's subshell and sleep (sh execs the last command)
    assert "throttling" in data["cpu"] and isinstance(data["blkio"], dict)


def test_oom_event_streamed_and_ends_with_the_container(quark, bundle) -> None:
    b = bundle(["sleep", "60"])
    edit_config(b, _limit_memory(32 * MiB))
    cid = f"oom-{uuid.uuid4().hex[:8]}"
    quark("run", "-d", "--bundle", b, cid)
    ev = subprocess.Popen(quark.argv0 + ["--root", quark.root, "events", "--interval", "0.5", cid],
                          stdout=subprocess.PIPE, text=True)
    try:
        events = [json.loads(ev.stdout.readline())]   # watching: the OOM kill comes after this
        # tail buffers an endless line from /dev/zero until the OOM killer ends it
        assert quark("exec", cid, "tail", "/dev/zero", check=False, timeout=120).returncode == 137
        while events[-1]["type"] != "oom":
            events.append(json.loads(ev.stdout.readline()))
        quark("kill", cid, "KILL")
        # it ends by itself once the container stops (read through the same buffered reader:
        # communicate() would skip what readline() already buffered)
        events += [json.loads(line) for line in ev.stdout]
        ev.wait(timeout=30)
    finally:
        if ev.poll() is None:
            ev.kill()
            ev.wait()
        ev.stdout.close()
    kinds = [e["type"] for e in events]
    assert ev.returncode == 0
    assert kinds.count("oom") == 1, kinds
    assert "stats" in kinds and all(e["id"] == cid for e in events)
    assert events[kinds.index("oom")] == {"type": "oom", "id": cid}
