"""quark's payloads side by side on a node: one tree per payload under /opt/quark/versions, and the
links that make one of them current (deploy/install.py writes them).

Why not replace the files in place: a running shim or supervisor is a Python program that imports
some modules late (a verb's, a container's first exec's), and loads some libraries late (an
extension module's). Were the payload replaced file by file, such a process would mix the next
version's code into its own, and fail at some later moment, long after the upgrade. So a version's
tree is never changed once written, and goes only when no process maps a file of it.

    versions/ID/            a payload as deploy/payload.py builds it (ID: its PAYLOAD_ID file)
    current                 -> versions/ID, replaced by a rename: the switch new processes see
    lib, libexec, share     -> current/NAME
    bin/NAME                -> ../versions/ID/bin/NAME, one link and not through `current`: Python
                               finds its prefix by reading its executable's link once (not to the
                               end), so a program started as /opt/quark/bin/python3.11 (every
                               script's #!) gets versions/ID as its sys.prefix, and imports from
                               that tree for its whole life, whatever `current` says later

The payload's ELF files search $ORIGIN-relative directories (deploy/payload.py), so a late dlopen
finds its own version's libraries too; only the dynamic loader is named absolutely
(/opt/quark/lib/ld-linux-x86-64.so.2: an ELF interpreter must be), and it is read at exec only.
"""
from __future__ import annotations

import hashlib
import os
import stat

ID_FILE = "PAYLOAD_ID"
VERSIONS = "versions"
CURRENT = "current"
BIN = "bin"


def tree_digest(root: str) -> str:
    """sha256 of a tree's names, kinds, modes, link targets and contents (not times, not owners),
    ID_FILE left out."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel == ID_FILE:
                continue
            st = os.lstat(path)
            h.update(f"{rel}\0{stat.S_IFMT(st.st_mode):o}\0{stat.S_IMODE(st.st_mode):o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
            h.update(b"\0")
    return h.hexdigest()


def payload_id(root: str) -> str:
    """The payload's name among the versions: its ID_FILE (VERSION-DIGEST, written by
    deploy/payload.py), else `tree-DIGEST` of its files."""
    try:
        with open(os.path.join(root, ID_FILE)) as f:
            ident = f.read().strip()
    except FileNotFoundError:
        return "tree-" + tree_digest(root)[:12]
    if not ident or "/" in ident or ident.startswith("."):
        raise ValueError(f"{os.path.join(root, ID_FILE)}: not a payload id: {ident!r}")
    return ident


def users(tree: str, proc: str = "/proc") -> list[int]:
    """The pids of the processes that map a file of `tree` (an executable, a library, an extension
    module: every process a payload runs maps its Python at least). Matched by device and inode,
    which /proc/PID/maps gives whatever mount namespace the process or its file is in."""
    files = set()
    for dirpath, _, filenames in os.walk(tree):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    found = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "maps")) as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) < 6 or fields[4] == "0":
                        continue   # anonymous memory
                    major, minor = fields[3].split(":")
                    if (int(major, 16), int(minor, 16), int(fields[4])) in files:
                        found.append(int(name))
                        break
        except (OSError, ValueError):
            continue   # gone meanwhile, or a kernel thread
    return sorted(found)
