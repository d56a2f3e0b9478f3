"""Fixtures for tests that run real containers: a private --root per test, busybox bundles, and a
teardown that force-deletes whatever a test left and checks nothing of quark remains."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# the `quark` users run (`make links` puts it on PATH): the C front end, which hands the hot verbs to
# the sandbox factory and execs the Python CLI beside this interpreter for the rest
_FRONT_END = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "qvisor", "_quark")
QUARK = [_FRONT_END if os.access(_FRONT_END, os.X_OK) else os.path.join(os.path.dirname(sys.executable), "quark")]


def withheld_capabilities(last: str = "") -> list[str]:
    """The capabilities (up to `last`, else all this kernel has) this host withholds from its root
    (CAP_SYS_RESOURCE on these machines): no runtime can give them to a container."""
    from qlib import linux as L
    from qvisor.process import not_held
    from qvisor.spec import CAPABILITIES
    top = CAPABILITIES[last] if last else L.last_cap()
    return not_held([n for n, bit in CAPABILITIES.items() if bit <= top], L.last_cap())


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: namespaces, mounts and cgroups")


class Quark:
    """Runs the real `quark` CLI against a private state root."""
    argv0 = QUARK
    name = "quark"

    def __init__(self, root: Path) -> None:
        self.root = str(root)

    def __call__(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        # files, not pipes: a created container keeps the stdio it was given (as with runc), so
        # a pipe would not reach EOF when `quark create` exits
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            p = subprocess.run(self.argv0 + ["--root", self.root, *args], stdout=out, stderr=err,
                               stdin=kw.pop("stdin", subprocess.DEVNULL), timeout=timeout, **kw)
            out.seek(0)
            err.seek(0)
            r = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
        if check and r.returncode != 0:
            raise AssertionError(f"{self.name} {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def state(self, cid: str) -> dict:
        return json.loads(self("state", cid).stdout)

    def ids(self) -> list[str]:
        return os.listdir(self.root) if os.path.isdir(self.root) else []


@pytest.fixture
def quark(tmp_path_factory) -> Quark:
    needs_root()
    root = tmp_path_factory.mktemp("quark-root")
    q = Quark(root)
    yield q
    leftovers = q.ids()
    for cid in leftovers:
        q("delete", "--force", cid, check=False)
    shutil.rmtree(root, ignore_errors=True)
    # a supervisor carries its `quark --root ROOT` argv: none may outlive its container
    survivors = _processes_mentioning(str(root))
    for _ in range(50):
        if not survivors:
            break
        time.sleep(0.1)
        survivors = _processes_mentioning(str(root))
    for pid in survivors:   # ours (this test's root): stop them so one leak fails one test only
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not survivors, f"quark processes left behind: {survivors}"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if text.encode() in argv:
            found.append(int(d))
    return found


@pytest.fixture
def bundle(tmp_path):
    """make(args, **overrides) -> bundle dir with a busybox rootfs and runc's default spec."""
    from tests.support.busybox import make_bundle
    n = [0]

    def make(args: list[str], **kw) -> str:
        n[0] += 1
        d = tmp_path / f"bundle{n[0]}"
        make_bundle(str(d), args, **kw)
        return str(d)
    return make


def edit_config(bundle: str, fn) -> None:
    p = os.path.join(bundle, "config.json")
    with open(p) as f:
        spec = json.load(f)
    fn(spec)
    with open(p, "w") as f:
        json.dump(spec, f)


def cgroup_dirs(cgroup_path: str) -> list[str]:
    from qvisor import cgroups
    return [d for d in cgroups.open_cgroup(cgroup_path).dirs() if os.path.isdir(d)]
