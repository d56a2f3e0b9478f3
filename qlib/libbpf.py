"""Compiled BPF objects (`*.bpf.o`, built from C by `make install` with clang) loaded through libbpf
(Debian's libbpf1, `libbpf.so.1`): the one module that calls it.

`load` opens an object, reuses live maps where the caller has them (a map another process made and
an attached program still holds), loads the programs the caller names and hands back their fds and
the maps', by name; the object is closed before it returns. Attaching is the caller's (qlib/bpf.py's
bpf(2) calls). libbpf's messages go to the `qlib.libbpf` logger, never to stderr; a failed load
raises BpfError naming the object and the program or map, with the verifier's or libbpf's reason.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from qlib.errors import BpfError
from qlib.libc import libc

LIBRARY = "libbpf.so.1"
# per program, the verifier's log of a refused one (kernels before 6.4 refuse a load whose log does not fit)
_LOG_SIZE = 1 << 18
_WARN, _INFO = 0, 1       # enum libbpf_print_level (LIBBPF_DEBUG is 2)
_TRACE = 5                # the logging level of libbpf's debug lines: below DEBUG, shown only on request

log = logging.getLogger("qlib.libbpf")

_lock = threading.Lock()   # one load at a time: libbpf's print hook is process-wide
_lib: ctypes.CDLL | None = None
_warnings: list[str] = []  # libbpf's warnings during the load under way


@dataclass
class Loaded:
    """fds of one load's programs and maps, by name (as the C source names them); the caller's to
    keep or close."""
    programs: dict[str, int]
    maps: dict[str, int]

    def close(self) -> None:
        for fd in (*self.programs.values(), *self.maps.values()):
            os.close(fd)
        self.programs, self.maps = {}, {}


_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


@_PRINT_FN
def _print(level: int, fmt: bytes, args: int) -> int:
    """libbpf's print hook: its message (a printf format and a va_list, which on x86_64 and aarch64
    arrives as a pointer) formatted by the C library's vsnprintf, into logging."""
    to = logging.WARNING if level == _WARN else logging.DEBUG if level == _INFO else _TRACE
    if level != _WARN and not log.isEnabledFor(to):
        return 0
    buf = ctypes.create_string_buffer(1024)
    libc.vsnprintf(buf, len(buf), fmt, ctypes.c_void_p(args))
    text = buf.value.decode(errors="replace").rstrip().removeprefix("libbpf: ")
    if level == _WARN:
        _warnings.append(text)   # said with the error if the load fails, logged below if it does not
    else:
        log.log(to, "libbpf: %s", text)
    return 0


