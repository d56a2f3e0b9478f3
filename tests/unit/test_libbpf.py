"""Compiled BPF objects through libbpf (qlib/libbpf.py): TSoR's objects load on this kernel with the
programs and map layouts tsor/sockmap.py and tsor/sockopt_offload.py expect, maps are reused where
asked, and a failure is a BpfError naming the object and the program, with libbpf's own output kept
off stderr. Loading needs root (bpf(2)); the checks of a missing or stale object do not."""
from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess

import pytest

from qlib import bpf, libbpf
from qlib.errors import BpfError, QuarkError
from tsor import sockmap, sockopt_offload

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (bpf(2))")


def test_a_missing_object_says_how_to_build_it(tmp_path):
    with pytest.raises(BpfError) as e:
        libbpf.load(str(tmp_path / "x.bpf.o"), str(tmp_path / "x.bpf.c"))
    assert e.value.errno == errno.ENOENT and "x.bpf.o" in str(e.value) and "make install" in str(e.value)
    assert isinstance(e.value, OSError) and isinstance(e.value, QuarkError)   # callers that fall back catch OSError


def test_an_object_older_than_its_source_is_refused(tmp_path):
    obj, src = tmp_path / "x.bpf.o", tmp_path / "x.bpf.c"
    shutil.copy(sockopt_offload.OBJECT, obj)
    src.write_text("")
    os.utime(obj, (1, 1))
    with pytest.raises(BpfError, match="older than .*x.bpf.c: rebuild it"):
        libbpf.load(str(obj), str(src))


@needs_root
def test_the_sockmap_object_has_the_programs_and_map_layouts_tsor_uses():
    loaded = libbpf.load(sockmap.OBJECT, sockmap.SOURCE)
    try:
        assert set(loaded.programs) == {sockmap.OPS_NAME, sockmap.MSG_NAME}
        assert set(loaded.maps) == {sockmap.ADDRS_MAP, sockmap.PAIRS_MAP, sockmap.WAYS_MAP}
        assert bpf.prog_info(loaded.programs[sockmap.OPS_NAME])[0] == sockmap.OPS_NAME   # how a later tsord finds it
        assert bpf.map_info(loaded.maps[sockmap.ADDRS_MAP])[:2] == sockmap.ADDRS_KIND
        assert bpf.map_info(loaded.maps[sockmap.PAIRS_MAP])[:2] == sockmap.PAIRS_KIND
        # the address map's value is the u64 cookie tsord writes
        bpf.map_update(loaded.maps[sockmap.ADDRS_MAP], bytes([10, 9, 8, 7]), struct.pack("Q", 1 << 40))
        assert bpf.map_lookup(loaded.maps[sockmap.ADDRS_MAP], bytes([10, 9, 8, 7]), 8) == struct.pack("Q", 1 << 40)
    finally:
        loaded.close()


@needs_root
def test_maps_handed_in_are_used_and_programs_left_out_are_not_loaded():
    """What a tsord taking over does: only the SK_MSG program anew, on the sockhash and address map
    the attached sock_ops program holds."""
    first = libbpf.load(sockmap.OBJECT, sockmap.SOURCE)
    try:
        second = libbpf.load(sockmap.OBJECT, sockmap.SOURCE, [sockmap.MSG_NAME],
                             {name: first.maps[name] for name in (sockmap.ADDRS_MAP, sockmap.PAIRS_MAP)})
        try:
            assert set(second.programs) == {sockmap.MSG_NAME}
            bpf.map_update(first.maps[sockmap.ADDRS_MAP], bytes([10, 0, 0, 1]), struct.pack("Q", 7))
            assert bpf.map_lookup(second.maps[sockmap.ADDRS_MAP], bytes([10, 0, 0, 1]), 8) == struct.pack("Q", 7)
            ops_maps = set(bpf.prog_info(first.programs[sockmap.OPS_NAME])[1])          # addrs, pairs
            first_msg = set(bpf.prog_info(first.programs[sockmap.MSG_NAME])[1])          # pairs, its ways
            second_msg = set(bpf.prog_info(second.programs[sockmap.MSG_NAME])[1])
            assert len(second_msg & ops_maps) == 1 and second_msg & ops_maps == first_msg & ops_maps   # the same sockhash
            assert len(second_msg - first_msg) == 1                                     # a storage map of its own
        finally:
            second.close()
    finally:
        first.close()


@needs_root
def test_the_sockopt_object_has_both_programs():
    loaded = libbpf.load(sockopt_offload.OBJECT, sockopt_offload.SOURCE)
    try:
        assert set(loaded.programs) == set(sockopt_offload.PROG_NAMES.values())
        assert set(loaded.maps) == {"quark_sko"}
    finally:
        loaded.close()


@needs_root
def test_a_refused_program_is_named_with_the_verifiers_words_and_nothing_reaches_stderr(tmp_path, capfd):
    if shutil.which("clang") is None:
        pytest.skip("needs clang (make install)")
    src = tmp_path / "bad.bpf.c"
    src.write_text('#include <linux/bpf.h>\n#include <bpf/bpf_helpers.h>\n'
                   'SEC("cgroup/setsockopt") int bad_set(struct bpf_sockopt *ctx) { return *(int *)ctx->optval; }\n'
                   'char LICENSE[] SEC("license") = "GPL";\n')
    multiarch = subprocess.run(["gcc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
    subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{multiarch}", "-c", str(src),
                    "-o", str(tmp_path / "bad.bpf.o")], check=True)
    with pytest.raises(BpfError) as e:
        libbpf.load(str(tmp_path / "bad.bpf.o"))
    said = str(e.value)
    assert e.value.errno == errno.EACCES
    assert "loading bad_set from" in said and "bad.bpf.o" in said and "the verifier said:" in said
    assert "invalid access" in said   # the verifier's reason, not only that it refused
    assert capfd.readouterr().err == ""
    with pytest.raises(BpfError, match="has no program nope"):
        libbpf.load(str(tmp_path / "bad.bpf.o"), programs=["nope"])
