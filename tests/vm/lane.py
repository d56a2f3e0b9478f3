"""The cgroup v2 test lane: pytest inside a qemu guest that boots Debian 12's own 6.1 kernel on a
real cgroup v2 (unified) hierarchy, for hosts that are cgroup v1 and cannot switch.

    python -m tests.vm.lane [--timeout S] [--memory MiB] [--smp N] [--prepare] [--] [PYTEST ARGS]

(`make test-cgroup2 ARGS="..."` runs it after installing qemu.) The guest sees the host's whole
filesystem read-only over 9p (virtio-9p), with a tmpfs overlay for its writes, so this checkout,
its venv and /usr/bin/python3 are at the same paths inside; a second 9p share, a temporary
directory of the host, carries run.sh (cd to the checkout, run pytest) in and pytest's output and
exit status out. A scratch disk (/dev/vda, qemu's null driver) gives tests a block device. No
network device: loopback only. qemu runs under TCG (software emulation):
this host's /dev/kvm cannot run guests. The console streams to stdout; at the end the lane prints
pytest's summary line and its times, and exits with pytest's status (124 on a timeout, 1 when the
guest never reported one).

PYTEST ARGS default to DEFAULT_TESTS below; given, they replace it (`-q -ra -p no:cacheprovider
--timeout=600` are always passed first). --prepare only fetches the kernel and builds the initramfs (make vm-deps).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.vm.initramfs import ensure_initramfs
from tests.vm.kernel import Kernel, LaneError, cache_lock, ensure_kernel

PROJECT = Path(__file__).resolve().parents[2]
QEMU = "qemu-system-x86_64"
# what cgroup v2 (and the guest's 6.1 kernel) changes: v2-only tests, and the version-neutral tests of
# cgroups, device programs, events/OOM, the /proc view, the caller-reaps fallback and the sandbox
# factory (it joins the caller's v2 cgroup; PR_SET_MM_MAP on 6.1), pidfds of threads (no PIDFD_THREAD
# before 6.9)
_FACTORY = "tests/integration/test_factory.py::"
DEFAULT_TESTS = ["tests/cgroup2", "tests/integration/test_cgroups.py", "tests/integration/test_cgroup2_devices.py",
                 "tests/integration/test_events.py", "tests/integration/test_caller_reaps.py",
                 "tests/integration/test_procview.py", "tests/unit/test_seccomp_platform.py",
                 "tests/unit/test_sockopt_offload.py", "tests/unit/test_libbpf.py", "tests/unit/test_linux_pidfd.py",
                 _FACTORY + "test_the_worker_takes_on_the_callers_cwd_env_umask_rlimits_and_cgroup",
                 _FACTORY + "test_a_create_runs_in_a_worker_and_its_supervisor_shares_the_factorys_pages",
                 "tests/integration/test_config.py::test_cgroup_resources_and_path"]
# --timeout (pytest-timeout, per test): the emulated CPU runs container tests 5-20x slower than the
# host, so pyproject's 120 s would fail slow tests that pass (a later --timeout in ARGS wins)
# the RDMA lane's tests: everything that takes a real verbs device; RDMA_SMOKE, what `make test` runs
# of it on every landing: the provider on the device, the ring protocol's tests on it (both pumps), and
# two tsords carrying streams over it
RDMA_TESTS = ["-m", "rdma_device", "tests"]
RDMA_SMOKE = ["-m", "rdma_device", "tests/unit/test_pyverbs_provider.py", "tests/unit/test_rdma_ring.py",
              "tests/unit/test_rdma_pump_listener.py",
              *(f"tests/integration/test_tsor_rdma.py::test_streams_arrive_intact[rdma-{n}]"
                for n in (1, 65537, 64 << 20))]   # tsord's default: the compiled pump
PYTEST_FIXED = ["-q", "-ra", "-p", "no:cacheprovider", "--timeout=600"]
# quiet: only the guest's own output on the console; panic=-1 with qemu's -no-reboot turns a
# guest that dies into a qemu that exits; cgroup_no_v1=all: no controller can go to a v1 mount
CMDLINE = ("console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init cgroup_no_v1=all "
           "mitigations=off random.trust_cpu=on")
SCRATCH_BYTES = 1 << 30
BOOTED = re.compile(rb"quark-vm: \S+ up in ")   # the guest's line just before it runs run.sh
SUMMARY = re.compile(r"^=*\s*((\d+ \w+|no tests ran)[^=]* in [\d.]+s( \([\d:]+\))?)\s*=*$")


def prepare(suite: str = "bookworm") -> tuple[Kernel, Path]:
    if shutil.which(QEMU) is None:
        raise LaneError(f"{QEMU} is not installed: run `make vm-deps` (apt-get install qemu-system-x86)")
    kernel = ensure_kernel(suite)
    with cache_lock():
        return kernel, ensure_initramfs(kernel)


# The RDMA lane (--rdma): a soft-RoCE device, the kernel's own RoCE v2 (rdma_rxe), on a veth end in
# the guest's root netns. 6.1's rxe resolves routes in the initial netns: a device whose netdev sits
# in another netns fails its sends, and two on one subnet fail at RTR, so every test's "nodes" (netns
# with their tsords) share this one device, whose QPs rxe loops back to each other. rdma_rxe and
# ib_uverbs are loaded by name: busybox's modprobe does not follow the module aliases `rdma link add`
# asks for; iproute2's ip and rdma by path, as busybox's sh runs its own applet for a bare `ip`. The
# tests take the first device the kernel lists: this one.
RDMA_DEVICE = "rxe0"
RDMA_ADDR = "10.211.0.1/24"
RDMA_SETUP = f"""set -e
/.quark-vm/modprobe rdma_rxe
/.quark-vm/modprobe ib_uverbs
IP=/usr/sbin/ip
$IP link add qrv0 type veth peer name qrv1
$IP addr add {RDMA_ADDR} dev qrv0
$IP link set qrv0 up
$IP link set qrv1 up
/usr/bin/rdma link add {RDMA_DEVICE} type rxe netdev qrv0
/usr/bin/rdma link show {RDMA_DEVICE}/1
set +e
"""


# what a --command writes under $QUARK_VM_OUT comes back (lane --out DIR)
GUEST_OUT = "/.quark-vm/results/out"


def run_script(pytest_args: list[str], rdma: bool = False, command: str | None = None) -> str:
    """The guest's results/run.sh: this checkout, this venv's interpreter, no writes to it; with rdma,
    the soft-RoCE device first; with command, that shell command (a benchmark) instead of pytest."""
    argv = [sys.executable, "-m", "pytest", *PYTEST_FIXED, *(pytest_args or (RDMA_TESTS if rdma else DEFAULT_TESTS))]
    if command is not None:
        argv = ["sh", "-c", command]
    out = f"mkdir -p {GUEST_OUT}\n" if command is not None else ""
    env = f" QUARK_VM_OUT={GUEST_OUT}" if command is not None else ""
    return ((RDMA_SETUP if rdma else "") + f"cd {shlex.quote(str(PROJECT))} || exit 4\n" + out
            + f"exec env PYTHONDONTWRITEBYTECODE=1{env} {shlex.join(argv)}\n")


def qemu_argv(kernel: Kernel, initramfs: Path, results: Path, memory: int, smp: int,
              extra: tuple[str, ...] = ()) -> list[str]:
    """`extra`: more of qemu's arguments (tests/vm/pair.py: a network device, one more share)."""
    share = share_argv
    return [QEMU, "-name", "quark-vm", "-no-user-config", "-nodefaults",
            "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(smp), "-m", str(memory),
            # qboot, not SeaBIOS: boots -kernel faster and writes no terminal-reset escapes to
            # the serial console (that is, to the caller's terminal)
            "-bios", "qboot.rom", "-nographic", "-serial", "stdio", "-monitor", "none", "-no-reboot", "-nic", "none",
            "-kernel", str(kernel.vmlinuz), "-initrd", str(initramfs), "-append", CMDLINE,
            *share("hostroot", "/", "readonly=on"), *share("results", str(results)),
            # a scratch disk, /dev/vda in the guest, for tests that need a block device (io.max):
            # qemu's null driver, so no image file; it reads zeros and drops writes
            "-blockdev", f"driver=null-co,node-name=scratch,size={SCRATCH_BYTES},read-zeroes=on",
            "-device", "virtio-blk-pci,drive=scratch", *extra]


