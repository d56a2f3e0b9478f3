"""The factory's wire: one SOCK_SEQPACKET message each way, and where its files live.

Request: MAGIC, program ("quark", or an entry point of the "quark.factory" group), argc, argv...,
envc, env..., umask (octal), NUL-separated; SCM_RIGHTS carries stdin, stdout, stderr and an O_PATH
fd of the working directory. Reply: b"F" + reason (declined: the client runs the verb itself), or
b"X" + the exit status once the verb is done; before it, for a call whose signals the client
forwards (a foreground `run`), b"P" + the worker's pid, as soon as the worker has the call. The C front end (qvisor/frontend.c) writes the same
bytes; tests/unit/test_frontend_lists.py holds the two to each other.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("quark.factory")

MAGIC = b"quark-factory/2"
SOCK_NAME, LOCK_NAME, PID_NAME, LOG_NAME = "factory.sock", "factory.lock", "factory.pid", "factory.log"
MAX_REQUEST = 1 << 20          # argv + environment; a bigger request falls back


def enabled() -> bool:
    return os.environ.get("QUARK_FACTORY", "1") != "0"


def directory() -> str:
    return os.environ.get("QUARK_FACTORY_DIR", "/run/quark")


DEFAULT_IDLE_S = 300.0


def idle_seconds(config_path: str | None = None) -> float:
    """How long a factory waits for a request before it exits: $QUARK_FACTORY_IDLE, else `factory:
    {idle_seconds: N}` in quark's host configuration (0: it never exits; a Kubernetes node's
    setting, deploy/daemonset.yaml), else DEFAULT_IDLE_S. A value it cannot take is refused,
    naming the field."""
    from qlib import hostconfig
    from qlib.errors import ConfigError
    env = os.environ.get("QUARK_FACTORY_IDLE")
    if env is not None:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ConfigError("$QUARK_FACTORY_IDLE", "", f"{env!r}: expected seconds (0: never)")
        return value if value > 0 else float("inf")
    path = config_path or hostconfig.path()
    section = hostconfig.section(path, "factory", ("idle_seconds",), "{idle_seconds: N}")
    if section is None:
        return DEFAULT_IDLE_S
    value = section.get("idle_seconds", DEFAULT_IDLE_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ConfigError(path, "factory.idle_seconds", f"{value!r}: expected seconds, 0 or more (0: never)")
    return float(value) if value > 0 else float("inf")


def socket_path(where: str | None = None) -> str:
    return os.path.join(where or directory(), SOCK_NAME)


def encode_request(argv: list[str], env: dict[str, str], umask: int, prog: str = "quark") -> bytes:
    fields = [MAGIC, prog.encode(), str(len(argv)).encode(), *(os.fsencode(a) for a in argv), str(len(env)).encode(),
              *(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()), b"%o" % umask]
    return b"\0".join(fields)


def decode_request(data: bytes) -> tuple[list[str], dict[str, str], int, str]:
    """(argv, env, umask, program); ValueError for anything malformed."""
    f = data.split(b"\0")
    if f[0] != MAGIC or len(f) < 3:
        raise ValueError("not a quark-factory/2 request")
    prog = os.fsdecode(f[1])
    if not prog:
        raise ValueError("no program named")
    argc = int(f[2])
    if argc < 0 or len(f) < 5 + argc:
        raise ValueError("truncated request")
    argv = [os.fsdecode(a) for a in f[3:3 + argc]]
    envc = int(f[3 + argc])
    pairs = f[4 + argc:4 + argc + envc]
    if envc < 0 or len(pairs) != envc or len(f) != 5 + argc + envc:
        raise ValueError("truncated request")
    env = {}
    for p in pairs:
        k, sep, v = p.partition(b"=")
        if not sep:
            raise ValueError("environment entry without '='")
        env[os.fsdecode(k)] = os.fsdecode(v)
    return argv, env, int(f[-1], 8), prog


def decline(conn: socket.socket, reason: str) -> None:
    """Answer "run it yourself": nothing of the request ran."""
    log.info("declined: %s", reason)
    try:
        conn.send(b"F" + reason.encode())
    except OSError:
        pass


def worker_pid(conn: socket.socket, pid: int) -> None:
    """Tell the client where to forward its signals."""
    conn.send(b"P%d" % pid)


def done(conn: socket.socket, code: int) -> None:
    """Answer the verb's exit status."""
    try:
        conn.send(b"X%d" % code)
    except OSError:
        pass
