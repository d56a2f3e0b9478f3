"""The shim's one way to act on containers: quark's container operations.

`create` and `exec` run the `quark` CLI, the way containerd drives runc: they fork the sandbox's
processes, which must not happen from the shim's multithreaded process, and their stdio are the
container's, so their errors are read from a JSON log file. Every other verb (start, state, kill,
delete, pause, resume, ps, wait) only talks to the supervisor's control socket, the state file
and the cgroup, so it is called in-process (`qvisor.container`): a CLI process costs ~40 ms of
interpreter start-up per call. Failures become RpcErrors with the status code containerd expects
(NotFound, AlreadyExists, FailedPrecondition, ...): by exception type in-process, classified
from the message for the CLI.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from google.protobuf import timestamp_pb2

from shim.ttrpc import Code, RpcError


@dataclass
class Exit:
    """How a process ended, as `quark wait` reports it."""
    pid: int
    status: int
    exited_at: timestamp_pb2.Timestamp


@dataclass
class Stdio:
    """The three fds a process gets (the CLI process passes them on to the container)."""
    stdin: int
    stdout: int
    stderr: int


def parse_rfc3339(text: str) -> timestamp_pb2.Timestamp:
    """RFC 3339 with up to nanosecond precision (Python's datetime stops at microseconds)."""
    ts = timestamp_pb2.Timestamp()
    ts.FromJsonString(text)
    return ts


def now() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(time.time_ns())
    return ts


def read_pid(path: str) -> int:
    """The pid quark wrote to a --pid-file."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError) as e:
        raise RpcError(Code.UNKNOWN, f"cannot read the pid file {path}: {e}") from None


def find_quark() -> str:
    """The `quark` installed beside this Python (the package's venv), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "quark")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("quark")
    if not found:
        raise RpcError(Code.FAILED_PRECONDITION, f"quark executable not found beside {sys.executable} nor on PATH")
    return found


def classify(message: str) -> Code:
    """quark's CLI reports errors as text; map them to the status codes containerd understands."""
    m = message.lower()
    if "does not exist" in m or "not found" in m or "no such" in m:
        return Code.NOT_FOUND
    if "already exists" in m:
        return Code.ALREADY_EXISTS
    if "invalid" in m or "malformed" in m or "usage:" in m:
        return Code.INVALID_ARGUMENT
    if ("status" in m or "not running" in m or "not paused" in m or "not created" in m
            or "cannot" in m or "not allowed" in m):
        return Code.FAILED_PRECONDITION
    return Code.UNKNOWN


@contextmanager
def _quark_errors(verb: str) -> Iterator[None]:
    """quark's exceptions as the status codes containerd understands."""
    from qvisor import errors as E
    try:
        yield
    except E.ContainerNotFound as e:
        raise RpcError(Code.NOT_FOUND, f"quark {verb}: {e}") from None
    except E.ContainerExists as e:
        raise RpcError(Code.ALREADY_EXISTS, f"quark {verb}: {e}") from None
    except (E.InvalidState, E.Unsupported) as e:
        raise RpcError(Code.FAILED_PRECONDITION, f"quark {verb}: {e}") from None
    except E.ConfigError as e:
        raise RpcError(Code.INVALID_ARGUMENT, f"quark {verb}: {e}") from None
    except E.QuarkError as e:
        raise RpcError(classify(str(e)), f"quark {verb}: {e}") from None
    except OSError as e:
        raise RpcError(Code.UNKNOWN, f"quark {verb}: {e}") from None


class Quark:
    """quark for one --root: the CLI for create and exec, qvisor.container for the rest."""

    def __init__(self, root: str, binary: str | None = None, log_dir: str | None = None) -> None:
        self.root = root
        self.binary = binary or find_quark()
        self.log_dir = log_dir

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", self.root, *args]

    def _run(self, *args: str, stdin: bytes | None = None) -> str:
        proc = subprocess.run(self._argv(*args), input=stdin, capture_output=True, close_fds=True)
        if proc.returncode != 0:
            msg = proc.stderr.decode(errors="replace").strip() or f"exit status {proc.returncode}"
            msg = msg.removeprefix("quark: ")
            raise RpcError(classify(msg), f"quark {args[0]}: {msg}")
        return proc.stdout.decode(errors="replace")

    def _run_with_stdio(self, args: list[str], stdio: Stdio, log_path: str) -> None:
        """Run a verb whose stdio belong to the container; its errors go to a JSON log file."""
        argv = self._argv("--log", log_path, "--log-format", "json", *args)
        proc = subprocess.run(argv, stdin=stdio.stdin, stdout=stdio.stdout, stderr=stdio.stderr, close_fds=True)
        if proc.returncode != 0:
            msg = _last_error(log_path) or f"exit status {proc.returncode}"
            raise RpcError(classify(msg), f"quark {args[0]}: {msg}")

    def create(self, cid: str, bundle: str, pid_file: str, stdio: Stdio, console_socket: str | None) -> None:
        args = ["create", "--bundle", bundle, "--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        self._run_with_stdio([*args, cid], stdio, os.path.join(bundle, "quark-log.json"))

    def exec(self, cid: str, process_json: str, pid_file: str, stdio: Stdio,
             console_socket: str | None, log_path: str) -> None:
        args = ["exec", "--process", process_json, "--pid-file", pid_file, "-d"]
        if console_socket:
            args += ["--console-socket", console_socket]
        self._run_with_stdio([*args, cid], stdio, log_path)

    def _in_process(self, verb: str, operation: str, *args):
        """qvisor.container.<operation>(root, *args), its errors as RpcErrors."""
        from qvisor import container
        with _quark_errors(verb):
            return getattr(container, operation)(self.root, *args)

    def start(self, cid: str) -> None:
        self._in_process("start", "start", cid)

    def state(self, cid: str) -> dict:
        return self._in_process("state", "state", cid).oci()

    def kill(self, cid: str, signal: int, all_processes: bool = False) -> None:
        self._in_process("kill", "kill", cid, signal, all_processes)

    def delete(self, cid: str, force: bool = False) -> None:
        self._in_process("delete", "delete", cid, force)

    def pause(self, cid: str) -> None:
        self._in_process("pause", "pause", cid)

    def resume(self, cid: str) -> None:
        self._in_process("resume", "resume", cid)

    def ps(self, cid: str) -> list[int]:
        return [int(p) for p in self._in_process("ps", "pids", cid)]

    def update(self, cid: str, resources_json: bytes) -> None:
        with tempfile.NamedTemporaryFile(prefix="quark-resources-", suffix=".json") as f:
            f.write(resources_json)
            f.flush()
            self._run("update", "--resources", f.name, cid)

    def stats(self, cid: str) -> dict:
        out = self._run("events", "--stats", cid)
        line = next((ln for ln in out.splitlines() if ln.strip()), "")
        if not line:
            raise RpcError(Code.UNKNOWN, f"quark events --stats {cid}: no output")
        return json.loads(line).get("data", {})

    def wait(self, cid: str, pid: int | None = None) -> Exit:
        """Block until the container's init (or the exec'd process `pid`) exits."""
        doc = self._in_process("wait", "wait", cid, pid or 0)
        return Exit(pid=int(doc["pid"]), status=int(doc["exit_status"]),
                    exited_at=parse_rfc3339(doc["exited_at"]))


def _last_error(log_path: str) -> str:
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "fatal"):
            return str(entry.get("msg", ""))
    return ""
