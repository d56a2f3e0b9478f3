"""quark update: change a running container's resource limits, from runc's flags and/or a
linux.resources JSON file (--resources); a flag overrides the file's value for its field."""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable

from qlib.errors import QuarkError
from qvisor.container.update import update
from qvisor.spec import parse_resources

# docker/go-units' RAMInBytes, which runc uses: binary multiples, "100M" = "100m" = "100MiB"
_SIZE = re.compile(r"(\d+(?:\.\d+)?) ?([kmgtp])?i?b?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A size in runc's forms: "-1" (unlimited), "1048576", "512k", "100M", "1.5GiB"."""
    if text.strip() == "-1":
        return -1
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"invalid size {text!r} (use bytes or a k, m, g, t, p suffix, or -1)")
    return int(float(m[1]) * 1024 ** ("kmgtp".index(m[2].lower()) + 1 if m[2] else 0))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"invalid integer {text!r}") from None


# flag -> (linux.resources object, key, parser); runc's flags, with docker's --cpu-shares spelling too
FLAGS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "memory": ("memory", "limit", parse_size),
    "memory-swap": ("memory", "swap", parse_size),
    "memory-reservation": ("memory", "reservation", parse_size),
    "kernel-memory": ("memory", "kernel", parse_size),
    "kernel-memory-tcp": ("memory", "kernelTCP", parse_size),
    "cpu-shares": ("cpu", "shares", _int),
    "cpu-quota": ("cpu", "quota", _int),
    "cpu-period": ("cpu", "period", _int),
    "cpu-burst": ("cpu", "burst", _int),
    "cpu-idle": ("cpu", "idle", _int),
    "cpu-rt-period": ("cpu", "realtimePeriod", _int),
    "cpu-rt-runtime": ("cpu", "realtimeRuntime", _int),
    "cpuset-cpus": ("cpu", "cpus", str),
    "cpuset-mems": ("cpu", "mems", str),
    "pids-limit": ("pids", "limit", _int),
    "blkio-weight": ("blockIO", "weight", _int),
}

ZERO_IS_A_VALUE = {"cpu-burst", "cpu-idle"}   # no burst; not SCHED_IDLE (runc applies a 0 of these)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--resources", default="",
                   help="linux.resources JSON file ('-' for stdin); flags override its values")
    for flag, (obj, key, _) in FLAGS.items():
        names = [f"--{flag}"] + (["--cpu-share"] if flag == "cpu-shares" else [])  # runc's spelling
        p.add_argument(*names, dest=flag.replace("-", "_"), metavar="VALUE",
                       help=f"linux.resources {obj}.{key}" + ("" if flag in ZERO_IS_A_VALUE
                                                                     else " (0 or empty: unchanged, as in runc)"))
    p.add_argument("id")


def run(args: argparse.Namespace) -> int:
    source = f"--resources {args.resources}" if args.resources else "quark update"
    resources = _read(args.resources) if args.resources else {}
    parse_resources(resources, source)  # the file's own errors first, naming the file
    flags = _flag_values(args)
    if not args.resources and not flags:
        raise QuarkError("update: nothing to change: give --resources FILE or a flag such as --memory")
    for (obj, key), value in flags.items():
        resources[obj] = {**(resources.get(obj) or {}), key: value}  # JSON null counts as absent
    update(args.root, args.id, resources, source)
    return 0


def _read(path: str) -> Any:
    try:
        if path == "-":
            return json.load(sys.stdin)
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise QuarkError(f"--resources {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise QuarkError(f"--resources {path}: is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise QuarkError(f"--resources {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def _flag_values(args: argparse.Namespace) -> dict[tuple[str, str], Any]:
    """(object, key) -> value for each flag given; 0 and "" leave a setting unchanged, as in runc."""
    values = {}
    for flag, (obj, key, parse) in FLAGS.items():
        text = getattr(args, flag.replace("-", "_"))
        if text is None:
            continue
        try:
            value = parse(text)
        except ValueError as e:
            raise QuarkError(f"--{flag}: {e}") from None
        if value in (0, "") and flag not in ZERO_IS_A_VALUE:
            continue
        parse_resources({obj: {key: value}}, f"--{flag}")  # a bad value names its flag
        values[(obj, key)] = value
    return values
