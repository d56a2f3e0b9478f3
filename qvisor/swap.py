"""Swap for hibernation: the host's, or a swap file of quark's own.

    # /etc/quark/config.yaml (or $QUARK_CONFIG)
    snapshot:
      swapfile:
        path: /var/lib/quark/swapfile
        size: 2G

`quark snapshot create` (and `run --snapshot-when`) call ensure_swap() before asking the
supervisor to hibernate: with no swap active and a swap file configured, the file is made (once:
fallocate, mode 0600, mkswap) and switched on. It stays on (the host's administrator asked for
it; `swapoff PATH` removes it). The supervisor cannot do this itself: its seccomp filter denies
swapon. With no swap at all, hibernation freezes only and says so.
"""
from __future__ import annotations

import os
import re
import subprocess

from qlib import hostconfig
from qlib import linux as L
from qlib.errors import ConfigError, QuarkError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.I)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MIN_SIZE = 1 << 20   # mkswap needs at least 10 pages; less is surely a typo


def parse_size(text: object, path: str, field: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(path, field, f"{text!r} is not a size (e.g. 2G, 512M, bytes)")
    size = int(m.group(1)) * _SCALE[m.group(2).lower()]
    if size < MIN_SIZE:
        raise ConfigError(path, field, f"{text!r} is too small for a swap file (at least 1M)")
    return size


def configured_swapfile(config: str) -> tuple[str, int] | None:
    """(path, size) of snapshot.swapfile in the config file; None when not configured."""
    snap = hostconfig.entry(config, "snapshot")
    if snap is None:
        return None
    if not isinstance(snap, dict):
        raise ConfigError(config, "snapshot", "expected a mapping")
    sw = snap.get("swapfile")
    if sw is None:
        return None
    if not isinstance(sw, dict) or not isinstance(sw.get("path"), str) or not os.path.isabs(sw["path"]):
        raise ConfigError(config, "snapshot.swapfile", "expected {path: ABSOLUTE-PATH, size: SIZE}")
    return sw["path"], parse_size(sw.get("size", ""), config, "snapshot.swapfile.size")


def active_swaps() -> list[str]:
    with open("/proc/swaps") as f:
        return [line.split()[0] for line in f.readlines()[1:] if line.strip()]


def ensure_swap(config: str | None = None) -> str:
    """Make sure some swap is active; returns where it comes from ("host", the swap file's path,
    or "" when there is none)."""
    config = config or hostconfig.path()
    want = configured_swapfile(config)
    active = active_swaps()
    if want is None:
        return "host" if active else ""
    path, size = want
    if path in active:
        return path
    if not os.path.exists(path):
        _make_swapfile(path, size)
    try:
        L.swapon(path)
    except OSError as e:
        raise QuarkError(f"{config}: snapshot.swapfile: swapon {path}: {os.strerror(e.errno)}") from None
    return path


def _make_swapfile(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".new"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)   # a swap file must have no holes
        finally:
            os.close(fd)
        r = subprocess.run(["mkswap", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            raise QuarkError(f"snapshot.swapfile: mkswap {path}: {r.stderr.strip() or r.returncode}")
        os.rename(tmp, path)
    except OSError as e:
        raise QuarkError(f"snapshot.swapfile: creating {path}: {e.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
