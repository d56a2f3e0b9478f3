"""The supervisor's log handler (qvisor/container.py _LogFile) writes the lines a FileHandler with
the supervisor's format wrote."""
from __future__ import annotations

import logging
import sys

from qvisor import container

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _record(msg: str, args: tuple, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("quark.supervisor", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_a_record_is_the_line_a_file_handler_wrote(tmp_path):
    path = tmp_path / "supervisor.log"
    handler = container._LogFile(str(path))
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
    handler = container._LogFile(str(path))
    handler.handle(_record("again", ()))
    handler.close()
    text = path.read_text()
    assert text.startswith("earlier line\n") and text.endswith(" WARNING quark.supervisor: again\n")
