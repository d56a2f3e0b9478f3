"""The host's ksmd, run for a measurement or a test and put back as it was.

Only on a host that does not use KSM (run = 0): turning it off afterwards (run = 2 unmerges
everything first) would disturb anyone else's merging. Used by bench/startup.py and
tests/integration/test_page_merge.py."""
from __future__ import annotations

import contextlib
import os
import time

KSM = "/sys/kernel/mm/ksm"


class InUse(RuntimeError):
    pass


def read(name: str) -> str:
    with open(os.path.join(KSM, name)) as f:
        return f.read().strip()


def _write(name: str, value: str) -> None:
    with open(os.path.join(KSM, name), "w") as f:
        f.write(value)


def check_unused() -> None:
    """InUse when the host runs ksmd; OSError when the kernel has no KSM."""
    run = read("run")
    if run != "0":
        raise InUse(f"the host's KSM is in use ({KSM}/run = {run})")


@contextlib.contextmanager
def running(pages_to_scan: int = 5000, sleep_ms: int = 10):
    """ksmd on, scanning fast; on exit everything it merged is unmerged, ksmd off, its rate restored."""
    check_unused()
    saved = {n: read(n) for n in ("pages_to_scan", "sleep_millisecs")}
    _write("pages_to_scan", str(pages_to_scan))
    _write("sleep_millisecs", str(sleep_ms))
    _write("run", "1")
    try:
        yield
    finally:
        _write("run", "2")
        _write("run", "0")
        for name, value in saved.items():
            _write(name, value)


def wait_full_scans(scans: int, timeout: float = 120) -> None:
    target = int(read("full_scans")) + scans
    deadline = time.monotonic() + timeout
    while int(read("full_scans")) < target and time.monotonic() < deadline:
        time.sleep(0.2)


def ksmd_cpu_s() -> float:
    """CPU time of the ksmd kernel thread (0 when there is none)."""
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/comm") as f:
                if f.read().strip() != "ksmd":
                    continue
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            continue
    return 0.0