def share_argv(tag: str, path: str, *opts: str) -> list[str]:
    """A 9p share of the host's `path`, mounted in the guest by its `tag`."""
    # multidevs=remap: the host's / spans several filesystems; keep inode numbers unique
    return ["-fsdev", ",".join(["local", f"id={tag}", f"path={path}", "security_model=none", "multidevs=remap", *opts]),
            "-device", f"virtio-9p-pci,fsdev={tag},mount_tag={tag}"]


class Console:
    """Copies qemu's serial output to stdout as it comes (each line after `prefix`: two guests'
    consoles on one terminal), and notes when the guest is up."""

    def __init__(self, stream, prefix: bytes = b"") -> None:
        self.stream = stream
        self.prefix = prefix
        self.booted_at: float | None = None
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        tail = pending = b""
        while chunk := self.stream.read1(4096):
            text = chunk.replace(b"\r", b"")
            if self.prefix:   # whole lines only, each after the prefix
                pending += text
                text, _, pending = pending.rpartition(b"\n")
                text = b"".join(self.prefix + line + b"\n" for line in text.split(b"\n")) if text or _ else b""
            sys.stdout.buffer.write(text)
            sys.stdout.flush()
            tail = (tail + chunk)[-256:]
            if self.booted_at is None and BOOTED.search(tail):
                self.booted_at = time.monotonic()
        if pending:
            sys.stdout.buffer.write(self.prefix + pending + b"\n")
            sys.stdout.flush()


