"""quark ps: the processes running in the container."""
from __future__ import annotations

import argparse
import json
import subprocess

from qvisor.container.ps import pids as container_pids


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--format", choices=("table", "json"), default="table")
    p.add_argument("id")
    p.add_argument("ps_args", nargs="*", help="arguments for ps(1) (default -ef)")


def run(args: argparse.Namespace) -> int:
    pids = container_pids(args.root, args.id)
    if args.format == "json":
        print(json.dumps(pids))
        return 0
    out = subprocess.run(["ps", *(args.ps_args or ["-ef"])], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    col = lines[0].split().index("PID")
    print(lines[0])
    wanted = set(pids)
    for line in lines[1:]:
        fields = line.split()
        if len(fields) > col and fields[col].isdigit() and int(fields[col]) in wanted:
            print(line)
    return 0
