"""`quark syscalls`: print QKernel's syscall table — what happens to each syscall in a container."""
from __future__ import annotations

import argparse
import errno
import json
import sys

from qkernel import table
from qkernel.config import PLATFORMS, load_platform

_TRAP_HOW = {
    "seccomp": "seccomp user notification (SECCOMP_RET_USER_NOTIF)",
    "ptrace": "ptrace seccomp stop (SECCOMP_RET_TRACE); no fd installation (ADDFD has no ptrace "
              "equivalent), so TSoR redirection falls back to native sockets",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    parser.add_argument("--platform", choices=PLATFORMS, default=None,
                        help="interception platform (default: /etc/quark/config.yaml, else seccomp)")


def rows(platform: str) -> list[dict]:
    out = []
    for sc in table.table():
        row = {"name": sc.name, "x86_64": sc.x86_64, "aarch64": sc.aarch64, "fate": sc.fate.value}
        if sc.fate is table.Fate.DENIED:
            row["errno"] = errno.errorcode[sc.errno]
            row["reason"] = sc.reason
            if sc.when is not None:
                row["when"] = sc.when.describe
            if sc.grant is not None:
                row["unless"] = sc.grant.describe
            if sc.denied_for is not None:
                row["when"] = f"the process holds {sc.denied_for}"
        elif sc.fate is table.Fate.TRAPPED:
            row["handler"] = f"{sc.handler.__module__}.{sc.handler.__name__}"
            row["reason"] = sc.reason
            if sc.only is not None:
                row["when"] = sc.only.describe
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    platform = load_platform(args.platform)
    data = rows(platform)
    if args.format == "json":
        json.dump({"platform": platform, "trapped_via": _TRAP_HOW[platform], "syscalls": data},
                  sys.stdout, indent=2)
        print()
        return 0
    print(f"platform: {platform} — trapped syscalls via {_TRAP_HOW[platform]}")
    print(f"{'X86_64':>6} {'ARM64':>6}  {'NAME':<24} {'FATE':<8} DETAIL")
    for r in data:
        if r["fate"] == "denied":
            detail = (f"{r['errno']}" + (f" if {r['when']}" if "when" in r else "") + f": {r['reason']}"
                      + (f" (allowed with {r['unless']})" if "unless" in r else ""))
        elif r["fate"] == "trapped":
            detail = (f"{r['handler'].removeprefix('qkernel.syscalls.')}" + (f" if {r['when']}" if "when" in r else "")
                      + f": {r['reason']}")
        else:
            detail = ""
        nr = lambda v: "-" if v is None else str(v)  # noqa: E731
        print(f"{nr(r['x86_64']):>6} {nr(r['aarch64']):>6}  {r['name']:<24} {r['fate']:<8} {detail}".rstrip())
    counts = {f.value: sum(r["fate"] == f.value for r in data) for f in table.Fate}
    print(f"{len(data)} syscalls: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return 0
