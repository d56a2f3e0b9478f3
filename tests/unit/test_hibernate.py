"""Hibernation's pure parts and its page-level reading of a live process: durations, sizes, the
--snapshot-when grammar, the swap file config, and which pages resident_ranges reports."""
from __future__ import annotations

import mmap
import os
import signal

import pytest

from qlib.errors import ConfigError, QuarkError
from qvisor import hibernate, readiness, swap
from qvisor.supervisor.snapshot import parse_duration


@pytest.mark.parametrize("text,seconds", [("30s", 30.0), ("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0),
                                          ("7", 7.0), (" 1.5S ", 1.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "0s", "-1s", "nan", "inf", "1d"])
def test_bad_durations_name_the_annotation(text):
    with pytest.raises(QuarkError, match="io.quark.hibernate.idle-after"):
        parse_duration(text)


def test_sizes():
    assert swap.parse_size("2G", "c", "f") == 2 << 30
    assert swap.parse_size("512M", "c", "f") == 512 << 20
    assert swap.parse_size("64MiB", "c", "f") == 64 << 20
    assert swap.parse_size(1 << 21, "c", "f") == 1 << 21
    for bad in ("lots", "1k", "-2G"):
        with pytest.raises(ConfigError, match="/etc/x.yaml: snapshot.swapfile.size"):
            swap.parse_size(bad, "/etc/x.yaml", "snapshot.swapfile.size")


def test_swapfile_config(tmp_path):
    cfg = tmp_path / "config.yaml"
    assert swap.configured_swapfile(str(tmp_path / "absent.yaml")) is None
    cfg.write_text("platform: seccomp\n")
    assert swap.configured_swapfile(str(cfg)) is None
    cfg.write_text("snapshot:\n  swapfile:\n    path: /var/lib/quark/swap\n    size: 1G\n")
    assert swap.configured_swapfile(str(cfg)) == ("/var/lib/quark/swap", 1 << 30)
    cfg.write_text("snapshot:\n  swapfile:\n    path: relative/swap\n    size: 1G\n")
    with pytest.raises(ConfigError, match="snapshot.swapfile"):
        swap.configured_swapfile(str(cfg))
    cfg.write_text("snapshot: 3\n")
    with pytest.raises(ConfigError, match=": snapshot: expected a mapping"):
        swap.configured_swapfile(str(cfg))


def test_snapshot_when_grammar():
    assert readiness.parse("tcp:8080").port == 8080
    assert readiness.parse("file:/tmp/ready").value == "/tmp/ready"
    assert readiness.parse("exec:test -e '/tmp/a b'").argv == ("test", "-e", "/tmp/a b")
    for bad, words in (("tcp:0", "1-65535"), ("tcp:http", "1-65535"), ("udp:1", "unknown condition"),
                       ("exec:", "expected"), ("file", "expected"), ("exec:'", "quotation")):
        with pytest.raises(QuarkError, match=words):
            readiness.parse(bad)


def test_resident_ranges_are_the_pages_a_process_touched():
    """A child maps 64 fresh pages and touches pages 3-5 and 40: exactly those are reported."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        m = mmap.mmap(-1, 64 * hibernate.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for page in (3, 4, 5, 40):
            m[page * hibernate.PAGE] = 1
        import ctypes
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        os.write(w, addr.to_bytes(8, "little"))
        signal.pause()
        os._exit(0)
    os.close(w)
    try:
        addr = int.from_bytes(os.read(r, 8), "little")
        ranges = [(a, n) for a, n in hibernate.resident_ranges(pid) if addr <= a < addr + 64 * hibernate.PAGE]
        assert ranges == [(addr + 3 * hibernate.PAGE, 3 * hibernate.PAGE), (addr + 40 * hibernate.PAGE, hibernate.PAGE)]
        assert hibernate.pages({pid: ranges}) == 4
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
