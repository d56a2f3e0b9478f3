"""The runtime's log lines in runc's two formats: text ("time level logger: message") and, with
`--log-format json`, one `{"level", "msg", "time"}` object per line, which docker's and podman's
runc shims parse to tell their users why a call failed (a line that is not JSON hides the error)."""
from __future__ import annotations

import json
import logging
import os
import time


def json_line(record: logging.LogRecord, msg: str) -> str:
    entry = {"level": record.levelname.lower(), "msg": msg,
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created))}
    kind = getattr(record, "kind", None)
    if kind is not None:   # a failure's QuarkError.kind, which quark's shim acts on
        entry["kind"] = kind
    return json.dumps(entry, separators=(",", ":"))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json_line(record, record.getMessage())


class LogFile(logging.Handler):
    """The supervisor's log: one line per record, appended with one write(2), in the text format a
    FileHandler with "%(asctime)s %(levelname)s %(name)s: %(message)s" writes, or in runc's JSON.
    A supervisor pays a private page for each object of the factory's it touches, and FileHandler's
    path through Handler.handle, Formatter, PercentStyle and a TextIOWrapper touched many
    (measured: bench/README.md, "Start-up and supervisor memory")."""

    def __init__(self, path: str, log_format: str = "text") -> None:
        super().__init__()
        self.json = log_format == "json"
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()

    def handle(self, record: logging.LogRecord) -> bool:   # no filters, no lock: one write per record
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.stack_info:
                msg += "\n" + record.stack_info
            if self.json:
                line = json_line(record, msg)
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
                line = f"{when},{int(record.msecs):03d} {record.levelname} {record.name}: {msg}"
            os.write(self.fd, (line + "\n").encode(errors="backslashreplace"))
        except Exception:  # noqa: BLE001 - as logging's handlers: a record that cannot be written is dropped
            self.handleError(record)


def log_to(path: str, log_format: str = "text") -> None:
    """The supervisor's logging: every record at INFO or above (or the caller's level) into `path`."""
    # the supervisor's lines show no file, line, thread or process: logging's switches skip
    # collecting them (logThreads & co.; _srcfile None skips findCaller, as logging's source says),
    # and with them the objects that code would touch (see LogFile)
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [LogFile(path, log_format)]
    root_level(root.level)


def root_level(level: int) -> None:
    """The supervisor's root level: the caller's, but INFO at least. Logger.setLevel clears the
    cache of every logger in the process (touching each), so only when the level changes."""
    root = logging.getLogger()
    level = min(level, logging.INFO) or logging.INFO
    if root.level != level:
        root.setLevel(level)


# ---- a pod's supervisor: each container's records in its own log ------------------------------------

_route = [""]   # the container whose work runs now (ContainerLoop's callbacks): its records go to its log


class Routed(logging.Handler):
    """A pod supervisor's log (qvisor/supervisor/pod.py): a record goes to the log of the container
    whose work it was logged in, else to the supervisor's own (the sandbox container's)."""

    def __init__(self, default: logging.Handler) -> None:
        super().__init__()
        self.default = default
        self.by_container: dict[str, LogFile] = {}

    def handle(self, record: logging.LogRecord) -> bool:
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        (self.by_container.get(_route[0]) or self.default).emit(record)


def route(container_id: str, path: str, log_format: str) -> None:
    """From now on, records logged in `container_id`'s work go to `path`."""
    root = logging.getLogger()
    if len(root.handlers) != 1:
        return
    handler = root.handlers[0]
    if not isinstance(handler, Routed):
        handler = root.handlers[0] = Routed(handler)
    handler.by_container[container_id] = LogFile(path, log_format)


def unroute(container_id: str) -> None:
    root = logging.getLogger()
    handler = root.handlers[0] if len(root.handlers) == 1 else None
    if isinstance(handler, Routed) and container_id in handler.by_container:
        handler.by_container.pop(container_id).close()


def in_container(container_id: str, fn, *args) -> object:
    """Run fn(*args) with its records going to `container_id`'s log."""
    before, _route[0] = _route[0], container_id
    try:
        return fn(*args)
    finally:
        _route[0] = before
