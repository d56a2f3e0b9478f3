"""The shim's one way to act on containers: quark's container operations.

`create` and `exec` run the `quark` CLI, the way containerd drives runc: they fork the sandbox's
processes, which must not happen from the shim's multithreaded process, and their stdio are the
container's, so their errors are read from a JSON log file. Every other verb (start, state, kill,
delete, pause, resume, ps, wait) only talks to the supervisor's control socket, the state file
and the cgroup, so it is called in-process (`qvisor.container`): a CLI process would cost an
interpreter's start and its imports per call (measured: bench/README.md, "Start-up and supervisor
memory"). Failures become RpcErrors with the status code containerd expects (NotFound,
AlreadyExists, FailedPrecondition, ...), chosen by the error's kind (qlib/errors.py): the
exception's in-process, the "kind" of the CLI's JSON log entry otherwise. Never by its wording.
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


# QuarkError.kind -> the status code containerd maps to its errdefs; other kinds are UNKNOWN
KIND_CODES = {
    "not_found": Code.NOT_FOUND,
    "already_exists": Code.ALREADY_EXISTS,
    "invalid_argument": Code.INVALID_ARGUMENT,
    "invalid_state": Code.FAILED_PRECONDITION,
    "unsupported": Code.FAILED_PRECONDITION,
}


def code_of(kind: object) -> Code:
    return KIND_CODES.get(kind, Code.UNKNOWN) if isinstance(kind, str) else Code.UNKNOWN


@contextmanager
def _quark_errors(verb: str) -> Iterator[None]:
    """quark's exceptions as the status codes containerd understands."""
    from qlib.errors import QuarkError
    try:
        yield
    except QuarkError as e:
        raise RpcError(code_of(e.kind), f"quark {verb}: {e}") from None
    except OSError as e:
        raise RpcError(Code.UNKNOWN, f"quark {verb}: {e}") from None


class Quark:
    """quark for one --root: the sandbox factory (else the CLI) for create, the CLI for exec,
    qvisor.container for the rest."""

    def __init__(self, root: str, binary: str | None = None, log_dir: str | None = None) -> None:
        self.root = root
        self.binary = binary or find_quark()
        self.log_dir = log_dir

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, "--root", self.root, *args]

    def _run(self, args: list[str], log_path: str, stdio: Stdio | None = None) -> None:
        """Run a verb with its errors in a JSON log file, read back with their kind. The stdio of
        create and exec belong to the container; the others' go nowhere."""
        argv = self._argv("--log", log_path, "--log-format", "json", *args)
        code = None
        if args[0] == "create" and stdio is not None:
            # in the sandbox factory (qvisor/factory/): no `quark` process per container, and a
            # supervisor that shares the factory's pages; None: it declined or runs none, so the CLI
            from qvisor.factory import client, wire
            if wire.enabled():
                with _quark_errors(args[0]):
                    code = client.request(argv[1:], (stdio.stdin, stdio.stdout, stdio.stderr))
        if code is None:
            fds = (subprocess.DEVNULL,) * 3 if stdio is None else (stdio.stdin, stdio.stdout, stdio.stderr)
            code = subprocess.run(argv, stdin=fds[0], stdout=fds[1], stderr=fds[2], close_fds=True).returncode
        if code != 0:
            msg, kind = _last_error(log_path)
            raise RpcError(code_of(kind), f"quark {args[0]}: {msg or f'exit status {code}'}")

    def create(self, cid: str, bundle: str, pid_file: str, stdio: Stdio, console_socket: str | None) -> None:
        args = ["create", "--bundle", bundle, "--pid-file", pid_file]
        if console_socket:
            args += ["--console-socket", console_socket]
        self._run([*args, cid], os.path.join(bundle, "quark-log.json"), stdio)

    def exec(self, cid: str, process_json: str, pid_file: str, stdio: Stdio,
             console_socket: str | None, log_path: str) -> None:
        args = ["exec", "--process", process_json, "--pid-file", pid_file, "-d"]
        if console_socket:
            args += ["--console-socket", console_socket]
        self._run([*args, cid], log_path, stdio)

    def _in_process(self, verb: str, operation: str, *args):
        """qvisor.container.<module>.<function>(root, *args) for `operation` "module.function", its
        errors as RpcErrors."""
        import importlib
        module, _, function = operation.partition(".")
        with _quark_errors(verb):
            return getattr(importlib.import_module(f"qvisor.container.{module}"), function)(self.root, *args)

    def start(self, cid: str) -> None:
        self._in_process("start", "start.start", cid)

    def state(self, cid: str) -> dict:
        return self._in_process("state", "common.state", cid).oci()

    def kill(self, cid: str, signal: int, all_processes: bool = False) -> None:
        self._in_process("kill", "kill.kill", cid, signal, all_processes)

    def kill_exec(self, cid: str, pid: int, signal: int) -> None:
        """Signal an exec'd process; NOT_FOUND once it has exited (its pid is never signalled then)."""
        self._in_process("kill", "kill.kill_exec", cid, pid, signal)

    def delete(self, cid: str, force: bool = False) -> None:
        self._in_process("delete", "delete.delete", cid, force)

    def pause(self, cid: str) -> None:
        self._in_process("pause", "pause.pause", cid)

    def resume(self, cid: str) -> None:
        self._in_process("resume", "resume.resume", cid)

    def ps(self, cid: str) -> list[int]:
        return [int(p) for p in self._in_process("ps", "ps.pids", cid)]

    def update(self, cid: str, resources_json: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="quark-update-") as d:
            resources = os.path.join(d, "resources.json")
            with open(resources, "wb") as f:
                f.write(resources_json)
            self._run(["update", "--resources", resources, cid], os.path.join(d, "log.json"))

    def stats(self, cid: str) -> dict:
        """The cgroup statistics in runc's `events --stats` data layout."""
        return self._in_process("stats", "events.stats", cid)

    def wait(self, cid: str, pid: int | None = None) -> Exit:
        """Block until the container's init (or the exec'd process `pid`) exits."""
        doc = self._in_process("wait", "wait.wait", cid, pid or 0)
        return Exit(pid=int(doc["pid"]), status=int(doc["exit_status"]),
                    exited_at=parse_rfc3339(doc["exited_at"]))


def _last_error(log_path: str) -> tuple[str, str]:
    """The message and kind of the last error in a JSON log quark wrote ("" for none)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "", ""
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal"):
            return str(entry.get("msg", "")), str(entry.get("kind", ""))
    return "", ""
