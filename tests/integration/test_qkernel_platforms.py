"""QKernel under real programs, on both platforms, through tests/progs/qkernel_harness.py — which
does what the supervisor does (install_filter before execve, Loop + Kernel, one reaper)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qkernel import table

pytestmark = pytest.mark.root

PROGS = Path(__file__).resolve().parent.parent / "progs"
HARNESS = [sys.executable, str(PROGS / "qkernel_harness.py")]
PLATFORMS = ("seccomp", "ptrace")
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.skip("needs root: loading filters without no_new_privs, ptrace, /proc/PID/mem")


def harness(platform: str, argv: list[str], *opts: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(HARNESS + ["--platform", platform, *opts, "--", *argv],
                          capture_output=True, text=True, timeout=timeout)


def counters(stderr: str) -> dict[str, int]:
    line = [ln for ln in stderr.splitlines() if ln.startswith("qkernel-harness:")][-1]
    return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def compile_c(tmp: Path, name: str, *flags: str) -> str:
    out = tmp / name
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", *flags, "-o", str(out), str(PROGS / f"{name}.c")],
                   check=True)
    return str(out)


@pytest.fixture(scope="module")
def progs(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("qkernel-progs")
    return {"stress": compile_c(tmp, "qkernel_stress"),
            "denied": compile_c(tmp, "qkernel_denied", "-static")}


# --- the base policy --------------------------------------------------------------------------

def parse_results(stdout: str) -> dict[str, int]:
    return {name: int(err) for name, err in (line.split() for line in stdout.splitlines())}


@pytest.fixture(scope="module")
def denied_results(progs) -> dict[str, dict[str, int]]:
    results = {}
    for platform in PLATFORMS:
        r = harness(platform, [progs["denied"]])
        assert r.returncode == 0, r.stderr
        results[platform] = parse_results(r.stdout)
    return results


@pytest.fixture(scope="module")
def runc_results(progs, tmp_path_factory) -> dict[str, int]:
    """The same program under runc: no seccomp profile, the host's full capability set, so each call
    reaches the kernel (bad fds, missing paths) instead of stopping at a capability check."""
    if not shutil.which("runc"):
        pytest.skip("runc is not installed")
    bundle = tmp_path_factory.mktemp("runc-bundle")
    (bundle / "rootfs").mkdir()
    shutil.copy(progs["denied"], bundle / "rootfs" / "denied")
    subprocess.run(["runc", "spec"], cwd=bundle, check=True)
    config = json.loads((bundle / "config.json").read_text())
    with open("/proc/self/status") as f:
        bounding = int(next(ln for ln in f if ln.startswith("CapBnd")).split()[1], 16)
    caps = [f"CAP_{name}" for bit, name in enumerate(CAP_NAMES) if bounding >> bit & 1]
    config["process"].update(args=["/denied"], terminal=False)
    config["process"]["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
    (bundle / "config.json").write_text(json.dumps(config))
    r = subprocess.run(["runc", "--root", str(bundle / "state"), "run", "-b", str(bundle),
                        f"qkernel-denied-{os.getpid()}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return parse_results(r.stdout)


CAP_NAMES = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
             "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
             "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
             "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
             "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
             "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE"]

# personality is trapped (its handler refuses non-default personas); the rest are denied in BPF.
POLICED = sorted(s.name for s in table.entries(table.Fate.DENIED)) + ["personality"]


def expected_errno(name: str) -> int:
    sc = table.by_name()[name]
    return sc.errno if sc.fate is table.Fate.DENIED else errno.EPERM


def test_denied_program_covers_the_table(denied_results):
    assert sorted(denied_results["seccomp"]) == sorted(POLICED)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", POLICED)
def test_denied_syscall_gets_documented_errno(denied_results, platform, name):
    assert denied_results[platform][name] == expected_errno(name), errno.errorcode.get(denied_results[platform][name])


@pytest.mark.parametrize("name", POLICED)
def test_denied_syscall_behaves_differently_under_runc(runc_results, name):
    assert runc_results[name] != expected_errno(name)


# --- handlers, identically on both platforms ---------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_sysinfo_reports_the_cgroup_limit(progs, platform):
    r = harness(platform, [progs["stress"], "sysinfo"], "--memory-limit", str(256 * MiB),
                "--memory-usage", str(10 * MiB))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["totalram", str(256 * MiB), "mem_unit", "1"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_only_the_ksm_opt_ins_of_madvise_and_prctl_are_refused(platform):
    # the rules match one value of a C int: other advice and options work, and high bits do not
    # smuggle MADV_MERGEABLE past the filter (the kernel reads only the low 32)
    code = ("import ctypes, mmap; libc = ctypes.CDLL(None, use_errno=True); m = mmap.mmap(-1, 4096);"
            "addr = ctypes.addressof(ctypes.c_char.from_buffer(m));"
            "sc = lambda *a: (libc.syscall(*map(ctypes.c_long, a)), ctypes.get_errno());"
            "print(sc(28, addr, 4096, 4)[0], sc(157, 15, ctypes.addressof(ctypes.create_string_buffer(b'q')))[0],"
            "     sc(28, addr, 4096, 12 | 1 << 32)[1], sc(28, addr, 4096, 12)[1], sc(157, 67, 0)[1])")
    r = harness(platform, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    # MADV_DONTNEED 0, PR_SET_NAME 0; MADV_MERGEABLE with high bits, MADV_MERGEABLE, PR_SET_MEMORY_MERGE: EINVAL
    assert r.stdout.split() == ["0", "0"] + [str(errno.EINVAL)] * 3


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sockets_pass_through(platform):
    code = ("import socket; s = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection(s.getsockname());"
            "a, peer = s.accept(); c.sendall(b'ping'); assert a.recv(4) == b'ping';"
            "assert c.getpeername() == s.getsockname() and a.getpeername() == c.getsockname();"
            "c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536);"
            "print(c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)); c.shutdown(socket.SHUT_RDWR)")
    r = harness(platform, [sys.executable, "-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "131072"   # Linux doubles SO_SNDBUF


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_failing_socket_handler_falls_back_to_the_native_call(platform):
    """A bug in a socket handler must not break the application's connect (it used to get ENOSYS):
    the call runs natively, and the log names the handler and shows the traceback."""
    code = ("import socket; s = socket.create_server(('127.0.0.1', 0)); c = socket.socket();"
            "c.connect(s.getsockname()); a, _ = s.accept(); c.sendall(b'ping'); print(a.recv(4).decode())")
    r = harness(platform, [sys.executable, "-c", code], "--fail", "connect", "--fail", "getsockname")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ping"
    assert "handler for connect from pid" in r.stderr and "the call runs natively" in r.stderr
    assert "Traceback" in r.stderr and "RuntimeError: injected failure in the connect handler" in r.stderr


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_failing_policy_handler_still_fails_closed(platform):
    """personality enforces policy: a failing handler must not let the call through natively."""
    code = "import ctypes, sys; r = ctypes.CDLL(None, use_errno=True).personality(0x0400000); print(r, ctypes.get_errno())"
    r = harness(platform, [sys.executable, "-c", code], "--fail", "personality")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["-1", str(errno.ENOSYS)]
    assert "handler for personality from pid" in r.stderr and "fails with ENOSYS" in r.stderr


@pytest.mark.parametrize("platform", PLATFORMS)
def test_bundle_filter_is_stacked_and_stricter_wins(platform, tmp_path):
    profile = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["getsockopt"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EACCES},   # stricter than trap
        {"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EINVAL},          # both deny
        {"names": ["mkdirat", "mkdir"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EROFS}]}
    path = tmp_path / "seccomp.json"
    path.write_text(json.dumps(profile))
    code = ("import ctypes, os, socket; libc = ctypes.CDLL(None, use_errno=True)\n"
            "def err(f):\n try: f(); return 0\n except OSError as e: return e.errno\n"
            "print(err(lambda: socket.socket().getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)),"
            " libc.syscall(321, 0, 0, 0) and ctypes.get_errno(), err(lambda: os.mkdir('/tmp/x')),"
            " err(lambda: socket.socket().getsockname()))")
    r = harness(platform, [sys.executable, "-c", code], "--seccomp-json", str(path))
    assert r.returncode == 0, r.stderr
    # ERRNO beats USER_NOTIF/TRACE; of two ERRNO answers the kernel keeps the newest filter's
    # (the bundle's); the bundle alone decides mkdir; getsockname still traps (and runs natively).
    assert r.stdout.split() == [str(errno.EACCES), str(errno.EINVAL), str(errno.EROFS), "0"]


# --- real process behaviour -------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_many_threads_trapping_at_once(progs, platform):
    r = harness(platform, [progs["stress"], "threads", "32", "200"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failures 0" in r.stdout


@pytest.mark.parametrize("platform", PLATFORMS)
def test_fork_vfork_clone3_exec_inherit_the_filter(progs, platform):
    r = harness(platform, [progs["stress"], "fork-exec", progs["stress"]], "--memory-limit", str(256 * MiB))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(f"totalram {256 * MiB}") == 3   # fork, vfork, fork-after-clone3 children


@pytest.mark.parametrize("platform", PLATFORMS)
def test_signal_interrupts_a_blocking_trapped_call(progs, platform):
    r = harness(platform, [progs["stress"], "eintr"], "--delay", "getsockopt=5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert counters(r.stderr) == {"deferred": 1, "completed": 0, "cancelled": 1}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sa_restart_restarts_a_blocking_trapped_call(progs, platform):
    r = harness(platform, [progs["stress"], "restart"], "--delay", "getsockopt=0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    # the first notification is abandoned by the signal; the restarted call traps again and completes
    assert counters(r.stderr) == {"deferred": 2, "completed": 1, "cancelled": 1}


@pytest.mark.parametrize("platform", PLATFORMS)
def test_exit_with_a_pending_notification(progs, platform):
    r = harness(platform, [progs["stress"], "exit-pending"], "--delay", "getsockopt=1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert counters(r.stderr) == {"deferred": 1, "completed": 0, "cancelled": 1}
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_blocked_call_does_not_stall_other_threads(progs, platform):
    r = harness(platform, [progs["stress"], "other-threads"], "--delay", "getsockopt=1")
    assert r.returncode == 0, r.stdout + r.stderr


# --- real programs, unmodified ----------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_busybox_sh(platform):
    busybox = shutil.which("busybox") or pytest.skip("busybox is not installed")
    r = harness(platform, [busybox, "sh", "-c", "for i in 1 2 3; do echo $i; done | busybox wc -l; "
                           "busybox grep Seccomp_filters /proc/self/status; exit 7"])
    assert r.returncode == 7, r.stderr
    assert r.stdout.split() == ["3", "Seccomp_filters:", "1"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_python3_c(platform):
    r = harness(platform, ["/usr/bin/python3", "-c", "import os, threading, subprocess;"
                           "ts = [threading.Thread(target=os.cpu_count) for _ in range(8)]; [t.start() for t in ts];"
                           "[t.join() for t in ts]; print(subprocess.check_output(['echo', 'ok']).decode().strip(),"
                           "os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE'))"],
                "--memory-limit", str(256 * MiB))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", str(256 * MiB)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_redis_server(platform, tmp_path):
    server = shutil.which("redis-server") or pytest.skip("redis-server is not installed")
    cli = shutil.which("redis-cli") or pytest.skip("redis-cli is not installed")
    port = free_port()
    p = subprocess.Popen(HARNESS + ["--platform", platform, "--", server, "--port", str(port), "--save", "",
                                    "--appendonly", "no", "--dir", str(tmp_path), "--daemonize", "no"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
            assert p.poll() is None and time.monotonic() < deadline, "redis-server did not come up"
            time.sleep(0.1)
        assert subprocess.run([cli, "-p", str(port), "set", "k", "quark"], capture_output=True, text=True).stdout.strip() == "OK"
        assert subprocess.run([cli, "-p", str(port), "get", "k"], capture_output=True, text=True).stdout.strip() == "quark"
        subprocess.run([cli, "-p", str(port), "shutdown", "nosave"], capture_output=True)
        p.wait(timeout=20)
        assert p.returncode == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)   # the harness (by pid); EXITKILL/its exit takes redis down too
            p.wait()


# --- inside a real container ------------------------------------------------------------------

@pytest.mark.parametrize("platform", PLATFORMS)
def test_sysinfo_in_a_container_with_256mib_limit(quark, bundle, platform, tmp_path):
    # (busybox `free` would do, but it subtracts the host's /proc/meminfo cache and prints garbage)
    from tests.integration.conftest import edit_config
    b = bundle(["/bin/qkernel_stress", "sysinfo"])
    subprocess.run(["gcc", "-static", "-O2", "-pthread", "-o", os.path.join(b, "rootfs", "bin", "qkernel_stress"),
                    str(PROGS / "qkernel_stress.c")], check=True)
    edit_config(b, lambda spec: spec["linux"].setdefault("resources", {}).update(memory={"limit": 256 * MiB}))
    r = quark("--platform", platform, "run", "-b", b, f"sysinfo-{platform}", check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["totalram", str(256 * MiB), "mem_unit", "1"]
