"""The C front end (qvisor/frontend.c) keeps its own copies of four Python facts, because it runs
before any Python: the verbs the factory serves, the global flags that take a value (to find the
verb), the signals `run` forwards, and the wire format's magic. They must agree, or a verb would go
to the factory that declines it (a wasted round trip) or never go there at all, or a signal
`quark run` should pass on to its container would kill the front end instead."""
from __future__ import annotations

import re
import signal
from pathlib import Path

from qvisor import cli
from qvisor.factory import wire

SOURCE = (Path(__file__).resolve().parents[2] / "qvisor" / "frontend.c").read_text()


def _c_list(name: str) -> set[str]:
    body = re.search(rf"static const char \*{name}\[\] = \{{(.*?)\}};", SOURCE, re.S)
    assert body, name
    return set(re.findall(r'"([^"]+)"', body[1]))


def test_served_verbs_agree():
    assert _c_list("served") == set(cli.SERVED)


def test_value_flags_agree():
    assert _c_list("value_flags") == set(cli.VALUE_FLAGS)


def test_forwarded_signals_agree():
    from qvisor.commands.run import FORWARDED
    body = SOURCE.split("static const int forwarded[] = {", 1)[1].split("}", 1)[0]
    assert {getattr(signal, n.strip()) for n in body.split(",") if n.strip() != "0"} == set(FORWARDED)


def test_wire_magic_agrees():
    assert f'#define MAGIC "{wire.MAGIC.decode()}"' in SOURCE
