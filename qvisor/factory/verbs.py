"""quark's own program in the factory: its served verbs, run as the CLI runs them, and what a
verb and a supervisor use, loaded ahead so every fork starts with it."""
from __future__ import annotations

import importlib
import logging

from qvisor import cli

log = logging.getLogger("quark.factory")

# a supervisor's modules besides the served verbs' own: the factory imports them once, its forks share them
_SUPERVISOR_MODULES = (
    "qvisor.birth", "qvisor.validate", "qvisor.spec", "qvisor.supervisor", "qvisor.hooks", "qvisor.procview",
    "qvisor.fuse", "qvisor.security", "qvisor.hibernate", "qvisor.readiness", "qvisor.swap", "qkernel.fastpath",
    "qkernel", "qkernel.seccomp_platform", "qkernel.policy", "tsor.intercept", "tsor.sandbox",
    "qvisor.cgroups.v1", "qvisor.cgroups.v2", "yaml", "seccomp",
    "qvisor.pods", "qvisor.supervisor.pod",   # a pod's supervisor, and the worker that builds its containers
    "pickle")   # the hand-over to a supervisor seed (birth.start)


def main(argv: list[str]) -> int:
    return cli.main(argv, in_factory=True)


def adopts_cgroups(argv: list[str]) -> bool:
    return cli.verb_of(argv) in ("create", "run")   # their supervisor lives where the caller's processes do


def become(data: bytes, fds: list[int]) -> None:
    """A seed handed a create (qvisor/factory/seeds.py) becomes its supervisor."""
    from qvisor import birth
    birth.supervise_handed_over(data, fds)


def warm() -> None:
    for verb in cli.SERVED:
        importlib.import_module(f"qvisor.commands.{cli.COMMANDS[verb][0]}")
    for name in _SUPERVISOR_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:   # optional parts (libseccomp's bindings): the worker imports on use
            log.info("not preloaded: %s (%s)", name, e)
    for verb in cli.SERVED:
        cli.build_parser(verb)   # cached: a worker only parses
    # a supervisor's first filter build pays libseccomp's and the table's set-up: pay it here once
    try:
        from qkernel import policy
        from qvisor import confine
        policy.build_base_filter("seccomp", False)
        policy.build_base_filter("seccomp", True)
        confine.warm()   # the supervisor's own filter, compiled to BPF: a supervisor only loads it
    except Exception as e:   # noqa: BLE001 — only a warm-up: the supervisor builds (and reports) for real
        log.info("seccomp filter warm-up skipped: %s", e)


# the entry point "quark" of the "quark.factory" group (pyproject.toml)
FACTORY_PROGRAM = {"main": main, "serves": cli.served_by_factory, "adopts_cgroups": adopts_cgroups,
                   "forwards_signals": cli.forwards_signals, "preload": (), "warm": warm,
                   "wants_seed": adopts_cgroups, "become": become}
