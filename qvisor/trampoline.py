"""The last execve into the container goes through a sealed in-memory trampoline (CVE-2019-5736).

quark's processes that enter a container are forks of the Python supervisor, so their
/proc/self/exe is the host's python. If they execve'd the container's program directly, a program
that is a script starting `#!/proc/self/exe` would make the kernel run *the runtime's own binary*
inside the container, where it could open that host file. Instead they execve a 424-byte static
trampoline held in a sealed memfd (no write, grow, shrink or chmod possible; not a host file),
which execve's the real program. The kernel then resolves `/proc/self/exe` to the sealed
trampoline, which refuses to run unless its argv[0] is the "quark-exec" marker that only quark
passes: the script fails with status 126 and nothing of the host is reachable.

Capabilities survive the extra execve unchanged: for root the kernel grants the bounding set on
every execve, for other users only ambient capabilities survive either execve, and the
inheritable set is kept, so two execves end where one would. Source: qvisor/trampoline.S
(`make trampoline` rebuilds it and prints the base64 below).
"""
from __future__ import annotations

import base64
import errno
import fcntl
import os

ELF = base64.b64decode("f0VMRgIBAQAAAAAAAAAAAAIAPgABAAAAeABAAAAAAABAAAAAAAAAAOgAAAAAAAAAAAAAAEAAOAABAEAAAwACAAEAAAAFAAAAeAAAAAAAAAB4AEAAAAAAAHgAQAAAAAAAWAAAAAAAAABYAAAAAAAAAAEAAAAAAAAASIsEJEiD+AN8QkiLXCQISLlxdWFyay1leEg7C3Uui0sIgeH///8AgfllYwAAdR1Ii3wkEEiNdCQYSI1UxBC4OwAAAA8Fv38AAADrBb9+AAAAuOcAAAAPBQAuc2hzdHJ0YWIALnRleHQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAALAAAAAQAAAAYAAAAAAAAAeABAAAAAAAB4AAAAAAAAAFgAAAAAAAAAAAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAQAAAAMAAAAAAAAAAAAAAAAAAAAAAAAA0AAAAAAAAAARAAAAAAAAAAAAAAAAAAAAAQAAAAAAAAAAAAAAAAAAAA==")
MARKER = "quark-exec"
REFUSED, EXEC_FAILED = 126, 127

_MFD_CLOEXEC, _MFD_ALLOW_SEALING, _MFD_EXEC = 0x1, 0x2, 0x10
_F_ADD_SEALS = 1033
_F_SEAL_SEAL, _F_SEAL_SHRINK, _F_SEAL_GROW, _F_SEAL_WRITE, _F_SEAL_EXEC = 0x1, 0x2, 0x4, 0x8, 0x20
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sealed_memfd() -> int:
    """A close-on-exec memfd holding the trampoline, sealed so nobody can change it."""
    try:
        fd = os.memfd_create("quark-exec", _MFD_CLOEXEC | _MFD_ALLOW_SEALING | _MFD_EXEC)
    except OSError as e:
        if e.errno != errno.EINVAL:   # kernels before 6.3 know no MFD_EXEC: executable by default
            raise
        fd = os.memfd_create("quark-exec", _MFD_CLOEXEC | _MFD_ALLOW_SEALING)
    try:
        os.write(fd, ELF)
        seals = _F_SEAL_SEAL | _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_WRITE
        try:
            fcntl.fcntl(fd, _F_ADD_SEALS, seals | _F_SEAL_EXEC)
        except OSError:   # F_SEAL_EXEC is 6.3+
            fcntl.fcntl(fd, _F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def resolve(program: str, env: dict[str, str]) -> str:
    """The file execvpe() would run: program itself if it has a slash, else the first executable
    match on the container's PATH. Raises FileNotFoundError/PermissionError as execvpe would."""
    if "/" in program:
        candidates = [program]
    else:
        candidates = [os.path.join(d or ".", program) for d in env.get("PATH", DEFAULT_PATH).split(":")]
    denied = None
    for path in candidates:
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return path
            denied = path
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), denied)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def execve(trampoline_fd: int, path: str, argv: list[str], env: dict[str, str]) -> None:
    """execve(path, argv, env) by way of the trampoline; does not return on success."""
    os.execve(trampoline_fd, [MARKER, path, *argv], env)
