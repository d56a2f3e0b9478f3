"""`quark spec`: write a starter config.json into a bundle, as `runc spec` does."""
from __future__ import annotations

import argparse
import json
import os

from qlib.errors import QuarkError
from qvisor.spec import default_spec, make_rootless


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-b", "--bundle", default="",
                        help="path to the root of the bundle directory (default: current directory)")
    # A dest of its own: the global --rootless (runc compatibility) would otherwise be overwritten.
    parser.add_argument("--rootless", dest="spec_rootless", action="store_true",
                        help="generate a configuration for a rootless container")


def run(args: argparse.Namespace) -> int:
    bundle = args.bundle or "."
    path = os.path.join(bundle, "config.json")
    spec = default_spec()
    if args.spec_rootless:
        make_rootless(spec, os.geteuid(), os.getegid())
    try:
        # O_EXCL: never clobber a config someone wrote, even one created while we ran.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        raise QuarkError(f"File {path} exists. Remove it first") from None
    except FileNotFoundError:
        raise QuarkError(f"bundle directory {bundle} does not exist") from None
    except OSError as e:
        raise QuarkError(f"cannot create {path}: {e.strerror}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(spec, indent="\t"))  # tabs and no trailing newline, byte-alike runc
    return 0
