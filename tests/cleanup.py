"""Removing the parent cgroups that quark (`/quark`, its default parent), containerd (`/<namespace>`)
and the tests (`/quark-*`) create for containers, once they are empty, and what a private containerd,
dockerd or podman left mounted under its tree: used by the test session and by the benchmarks,
which must leave the host as they found it."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"


def quark_cgroup_dirs(prefix: str = "quark") -> set[str]:
    """Top-level cgroup directories named quark* (or `prefix`*) in every hierarchy (v1) or the
    unified one (v2)."""
    found: set[str] = set()
    if not os.path.isdir(CGROUP_ROOT):
        return found
    unified = os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers"))
    tops = [CGROUP_ROOT] if unified else [os.path.join(CGROUP_ROOT, h) for h in os.listdir(CGROUP_ROOT)]
    for top in tops:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        found.update(os.path.join(top, n) for n in names
                     if n.startswith(prefix) and os.path.isdir(os.path.join(top, n)))
    return found


def remove_empty_since(before: set[str], prefix: str = "quark") -> None:
    """rmdir, children first, the quark* (or `prefix`*) cgroups that did not exist in `before`; a
    non-empty one (something still lives there: a leak the tests report) is left alone."""
    if os.geteuid() != 0:
        return
    for top in sorted(quark_cgroup_dirs(prefix) - before):
        for d, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(d)
            except OSError:
                pass


def unmount_under(base: Path | str) -> None:
    """Lazily unmount everything mounted below `base` (deepest first): what a private containerd,
    dockerd or podman left there (its snapshots, shm and netns binds)."""
    prefix = str(base) + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        targets = [line.split()[4] for line in f]
    for t in sorted((t for t in targets if t.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", t], capture_output=True)
