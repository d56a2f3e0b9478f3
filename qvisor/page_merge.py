"""Supervisors' pages offered to the kernel's samepage merging (KSM): an operator's choice.

    # /etc/quark/config.yaml (or $QUARK_CONFIG)
    supervisor:
      memory_merge: true     # default false

Why: a supervisor is a Python process forked from the sandbox factory, and CPython 3.11 writes the
reference count of every object it touches, so each supervisor holds a few MiB of private copies of
the factory's pages — most of them byte for byte the same in every supervisor, or the same as the
page it was copied from (bench/README.md, "Start-up and supervisor memory"). KSM merges such pages
back into one.

With the setting on, each supervisor marks all of its memory mergeable (prctl PR_SET_MEMORY_MERGE,
Linux 6.4+); the host's ksmd merges it only when the operator runs ksmd (/sys/kernel/mm/ksm/run = 1:
quark never turns it on). The mark passes to children through fork and exec, so every process the
supervisor forks for the container takes it off again before anything else (withdraw_in_child):
the container's memory is never offered, and quark's base policy refuses a container's own
MADV_MERGEABLE / PR_SET_MEMORY_MERGE (qkernel/table.py), so no sandbox can time merges against a
supervisor's pages. OCI hooks the supervisor runs are host programs and keep the mark.
"""
from __future__ import annotations

import errno

from qlib import hostconfig
from qlib import linux as L
from qlib.errors import ConfigError

_FIELD = "supervisor.memory_merge"

_offered = False   # this process marked itself (its forked children take the mark off)


def load_setting(config_path: str | None = None) -> bool:
    """supervisor.memory_merge from quark's host config (False when absent). A setting this kernel
    cannot honour is refused, naming the field."""
    path = config_path or hostconfig.path()
    from qvisor import pods
    section = hostconfig.section(path, "supervisor", pods.SUPERVISOR_KEYS, pods.SUPERVISOR_SHAPE)
    if section is None:
        return False
    value = section.get("memory_merge", False)
    if not isinstance(value, bool):
        raise ConfigError(path, _FIELD, f"{value!r}: expected true or false")
    if value and not supported():
        raise ConfigError(path, _FIELD, "this kernel cannot merge a process's pages (PR_SET_MEMORY_MERGE needs "
                                        "Linux 6.4 or later, built with CONFIG_KSM)")
    return value


def supported() -> bool:
    try:
        L.prctl(L.PR_GET_MEMORY_MERGE)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True


def offer() -> None:
    """Mark this process's memory mergeable (the supervisor, before it forks anything)."""
    global _offered
    L.prctl(L.PR_SET_MEMORY_MERGE, 1)
    _offered = True


def withdraw_in_child() -> None:
    """In a child forked by an offering supervisor: take the mark off, before the container's code
    could run with it."""
    if _offered:
        L.prctl(L.PR_SET_MEMORY_MERGE, 0)