def _stop(qemu: subprocess.Popen) -> None:
    if qemu.poll() is None:
        qemu.kill()   # the process we started, by its pid
    qemu.wait()


def guest_status(results: Path, qemu: subprocess.Popen) -> tuple[int, str]:
    """The exit status the guest's run.sh reported in its results share, or 1 and why there is none
    (the guest's own error, else qemu's exit)."""
    status_file = results / "status"
    if status_file.exists():
        return int(status_file.read_text().strip() or 1), ""
    err = results / "guest-error"
    return 1, err.read_text().strip() if err.exists() else f"qemu exited {qemu.returncode}"


def summary_line(output: str) -> str | None:
    for line in reversed(output.splitlines()):
        m = SUMMARY.match(line.strip())
        if m:
            return m.group(1)
    return None


def run(pytest_args: list[str], timeout: float, memory: int, smp: int, rdma: bool = False,
        command: str | None = None, out: Path | None = None) -> int:
    start = time.monotonic()
    kernel, initramfs = prepare()
    results = Path(tempfile.mkdtemp(prefix="quark-vm-"))
    (results / "run.sh").write_text(run_script(pytest_args, rdma, command))
    # paths under the guest's fresh /tmp and /run that must stay visible: the checkout, the venv
    keep = [str(PROJECT)] + ([sys.prefix] if not Path(sys.prefix).is_relative_to(PROJECT) else [])
    (results / "keep").write_text("".join(p + "\n" for p in keep))
    (results / "modules").write_text(f"{kernel.modules}\n")
    qemu = subprocess.Popen(qemu_argv(kernel, initramfs, results, memory, smp), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    launched = time.monotonic()
    console = Console(qemu.stdout)
    try:
        qemu.wait(timeout=max(1.0, timeout - (launched - start)))
    except subprocess.TimeoutExpired:
        _stop(qemu)
        console.thread.join(5)
        print(f"\nquark-vm: TIMEOUT: the guest ran past {timeout:.0f} s; killed qemu (pid {qemu.pid}). "
              f"Its files: {results}", flush=True)
        return 124
    except BaseException:   # ^C, or anything else here: never leave the guest running
        _stop(qemu)
        raise
    console.thread.join(5)
    total = time.monotonic() - start
    status, why = guest_status(results, qemu)
    if why:
        print(f"\nquark-vm: the guest reported no pytest status ({why}). Its files: {results}", flush=True)
        return 1
    output = (results / "output.log").read_text(errors="replace")
    if out is not None and (results / "out").is_dir():
        shutil.copytree(results / "out", out, dirs_exist_ok=True)
        print(f"quark-vm: the guest's $QUARK_VM_OUT copied to {out}", flush=True)
    boot = f"{console.booted_at - launched:.0f} s" if console.booted_at else "?"
    print(f"\n{'rdma' if rdma else 'cgroup2'} lane: {summary_line(output) or 'no pytest summary line'} | exit {status} | "
          f"lane {total:.0f} s (prepare {launched - start:.0f} s, boot to pytest {boot}, "
          f"kernel {kernel.version}, TCG)", flush=True)
    if status == 0:
        shutil.rmtree(results, ignore_errors=True)
    else:
        print(f"quark-vm: guest output and dmesg kept in {results}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.vm.lane", description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout", type=float, default=float(os.environ.get("QUARK_VM_TIMEOUT", "1800")),
                   help="seconds for the whole lane, boot included (default 1800, env QUARK_VM_TIMEOUT)")
    p.add_argument("--memory", type=int, default=2048, help="guest memory in MiB (default 2048)")
    p.add_argument("--smp", type=int, default=2, help="guest CPUs (default 2)")
    p.add_argument("--rdma", action="store_true",
                   help="make a soft-RoCE device (rxe) before pytest; default tests: -m rdma_device tests")
    p.add_argument("--smoke", action="store_true", help="with --rdma: only RDMA_SMOKE (what `make test` runs)")
    p.add_argument("--command", help="run this shell command in the checkout instead of pytest (a benchmark)")
    p.add_argument("--out", type=Path, help="copy what the command wrote under $QUARK_VM_OUT here")
    p.add_argument("--prepare", action="store_true", help="only fetch the kernel and build the initramfs")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    a = p.parse_args(argv)
    pytest_args = a.pytest_args[1:] if a.pytest_args[:1] == ["--"] else a.pytest_args
    # a lane told to stop (kill PID, a CI runner's time-out) stops its guest as ^C does: the
    # exception reaches run()'s handler, which kills the qemu it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if a.prepare:
            kernel, initramfs = prepare()
            print(f"quark-vm: ready: {kernel.vmlinuz}, {initramfs}")
            return 0
        if a.smoke and not pytest_args:
            pytest_args = RDMA_SMOKE
        return run(pytest_args, a.timeout, a.memory, a.smp, a.rdma, a.command, a.out)
    except (LaneError, OSError) as e:   # e.g. not root: /var/cache/quark-vm, qemu's 9p export of /
        print(f"quark-vm: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
