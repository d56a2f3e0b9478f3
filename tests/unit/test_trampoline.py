"""The sealed exec trampoline (qvisor/trampoline.py): runs only what quark hands it, cannot be changed."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from qvisor import trampoline


def _run_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Fork; the child execs the trampoline with `argv` (argv[0] included); its status and output."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(w, 1)
        fd = trampoline.sealed_memfd()
        try:
            os.execve(fd, argv, env or {"PATH": "/usr/bin:/bin"})
        finally:
            os._exit(99)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def test_runs_the_program_with_its_argv_and_environment():
    code, out = _run_child([trampoline.MARKER, "/bin/sh", "sh", "-c", 'echo "$0 $1 $FOO"', "a0", "a1"],
                           {"FOO": "bar"})
    assert (code, out) == (0, b"a0 a1 bar\n")


def test_refuses_to_run_without_the_marker():
    # what `#!/proc/self/exe` makes the kernel do: the trampoline as an interpreter
    assert _run_child(["/proc/self/exe", "/bin/echo", "echo", "no"]) == (trampoline.REFUSED, b"")
    assert _run_child([trampoline.MARKER]) == (trampoline.REFUSED, b"")


def test_a_program_that_cannot_be_executed_is_127():
    assert _run_child([trampoline.MARKER, "/nonexistent", "x"]) == (trampoline.EXEC_FAILED, b"")


def test_the_memfd_is_sealed_against_changes():
    fd = trampoline.sealed_memfd()
    try:
        with pytest.raises(OSError) as e:
            os.write(fd, b"\x90")
        assert e.value.errno == errno.EPERM
        with pytest.raises(OSError):
            os.truncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        assert os.read(fd, 4096) == trampoline.ELF
    finally:
        os.close(fd)


def test_resolve_follows_path_like_execvpe(tmp_path):
    prog = tmp_path / "prog"
    prog.write_text("#!/bin/sh\n")
    noexec = tmp_path / "noexec"
    noexec.write_text("")
    prog.chmod(0o755)
    env = {"PATH": f"/nonexistent:{tmp_path}"}
    assert trampoline.resolve("prog", env) == str(prog)
    assert trampoline.resolve("/bin/sh", env) == "/bin/sh"
    with pytest.raises(FileNotFoundError):
        trampoline.resolve("missing", env)
    if os.geteuid() != 0:   # root passes access(X_OK) checks only if some x bit is set, as here
        with pytest.raises(PermissionError):
            trampoline.resolve("noexec", env)


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="the trampoline is x86_64 code")
def test_embedded_binary_matches_its_source(tmp_path):
    """`make trampoline` must reproduce the embedded bytes from qvisor/trampoline.S."""
    src = os.path.join(os.path.dirname(trampoline.__file__), "trampoline.S")
    out = tmp_path / "t"
    r = subprocess.run(["gcc", "-nostdlib", "-static", "-Wl,--build-id=none", "-Wl,-n", "-s", "-o", str(out), src],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"gcc cannot build it here: {r.stderr.strip()[:200]}")
    assert out.read_bytes() == trampoline.ELF
