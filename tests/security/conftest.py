"""Fixtures for the escape tests: the integration fixtures (a private quark --root, busybox
bundles), the same for runc, bundles that see the host's /usr read-only (python3 inside), unique
container ids, compiled probe programs, and a record of each escape's outcome per runtime that is
printed at the end of the run (and written to $QUARK_SECURITY_REPORT as JSON when set)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import Quark, bundle, edit_config, needs_root, quark  # noqa: F401 (fixtures)

HERE = Path(__file__).resolve().parent
PROGS = HERE / "progs"
RUNC = shutil.which("runc") or "/usr/sbin/runc"
RUNTIMES = ("quark", "runc")
_ids = itertools.count(1)


def uid(name: str) -> str:
    """A container id no concurrent test run on this host uses (cgroup paths derive from ids)."""
    return f"sec-{name}-{os.getpid()}-{next(_ids)}"


def needs_runc() -> None:
    if not os.access(RUNC, os.X_OK):
        pytest.skip("runc is not installed")


class Runc(Quark):
    """runc's CLI against a private --root; same calling convention as the Quark fixture."""
    argv0 = [RUNC]
    name = "runc"

    def ids(self) -> list[str]:
        r = self("list", "-q", check=False)
        return r.stdout.split() if r.returncode == 0 else []


@pytest.fixture
def runc(tmp_path_factory) -> Runc:
    needs_root()
    needs_runc()
    root = tmp_path_factory.mktemp("runc-root")
    r = Runc(root)
    yield r
    for cid in r.ids():
        r("delete", "--force", cid, check=False)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=RUNTIMES)
def cli(request):
    """The runtime under test: quark, then runc on the same input."""
    needs_root()
    if request.param == "runc":
        needs_runc()
    return request.getfixturevalue(request.param)


def runtime_name(c) -> str:
    return "runc" if isinstance(c, Runc) else "quark"


def wait_for(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def init_pid(c, cid: str) -> int:
    return json.loads(c("state", cid).stdout)["pid"]


# ---- bundles that see the host's /usr (python3 inside) ------------------------------------------

@pytest.fixture
def host_bundle(tmp_path):
    """make(args, mounts=(), **overrides) -> (bundle dir, out dir): a read-only rootfs whose /usr is
    the host's (read-only bind), /progs this directory's programs, /bin-tools compiled probes
    (when given), /out a writable directory the test reads."""
    from qvisor.spec import default_spec
    from tests.support.busybox import make_bundle
    n = itertools.count(1)

    def make(args: list[str], *, extra_mounts: list[dict] = (), tools: str | None = None, **overrides) -> tuple[str, str]:
        d = tmp_path / f"hbundle{next(n)}"
        rootfs, out = d / "rootfs", d / "out"
        for sub in ("usr", "proc", "sys", "dev", "tmp", "out", "progs", "bin-tools", "etc", "root"):
            (rootfs / sub).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.lexists(f"/{link}"):
                os.symlink(f"usr/{link}", rootfs / link)
        out.mkdir()
        os.chmod(out, 0o777)
        mounts = default_spec()["mounts"] + [
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
            {"destination": "/progs", "type": "bind", "source": str(PROGS), "options": ["rbind", "ro"]},
            {"destination": "/out", "type": "bind", "source": str(out), "options": ["rbind", "rw"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]},
        ]
        if tools:
            mounts.append({"destination": "/bin-tools", "type": "bind", "source": tools, "options": ["rbind", "ro"]})
        mounts += list(extra_mounts)
        spec = default_spec()
        spec["process"]["env"] = spec["process"]["env"] + ["PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp"]
        make_bundle(str(d), args, rootfs=str(rootfs), mounts=mounts, process=dict(spec["process"], args=args,
                                                                                   terminal=False), **overrides)
        return str(d), str(out)
    return make


# ---- compiled probes ----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tools(tmp_path_factory) -> Path:
    """tests/security/progs/*.c, built static (they run in busybox and host-/usr rootfses alike)."""
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed")
    d = tmp_path_factory.mktemp("sec-tools")
    for src in PROGS.glob("*.c"):
        subprocess.run(["gcc", "-static", "-no-pie", "-O2", "-Wall", "-pthread", "-o", str(d / src.stem), str(src)],
                       check=True)
    os.chmod(d, 0o755)
    return d


# ---- what each runtime did, for the summary -------------------------------------------------------

RESULTS: dict[tuple[str, str], str] = {}


def record(escape: str, runtime: str, outcome: str) -> None:
    """Note one runtime's outcome for one escape (printed at the end of the run)."""
    RESULTS[(escape, runtime)] = outcome


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("escape outcomes (tests/security)")
    for (escape, rt), outcome in sorted(RESULTS.items()):
        terminalreporter.write_line(f"{escape:<42} {rt:<6} {outcome}")
    path = os.environ.get("QUARK_SECURITY_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump([{"escape": e, "runtime": r, "outcome": o} for (e, r), o in sorted(RESULTS.items())], f, indent=1)


# ---- nothing of ours may outlive the run ----------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _no_leftover_mounts(tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())
    yield
    left = [ln for ln in open("/proc/self/mountinfo") if base in ln]
    assert left == [], f"mounts left behind under {base}: {left}"


# ---- a tsord of our own -------------------------------------------------------------------------

class Tsord:
    """`python -m tsor.daemon` on a private socket (no network: no listen address, no routes)."""

    def __init__(self, d: Path) -> None:
        import sys
        self.socket, self.metrics, self.log = str(d / "tsord.sock"), str(d / "metrics.sock"), str(d / "tsord.log")
        cfg = d / "tsor.yaml"
        cfg.write_text(json.dumps({"node": "sec", "socket": self.socket, "metrics": f"unix:{self.metrics}"}))
        repo = str(HERE.parent.parent)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tsor.daemon", "--config", str(cfg)], cwd=repo,
                                         stdout=log, stderr=log, env=dict(os.environ, PYTHONPATH=repo))
        wait_for(lambda: os.path.exists(self.socket) or self.proc.poll() is not None, what="tsord's socket")
        assert self.proc.poll() is None, open(self.log).read()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            return int(next(ln for ln in f if ln.startswith("VmRSS:")).split()[1])

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def tsord(tmp_path):
    needs_root()
    t = Tsord(tmp_path)
    yield t
    t.stop()
