"""OCI lifecycle hooks: each gets the container's state JSON on stdin."""
from __future__ import annotations

import json
import logging
import subprocess

from qlib.errors import QuarkError
from qvisor.spec import Hook

log = logging.getLogger("quark.hooks")


class HookError(QuarkError):
    pass


def run_hooks(kind: str, hooks: list[Hook], state: dict, *, fatal: bool = True) -> None:
    """Run each hook in order. A failing hook raises HookError when `fatal` (prestart, createRuntime,
    createContainer, startContainer), else is logged (poststart, poststop), as the OCI spec says."""
    payload = json.dumps(state).encode()
    for i, h in enumerate(hooks):
        argv = h.args or [h.path]
        # a hook without `env` sees the runtime's environment (runc's exec.Cmd with a nil Env)
        env = dict(e.split("=", 1) for e in h.env if "=" in e) if h.env else None
        try:
            r = subprocess.run(argv, executable=h.path, input=payload, env=env, capture_output=True,
                               timeout=h.timeout, close_fds=True)
            err = f"exit status {r.returncode}: {r.stderr.decode(errors='replace').strip()}" if r.returncode else ""
        except subprocess.TimeoutExpired:
            err = f"timed out after {h.timeout}s"
        except OSError as e:
            err = e.strerror or str(e)
        if err:
            msg = f"hooks.{kind}[{i}] {h.path}: {err}"
            if fatal:
                raise HookError(msg)
            log.warning("%s", msg)
