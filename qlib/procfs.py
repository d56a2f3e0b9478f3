"""Parsers for the /proc files quark reads: /proc/PID/mountinfo, /proc/PID/status and
/proc/PID/fdinfo/FD. One parser each, so every reader unescapes and splits them the same way.

Each reader raises OSError (FileNotFoundError, ProcessLookupError, ...) when the file cannot be
read, e.g. because the process is gone; callers decide what a vanished process means to them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

Pid = int | str   # a pid, or "self" / "thread-self"


@dataclass(frozen=True)
class Mount:
    """One line of /proc/PID/mountinfo (proc(5)), its path fields unescaped."""
    mount_id: int
    parent_id: int
    dev: str                 # "major:minor"
    root: str                # the directory of the filesystem mounted here
    mount_point: str         # relative to the reader's root
    options: str             # per-mount options (ro, nosuid, ...)
    optional: tuple[str, ...]  # shared:N, master:N, propagate_from:N, unbindable
    fstype: str
    source: str
    super_options: str       # per-superblock options (for cgroup v1: its controllers)

    @property
    def shared(self) -> bool:
        return any(f.startswith("shared:") for f in self.optional)


_ESCAPE = re.compile(rb"\\([0-7]{3})")


def unescape(field: bytes | str) -> str:
    """Undo the kernel's \\ooo octal escapes (of space, tab, newline, backslash and '#') in a
    mountinfo field. Works on the bytes, then decodes as the filesystem encoding (surrogateescape)
    so a path that is not UTF-8 survives and os functions get the same bytes back."""
    raw = os.fsencode(field) if isinstance(field, str) else field
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), raw))


def parse_mountinfo(data: bytes | str) -> list[Mount]:
    """Every mount in the text of a mountinfo file, in the file's order (parents before children)."""
    raw = os.fsencode(data) if isinstance(data, str) else data
    mounts = []
    for line in raw.splitlines():
        fields = line.split(b" ")
        if len(fields) < 10:
            continue
        # a variable number of optional fields ends with a lone "-"
        sep = fields.index(b"-", 6)
        fstype, source, super_options = fields[sep + 1:sep + 4]
        mounts.append(Mount(int(fields[0]), int(fields[1]), fields[2].decode(), unescape(fields[3]),
                            unescape(fields[4]), fields[5].decode(), tuple(f.decode() for f in fields[6:sep]),
                            unescape(fstype), unescape(source), unescape(super_options)))
    return mounts


def mountinfo(pid: Pid = "self") -> list[Mount]:
    """The mounts /proc/PID/mountinfo lists."""
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        return parse_mountinfo(f.read())


def mount_tree(pid: Pid = "self") -> dict[int, tuple[int, str]]:
    """mount id -> (parent id, mount point) of every mount: the three fields of mountinfo a check
    of where a mount sits needs, read several times faster than mountinfo() parses every field."""
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        return parse_mount_tree(f.read())


def parse_mount_tree(data: bytes) -> dict[int, tuple[int, str]]:
    tree = {}
    for line in data.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) > 5:
            point = fields[4]
            tree[int(fields[0])] = (int(fields[1]), unescape(point) if b"\\" in point else point.decode())
    return tree


def parse_keyed(data: str) -> dict[str, str]:
    """The "Key:<tab>value" lines of /proc/PID/status or /proc/PID/fdinfo/FD (values stripped)."""
    out = {}
    for line in data.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def status(pid: Pid = "self") -> dict[str, str]:
    """/proc/PID/status as {key: value}, e.g. status(pid)["PPid"] == "1"."""
    with open(f"/proc/{pid}/status", "rb") as f:
        # Name: is the task's comm, which the task chooses: never let its bytes fail the decode
        return parse_keyed(f.read().decode(errors="surrogateescape"))


def fdinfo(fd: int | str, pid: Pid = "self") -> dict[str, str]:
    """/proc/PID/fdinfo/FD as {key: value}; keys that repeat (an epoll set's tfd: lines) keep
    their last value: use fdinfo_lines() for those."""
    return parse_keyed("\n".join(fdinfo_lines(fd, pid)))


def fdinfo_lines(fd: int | str, pid: Pid = "self") -> list[str]:
    """The lines of /proc/PID/fdinfo/FD."""
    return read_small(f"/proc/{pid}/fdinfo/{fd}").decode(errors="surrogateescape").splitlines()


def read_small(path: str) -> bytes:
    """A /proc file's bytes with open, read and close alone: a buffered open() adds an fstat, an
    ioctl and two lseeks, which TSoR's per-connection reads (an fd's flags) pay on every connect."""
    f = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(f, 65536):   # a /proc file may give less than asked before its end
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(f)


def smaps_rollup(pid: Pid) -> dict[str, int]:
    """/proc/PID/smaps_rollup's sizes in KiB ({"Rss": ..., "Pss": ..., "Shared_Dirty": ...})."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.endswith("kB\n")}


def parent_pid(pid: Pid) -> int | None:
    """The PPid of `pid`, or None if it is gone."""
    try:
        return int(status(pid)["PPid"])
    except (OSError, KeyError, ValueError):
        return None


# runc-compatible process managers that reap a container's init themselves, as they do runc's:
# containerd's runc shim (quark as its BinaryName) and conmon. Their child subreaper takes the init.
RUNC_MANAGERS = ("containerd-shim-runc", "conmon")


def exe_name(pid: Pid) -> str | None:
    """The file name of the program `pid` runs (None: gone, or not ours to read)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None


def start_time(pid: Pid) -> int | None:
    """Field 22 of /proc/PID/stat: tells a live pid from a reused one. None if the pid is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    fields = data[data.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def permitted_caps(pid: Pid = "self") -> int:
    """The permitted capability set of `pid`, as a mask (capset may not add to it)."""
    return int(status(pid).get("CapPrm", "0"), 16)


def tcp_listeners(pid: Pid) -> list[tuple[int, int]]:
    """(port, socket inode) of every TCP socket listening in `pid`'s network namespace
    (/proc/PID/net/tcp and tcp6, state 0A)."""
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A":
                        found.append((int(cols[1].rsplit(":", 1)[1], 16), int(cols[9])))
        except FileNotFoundError:
            pass
    return found
