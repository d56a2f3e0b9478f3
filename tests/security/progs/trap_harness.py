"""QKernel with a handler that *tries* to act late: it holds each trapped connect() for a second,
then writes a marker over the caller's sockaddr (as getsockname emulation writes into the task)
and answers. If the task exited or exec'd meanwhile, QKernel must refuse both: nothing may land
in a new program image that reuses the pid, and no answer may reach it.

    python trap_harness.py --platform seccomp|ptrace -- PROGRAM ARGS...

Runs PROGRAM the way tests/progs/qkernel_harness.py does (filter installed right before execve,
Loop + Kernel, one reaper) and prints on stderr
`trap-harness: deferred=N completed=N cancelled=N written=N refused=N`.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import os
import signal
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, REPO)

import qkernel  # noqa: E402
from qkernel.errors import MemoryFault, TaskGone  # noqa: E402
from qkernel.request import Errno  # noqa: E402
from qlib.eventloop import Loop  # noqa: E402

_spec = importlib.util.spec_from_file_location("qkernel_harness", os.path.join(REPO, "tests", "progs", "qkernel_harness.py"))
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

MARK = b"QUARK-ACTED-ON-A-GONE-TASK"
HOLD_S = 1.0


class Counters:
    deferred = completed = cancelled = written = refused = 0


def late_actor(loop: Loop, counters: Counters):
    def handle(req):
        d = req.defer()
        counters.deferred += 1
        d.on_cancel(lambda: setattr(counters, "cancelled", counters.cancelled + 1))

        def act():
            # deliberately not checking d.done first: the framework itself must refuse
            try:
                req.write(req.args[1], MARK)
                counters.written += 1
            except (TaskGone, MemoryFault):
                counters.refused += 1
            if not d.done:
                counters.completed += 1
            d.complete(Errno(errno.ECONNREFUSED))
        loop.call_later(HOLD_S, act)
        return d
    return handle


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--platform", required=True)
    p.add_argument("argv", nargs="+")
    args = p.parse_args()

    run = H.Run(args.argv, args.platform, "trap-harness")
    counters = Counters()
    entry = qkernel.table.by_name()["connect"]
    run.kernel.handlers[entry.nr(run.kernel.arch)] = dataclasses.replace(entry, handler=late_actor(run.loop, counters))
    code = run.serve(timeout=30)
    if code is None:
        os.kill(run.pid, signal.SIGKILL)
        return 124
    end = time.monotonic() + HOLD_S + 0.5   # let every held call's late action run
    while time.monotonic() < end:
        run.loop.run_once(0.05)
    run.kernel.close()
    print(f"trap-harness: deferred={counters.deferred} completed={counters.completed} cancelled={counters.cancelled} "
          f"written={counters.written} refused={counters.refused}", file=sys.stderr)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
