"""The building blocks of config.json validation: `Reader` (which file is being read) and the small
checks that every field goes through (strings, booleans, integer ranges, lists, absolute paths,
one-of choices).

A check is (reader, field path, value) -> parsed value, and a failing one raises a ConfigError that
names the file and the field path, so the parsers in `parse` and `resources` only say which check
each field gets.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NoReturn

from qlib.errors import ConfigError

# ---- validation: every check is (reader, field path, value) -> parsed value ----

MISSING: Any = object()
Check = Callable[["Reader", str, Any], Any]


class Reader:
    """Knows which file is being read, so a check only has to know its field path."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> NoReturn:
        raise ConfigError(self.path, where, message)

    def get(self, obj: dict, prefix: str, key: str, check: Check, default: Any = MISSING) -> Any:
        where = f"{prefix}.{key}" if prefix else key
        value = obj.get(key)
        if value is None:
            if default is MISSING:
                self.fail(where, "is required")
            return default
        return check(self, where, value)


def string(r: Reader, f: str, v: Any) -> str:
    if not isinstance(v, str):
        r.fail(f, "must be a string")
    # the kernel takes C strings: a NUL would cut a path or a name short, or fail half-way through
    # set-up with an error that names nothing
    if "\0" in v:
        r.fail(f, "must not contain a NUL character")
    return v


def boolean(r: Reader, f: str, v: Any) -> bool:
    if not isinstance(v, bool):
        r.fail(f, "must be a boolean")
    return v


def mapping(r: Reader, f: str, v: Any) -> dict:
    if not isinstance(v, dict):
        r.fail(f, "must be an object")
    return v


def integer(lo: int, hi: int) -> Check:
    def check(r: Reader, f: str, v: Any) -> int:
        # bool is an int subclass in Python, but JSON true is never a valid number.
        if isinstance(v, bool) or not isinstance(v, int):
            r.fail(f, "must be an integer")
        if v < lo and lo == 0:
            r.fail(f, f"must not be negative, got {v}")
        if not lo <= v <= hi:
            r.fail(f, f"must be between {lo} and {hi}, got {v}")
        return v
    return check


U32, U64, I64 = integer(0, 2**32 - 1), integer(0, 2**64 - 1), integer(-2**63, 2**63 - 1)


def zero_unset(check: Check) -> Check:
    """`check`, with 0 read as "not set": Go-written configs (docker's, podman's) spell an unset
    number as 0, and runc and crun skip a zero weight, limit or class id instead of writing it."""
    def unset_or_checked(r: Reader, f: str, v: Any) -> Any:
        return None if v == 0 and not isinstance(v, bool) else check(r, f, v)
    return unset_or_checked


def list_of(item: Check) -> Check:
    def check(r: Reader, f: str, v: Any) -> list:
        if not isinstance(v, list):
            r.fail(f, "must be a list")
        return [item(r, f"{f}[{i}]", x) for i, x in enumerate(v)]
    return check


def nonempty_strings(r: Reader, f: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not v:
        r.fail(f, "must be a non-empty list of strings")
    return [string(r, f"{f}[{i}]", x) for i, x in enumerate(v)]


def string_map(r: Reader, f: str, v: Any) -> dict[str, str]:
    return {string(r, f, k): string(r, f"{f}.{k}", x) for k, x in mapping(r, f, v).items()}


def absolute_path(r: Reader, f: str, v: Any) -> str:
    if not string(r, f, v).startswith("/"):
        r.fail(f, f"must be an absolute path, got {json.dumps(v)}")
    return v


def optional_absolute_path(r: Reader, f: str, v: Any) -> str:
    return absolute_path(r, f, v) if string(r, f, v) else v  # "" means "not set" in Go-written configs


def one_of(choices: Any, what: str) -> Check:
    def check(r: Reader, f: str, v: Any) -> str:
        if string(r, f, v) not in choices:
            r.fail(f, f"unknown {what} {json.dumps(v)}")
        return v
    return check


def no_duplicates(r: Reader, f: str, types: list[str], what: str) -> None:
    for i, t in enumerate(types):
        if t in types[:i]:
            r.fail(f"{f}[{i}].type", f"duplicate {what} {json.dumps(t)}")
