"""Start-up phase times, for bench/startup.py's breakdown of create and start.

With QUARK_PHASES=DIR in its environment, a supervisor writes DIR/<id>.json: the CLOCK_MONOTONIC
time (seconds; the clock is system-wide, so the caller's timestamps compare) at which each step of
create and start happened, the container's processes reporting their own steps in the messages
they send anyway. Without the variable nothing is recorded or written.
"""
from __future__ import annotations

import json
import os
import time

ENV = "QUARK_PHASES"
verb_started = 0.0   # when this process's `quark` verb began (cli.main; a factory worker's, too)


class Phases:
    def __init__(self, container_id: str) -> None:
        self.dir = os.environ.get(ENV, "")
        self.container_id = container_id
        self.times: dict[str, float] = {}

    def mark(self, name: str, t: float | None = None) -> None:
        if self.dir:
            self.times[name] = t if t else time.monotonic()

    def write(self) -> None:
        if not self.dir:
            return
        path = os.path.join(self.dir, f"{self.container_id}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(self.times, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass   # a benchmark's aid: never a reason for a container to fail