def _library() -> ctypes.CDLL:
    """libbpf, opened on first use (a process that never loads an object never maps it)."""
    global _lib
    if _lib is not None:
        return _lib
    try:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as e:
        raise BpfError(errno.ENOENT, f"{LIBRARY} cannot be opened ({e}): install Debian's libbpf1 "
                                     "(make install does)") from None
    p, i, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    for name, restype, argtypes in (
            ("libbpf_set_print", p, [_PRINT_FN]),
            ("bpf_object__open_file", p, [s, p]),
            ("bpf_object__load", i, [p]),
            ("bpf_object__close", None, [p]),
            ("bpf_object__next_program", p, [p, p]),
            ("bpf_object__next_map", p, [p, p]),
            ("bpf_object__find_map_by_name", p, [p, s]),
            ("bpf_program__name", s, [p]),
            ("bpf_program__set_autoload", i, [p, ctypes.c_bool]),
            ("bpf_program__set_log_buf", i, [p, p, ctypes.c_size_t]),
            ("bpf_program__fd", i, [p]),
            ("bpf_map__name", s, [p]),
            ("bpf_map__fd", i, [p]),
            ("bpf_map__reuse_fd", i, [p, i]),
            ("bpf_map__is_internal", ctypes.c_bool, [p]),
            ("libbpf_strerror", i, [i, p, ctypes.c_size_t]),
            ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    libc.vsnprintf.argtypes = [p, ctypes.c_size_t, s, p]   # (for _print)
    lib.libbpf_set_print(_print)
    _lib = lib
    return lib


def _each(next_of: Callable[[int, int | None], int | None], obj: int) -> list[int]:
    """Every program or map of the object (libbpf's bpf_object__next_* iteration)."""
    out, item = [], None
    while item := next_of(obj, item):
        out.append(item)
    return out


def load(path: str, source: str | None = None, programs: Collection[str] | None = None,
         reuse: Mapping[str, int] | None = None) -> Loaded:
    """Load the object file `path`: the programs named in `programs` (every one when None; the
    others are left out), its maps made anew except those in `reuse` (name -> fd of a live map of
    the same type and layout, used in their place). BpfError when the object is missing or older
    than its C `source`, or the kernel refuses a map or a program."""
    try:
        built = os.stat(path).st_mtime
    except FileNotFoundError:
        raise BpfError(errno.ENOENT, f"{path} is missing: build it (make install: clang, libbpf-dev)") from None
    if source is not None and os.path.exists(source) and built < os.stat(source).st_mtime:
        raise BpfError(f"{path} is older than {source}: rebuild it (make install)")
    lib = _library()
    with _lock:
        _warnings.clear()
        obj = lib.bpf_object__open_file(path.encode(), None)
        if not obj:
            raise _error(ctypes.get_errno(), f"opening {path}")
        try:
            loaded = _load(lib, obj, path, programs, reuse or {})
        except BaseException:
            for text in _warnings:   # the error says the last of them
                log.debug("libbpf: %s", text)
            raise
        finally:
            lib.bpf_object__close(obj)
        for text in _warnings:       # the load went through: worth a look, not an error
            log.warning("libbpf: %s (%s)", text, path)
        return loaded


def _load(lib: ctypes.CDLL, obj: int, path: str, wanted: Collection[str] | None,
          reuse: Mapping[str, int]) -> Loaded:
    progs = {lib.bpf_program__name(p).decode(): p for p in _each(lib.bpf_object__next_program, obj)}
    missing = set(wanted or ()) - set(progs)
    if missing:
        raise BpfError(errno.ENOENT, f"{path} has no program {', '.join(sorted(missing))}: rebuild it (make install)")
    logs = {}
    for name, prog in progs.items():
        if wanted is not None and name not in wanted:
            lib.bpf_program__set_autoload(prog, False)
        else:
            logs[name] = ctypes.create_string_buffer(_LOG_SIZE)
            lib.bpf_program__set_log_buf(prog, logs[name], _LOG_SIZE)
    for name, fd in reuse.items():
        m = lib.bpf_object__find_map_by_name(obj, name.encode())
        if not m:
            raise BpfError(errno.ENOENT, f"{path} has no map {name}: rebuild it (make install)")
        err = lib.bpf_map__reuse_fd(m, fd)
        if err:
            raise _error(-err, f"{path}: reusing the live map {name}")
    err = lib.bpf_object__load(obj)
    if err:
        failed = next((name for name, buf in logs.items() if buf.value), None)
        if failed is not None:
            said = logs[failed].value.decode(errors="replace").strip().splitlines()[-4:]
            code, words = _reason(-err)
            raise BpfError(code, f"loading {failed} from {path}: {words}: the verifier said: {' / '.join(said)}")
        raise _error(-err, f"loading {path}")
    out = Loaded({}, {})
    try:
        for name, prog in progs.items():
            if name in logs:
                out.programs[name] = os.dup(lib.bpf_program__fd(prog))
        for m in _each(lib.bpf_object__next_map, obj):
            if not lib.bpf_map__is_internal(m):
                out.maps[lib.bpf_map__name(m).decode()] = os.dup(lib.bpf_map__fd(m))
    except BaseException:
        out.close()
        raise
    return out


def _reason(err: int) -> tuple[int, str]:
    """An errno for libbpf's error `err` and its words: libbpf has codes of its own from 4000 on (a
    malformed object, a relocation it cannot make), which become EINVAL."""
    buf = ctypes.create_string_buffer(256)
    _library().libbpf_strerror(err, buf, len(buf))
    return (err if err < 4000 else errno.EINVAL), buf.value.decode(errors="replace")


def _error(err: int, what: str) -> BpfError:
    """`what` failed with libbpf's error `err`; its warnings say which map or program and why."""
    said = f": libbpf said: {' / '.join(_warnings[-3:])}" if _warnings else ""
    code, words = _reason(err)
    return BpfError(code, f"{what}: {words}{said}")
