"""The supervisor's log handler (qvisor/logfile.py LogFile) writes the lines a FileHandler with
the supervisor's format wrote, or runc's JSON lines with --log-format json."""
from __future__ import annotations

import json
import logging
import sys

from qvisor import logfile

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _record(msg: str, args: tuple, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("quark.supervisor", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_a_record_is_the_line_a_file_handler_wrote(tmp_path):
    path = tmp_path / "supervisor.log"
    handler = logfile.LogFile(str(path))
    plain = _record("init %d exited with %d", (42, 0))
    try:
        1 / 0
    except ZeroDivisionError:
        failed = _record("supervisor loop", (), sys.exc_info())
    for record in (plain, failed):
        assert handler.handle(record)
    handler.close()
    expected = "".join(logging.Formatter(FORMAT).format(r) + "\n" for r in (plain, failed))
    assert path.read_text() == expected
    assert "ZeroDivisionError" in expected   # the traceback follows its line


def test_it_appends_to_the_file(tmp_path):
    path = tmp_path / "supervisor.log"
    path.write_text("earlier line\n")
    handler = logfile.LogFile(str(path))
    handler.handle(_record("again", ()))
    handler.close()
    text = path.read_text()
    assert text.startswith("earlier line\n") and text.endswith(" WARNING quark.supervisor: again\n")


def test_json_lines_are_what_runcs_callers_parse(tmp_path):
    # containerd's runc shim (docker's) and podman read every line of --log as
    # {"level", "msg", "time"}: one line that is not JSON and the user sees a decoding error instead
    path = tmp_path / "log.json"
    handler = logfile.LogFile(str(path), "json")
    try:
        1 / 0
    except ZeroDivisionError:
        failed = _record("supervisor loop", (), sys.exc_info())
    for record in (_record("init %d exited with %d", (42, 0)), failed):
        handler.handle(record)
    handler.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["level"], e["msg"].splitlines()[0]) for e in lines] == \
        [("warning", "init 42 exited with 0"), ("warning", "supervisor loop")]
    assert "ZeroDivisionError" in lines[1]["msg"] and all(e["time"].endswith("Z") for e in lines)
