"""Whether a process the test started still runs, by pid (a zombie has ended: its parent has not reaped it yet)."""
from __future__ import annotations

import time


def alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    """Return once `pid` no longer runs; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs after {timeout} s"
        time.sleep(0.05)
