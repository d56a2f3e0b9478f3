"""The programs the factory runs: the entry points of the "quark.factory" group (pyproject.toml):
quark's own CLI (qvisor/factory/verbs.py) and containerd-shim-quark-v1 (shim/main.py). The
factory imports them through the group, so it depends on no program and none on it.

A program is a dict: "main" (argv -> exit status), "serves" (argv -> whether the factory runs this
call), "adopts_cgroups" (argv -> whether the worker joins the caller's cgroups: what it forks lives
there), optionally "forwards_signals" (argv -> whether the client forwards its signals to the
worker, which then tells the client its pid first: wire.py), "preload" (modules to import in the factory),
optionally "warm" (a callable that loads and compiles the rest ahead of the first request), and
optionally "wants_seed" (argv -> whether the worker gets a seed, seeds.py, for what the call starts
to live on) with "become" ((data, fds) -> never returns: what a seed handed that call becomes).
"""
from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

log = logging.getLogger("quark.factory")

PROGRAM_GROUP = "quark.factory"
# name -> program, filled by load() in the factory
PROGRAMS: dict[str, dict] = {}


def load() -> None:
    """Import every program and what it asks to have loaded, so forks start with it."""
    for ep in entry_points(group=PROGRAM_GROUP):
        try:
            program = ep.load()
            for name in program.get("preload", ()):
                importlib.import_module(name)
            if "warm" in program:
                program["warm"]()
            PROGRAMS[ep.name] = program
        except Exception as e:   # noqa: BLE001 — a broken plugin: its program runs without the factory
            log.warning("program %s not served: %s", ep.name, e)
