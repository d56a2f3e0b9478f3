"""`quark`: the runc-compatible command line. One module per verb in qvisor/commands/."""
from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys
import time

from qlib.errors import QuarkError
from qlib.version import OCI_SPEC, VERSION

# verb -> (module under qvisor.commands, one-line help). The table is the CLI.
COMMANDS: dict[str, tuple[str, str]] = {
    "spec": ("spec", "create a new specification file (config.json)"),
    "create": ("create", "create a container"),
    "start": ("start", "execute the user-defined process in a created container"),
    "run": ("run", "create and run a container"),
    "state": ("state", "output the state of a container"),
    "kill": ("kill", "send a signal to the container's init process"),
    "delete": ("delete", "delete any resources held by the container"),
    "exec": ("exec", "execute a new process inside the container"),
    "ps": ("ps", "display the processes running inside a container"),
    "list": ("list", "list containers started by quark with the given root"),
    "pause": ("pause", "suspend all processes inside the container"),
    "resume": ("resume", "resume all processes that have been previously paused"),
    "features": ("features", "show the enabled features"),
    "events": ("events", "display container statistics"),
    "update": ("update", "update container resource constraints"),
    "syscalls": ("syscalls", "print the syscall table"),
    "wait": ("wait", "wait for the container's init or an exec'd process to exit (quark extension)"),
    "tsor": ("tsor", "TSoR status and check"),
    "snapshot": ("snapshot", "hibernate, wake and list hibernated containers (quark extension)"),
}

DEFAULT_ROOT = "/run/quark"


# global flags that take a value (the C front end keeps the same list: qvisor/frontend.c)
VALUE_FLAGS = frozenset({"--root", "--log", "--log-format", "--platform", "--rootless"})
DETACH_FLAGS = frozenset({"-d", "--detach"})
# verbs the sandbox factory runs (qvisor/factory/), sent there by the C front end; the others run
# in the Python CLI. A foreground `run` waits for its container: the front end forwards its signals
# to the worker, which forwards them to the container as the CLI's `run` does.
SERVED = frozenset({"create", "start", "state", "kill", "delete", "pause", "resume", "ps", "list", "snapshot",
                    "run"})


def detached(argv: list[str]) -> bool:
    return any(a in DETACH_FLAGS for a in argv)


def verb_of(argv: list[str]) -> str | None:
    """The verb in argv, found without parsing, so only that verb's module is imported (every
    `quark` call is a new process: startup time is container start-up time)."""
    it = iter(argv)
    for a in it:
        if a in VALUE_FLAGS:
            next(it, None)
        elif not a.startswith("-"):
            return a
    return None


def served_by_factory(argv: list[str]) -> bool:
    """Whether the factory runs this command line."""
    return verb_of(argv) in SERVED


def forwards_signals(argv: list[str]) -> bool:
    """Whether the factory's client forwards its signals to the worker running this command line
    (`run`, which forwards them to the container)."""
    return verb_of(argv) == "run"


def _delegated(verb: str | None, argv: list[str]) -> bool:
    # what the Python CLI itself hands to the factory: a create, and a detached run (a foreground
    # run would need this process to forward its signals; it runs here, having paid its start)
    return verb == "create" or (verb == "run" and detached(argv))


@functools.lru_cache(maxsize=None)
def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `verb`, only that verb's arguments are loaded. Cached: the sandbox
    factory builds the served verbs' parsers once, its workers only parse (parsing changes none)."""
    p = argparse.ArgumentParser(prog="quark", description="quark: a secure OCI container runtime")
    p.add_argument("--root", default=DEFAULT_ROOT, help="root directory for container state (default: %(default)s)")
    p.add_argument("--log", default="", help="log file (default: stderr)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="log format")
    p.add_argument("--debug", action="store_true", help="enable debug logging")
    p.add_argument("--systemd-cgroup", action="store_true",
                   help="use systemd cgroup driver (not supported: quark manages cgroupfs directly)")
    p.add_argument("--rootless", default="auto", help="accepted for runc compatibility; ignored")
    p.add_argument("--platform", default=None, choices=("seccomp", "ptrace"),
                   help="syscall interception platform (default: /etc/quark/config.yaml, else seccomp)")
    p.add_argument("-v", "--version", action="version", version=f"quark {VERSION} (spec {OCI_SPEC})")
    sub = p.add_subparsers(dest="verb", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if verb is not None and verb != name:
            continue   # one verb's subparser is all a real call needs (`quark --help` gets all)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"qvisor.commands.{module}").add_arguments(sp)
    return p


def setup_logging(log: str, log_format: str, debug: bool) -> None:
    handler: logging.Handler = logging.FileHandler(log) if log else logging.StreamHandler(sys.stderr)
    from qvisor import logfile
    handler.setFormatter(logfile.JsonFormatter() if log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.WARNING)


def main(argv: list[str] | None = None, in_factory: bool = False) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from qvisor import phases
    phases.verb_started = time.monotonic()
    verb = verb_of(argv)
    if verb in ("create", "run") and not in_factory:
        # the sandbox factory (qvisor/factory/) has the supervisor's imports loaded already and
        # its forks share them; without one, this create runs here and starts one for the next.
        # Imported here: every other verb's start would pay for it
        from qvisor.factory import caller, client, wire
        if wire.enabled():
            # under a runc-compatible manager (a child subreaper) the factory declines a create
            managers = caller.runc_managers_above(os.getpid())
            if _delegated(verb, argv) and not managers:
                code = client.request(argv)
                if code is not None:
                    return code
            # and a factory started from here is the manager's child until the manager exits: conmon
            # then waits for it (for its children) and outlives its container; containerd's runc
            # shim does not (it serves every verb but create and run from there on)
            if not any(name.startswith("conmon") for name in managers):
                client.ensure_running()
    parser = build_parser(verb if verb in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.log, args.log_format, args.debug)
    if args.systemd_cgroup:
        logging.getLogger("quark").warning("--systemd-cgroup is not supported; using cgroupfs paths as given")
    module = importlib.import_module(f"qvisor.commands.{COMMANDS[args.verb][0]}")
    try:
        if args.verb in ("create", "run", "syscalls"):
            import qkernel
            args.platform = qkernel.load_platform(args.platform)
        args.in_factory = in_factory
        return module.run(args)
    except BrokenPipeError:  # `quark syscalls | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except QuarkError as e:
        logging.getLogger("quark").debug("%s failed", args.verb, exc_info=True)
        print(f"quark: {e}", file=sys.stderr)
        if args.log:
            logging.getLogger("quark").error("%s", e, extra={"kind": e.kind})
        return 1
    except OSError as e:   # a host call no step wrapped: say what failed, never a traceback
        logging.getLogger("quark").debug("%s failed", args.verb, exc_info=True)
        where = f": {e.filename}" if e.filename else ""
        print(f"quark: {args.verb}: {e.strerror or e}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
