"""qvisor.cgroups.devicefilter: the eBPF encoding, the v1 devices-controller emulation, and the
program's layout. What the programs allow and deny is checked in the kernel, against v1's
devices controller, by tests/integration/test_cgroup2_devices.py (the kernel cannot test-run a
cgroup device program: BPF_PROG_TEST_RUN answers ENOTSUPP for this program type)."""
from __future__ import annotations

import os
import random
import struct

import pytest

from qlib.errors import SetupError
from qvisor.cgroups import bpf
from qvisor.cgroups import devicefilter as df
from qvisor.devices import cgroup_resources
from qvisor.spec import DeviceRule, default_spec, parse_resources, parse_spec


def rules(*oci: dict) -> list[DeviceRule]:
    return parse_resources({"devices": list(oci)}, "test").devices


DENY_ALL, ALLOW_ALL = {"allow": False}, {"allow": True}


def dev(kind: str, major: int = -1, minor: int = -1, access: str = "rwm", allow: bool = True) -> dict:
    return {"allow": allow, "type": kind, "major": major, "minor": minor, "access": access}


def test_encoding_matches_the_kernel_abi() -> None:
    # the bytes llvm-objdump shows for these instructions (little-endian struct bpf_insn)
    assert df.insn(df.EXIT).hex() == "9500000000000000"                              # exit
    assert df.insn(df.ALU64_MOV_K, df.R0, imm=1).hex() == "b700000001000000"         # r0 = 1
    assert df.insn(df.LDX_MEM_W, df.R2, df.R1, 4).hex() == "6112040000000000"        # r2 = *(u32 *)(r1 + 4)
    assert df.insn(df.ALU32_AND_K, df.R2, imm=0xffff).hex() == "54020000ffff0000"    # w2 &= 65535
    assert df.insn(df.ALU32_RSH_K, df.R3, imm=16).hex() == "7403000010000000"        # w3 >>= 16
    assert df.insn(df.ALU32_MOV_X, df.R1, df.R3).hex() == "bc31000000000000"         # w1 = w3
    assert df.insn(df.JNE_K, df.R2, off=5, imm=2).hex() == "5502050002000000"        # if r2 != 2 goto +5
    assert df.insn(df.JEQ_K, df.R1, off=-1, imm=0).hex() == "1501ffff00000000"       # if r1 == 0 goto -1
    assert df.insn(df.JSET_K, df.R3, off=3, imm=6).hex() == "4503030006000000"       # if r3 & 6 goto +3
    assert df.insn(df.JNE_K, df.R4, imm=0xffffffff).hex() == "55040000ffffffff"      # a u32 imm as its bits


def test_emulation_starts_deny_all_and_a_rules_reset() -> None:
    assert df.emulate([]) == df.Ruleset(False, {})
    # v1 reads only the 'a' of an 'a' rule: numbers and access do not narrow it
    assert df.emulate(rules(dev("c", 1, 3), {"allow": True, "type": "a", "major": 1, "access": "r"})) == \
        df.Ruleset(True, {})
    assert df.emulate(rules(ALLOW_ALL, dev("c", 1, 3, allow=False), DENY_ALL, dev("b", 8, 0, "r"))) == \
        df.Ruleset(False, {("b", 8, 0): df.ACC_READ})


def test_emulation_merges_and_takes_back_exceptions() -> None:
    got = df.emulate(rules(DENY_ALL, dev("c", 1, 3, "r"), dev("c", 1, 3, "w"), dev("c", -1, 5, "m"),
                           dev("c", 1, 3, "r", allow=False), dev("c", -1, 5, "m", allow=False)))
    assert got == df.Ruleset(False, {("c", 1, 3): df.ACC_WRITE})
    got = df.emulate(rules(ALLOW_ALL, dev("b", 8, -1, "rw", allow=False), dev("b", 8, -1, "w")))
    assert got == df.Ruleset(True, {("b", 8, None): df.ACC_READ})
    # a rule that agrees with the default and has nothing to take back changes nothing
    assert df.emulate(rules(DENY_ALL, dev("c", 1, 3, allow=False))) == df.Ruleset(False, {})


def test_emulation_refuses_holes_in_wildcards() -> None:
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[2\]: cannot deny 'c 1:5 w' inside the earlier "
                                         r"wildcard rule 'c 1:\* rw'"):
        df.emulate(rules(DENY_ALL, dev("c", 1, -1, "rw"), dev("c", 1, 5, "w", allow=False)))
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[2\]: cannot allow 'b 8:0 rwm' inside"):
        df.emulate(rules(ALLOW_ALL, dev("b", access="m", allow=False), dev("b", 8, 0)))
    # no access in common: nothing to punch, as in runc
    assert df.emulate(rules(DENY_ALL, dev("c", 1, -1, "r"), dev("c", 1, 5, "w", allow=False))) == \
        df.Ruleset(False, {("c", 1, None): df.ACC_READ})


def test_malformed_rules_name_the_field() -> None:
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[1\].minor: 4294967296 is out of range"):
        df.program(rules(DENY_ALL, dev("c", 1, 1 << 32)))
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[0\].access: "):
        df.program([DeviceRule(True, "c", 1, 3, "rx")])
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[0\].type: 'u' "):
        df.program([DeviceRule(True, "u", 1, 3, "rwm")])
    # unset type and access mean 'a' and rwm, as the v1 code writes them
    assert df.emulate([DeviceRule(True, "", None, None, "")]) == df.Ruleset(True, {})
    assert df.emulate([DeviceRule(False), DeviceRule(True, "c", 1, 3, "")]) == \
        df.Ruleset(False, {("c", 1, 3): df.ACC_ALL})


def decode(prog: bytes) -> list[tuple[int, int, int, int, int]]:
    return [(code, regs & 0xf, regs >> 4, off, imm) for code, regs, off, imm in struct.iter_unpack("<BBhi", prog)]


def blocks(prog: bytes) -> list[list[tuple[int, int, int, int, int]]]:
    """The program after its 6-insn prologue, cut after each exit."""
    out: list[list] = [[]]
    for i in decode(prog)[6:]:
        out[-1].append(i)
        if i[0] == df.EXIT:
            out.append([])
    assert out.pop() == []
    return out


def test_layout() -> None:
    assert [b[-2][4] for b in blocks(df.program(rules(ALLOW_ALL)))] == [1]  # one block: r0 = 1
    assert [b[-2][4] for b in blocks(df.program(rules(DENY_ALL)))] == [0]
    prog = df.program(rules(ALLOW_ALL, dev("c", 1, 5, "w", allow=False), dev("b", 8, -1, allow=False)))
    insns = decode(prog)
    starts, at = set(), 6
    for block in blocks(prog):
        at += len(block)
        starts.add(at)  # where the next block starts
    for pc, (code, *_, off, _imm) in enumerate(insns):
        if code in (df.JNE_K, df.JEQ_K, df.JSET_K):
            assert pc + 1 + off in starts, "every test skips to the start of the next block"
    # exceptions in runc's order (major, minor, type), each returning the opposite of the default
    assert [b[0][4] for b in blocks(prog)[:-1]] == [df.DEV_CHAR, df.DEV_BLOCK]
    assert [b[-2][4] for b in blocks(prog)] == [0, 0, 1]
    # deny w: the request's access masked with w, then a test for nothing in common
    assert [i[0] for i in blocks(prog)[0]] == [df.JNE_K, df.ALU32_MOV_X, df.ALU32_AND_K, df.JEQ_K, df.JNE_K,
                                               df.JNE_K, df.ALU64_MOV_K, df.EXIT]
    # allow r: one test, for any access bit outside r
    allow_r = blocks(df.program(rules(DENY_ALL, dev("c", 1, 3, "r"))))[0]
    assert allow_r[1][0] == df.JSET_K and allow_r[1][4] == df.ACC_WRITE | df.ACC_MKNOD


def default_rules() -> list[DeviceRule]:
    return cgroup_resources(parse_spec(default_spec(), "config.json", "/nonexistent")).devices


def test_default_rules_are_an_allow_list() -> None:
    c = "c"
    assert df.emulate(default_rules()) == df.Ruleset(False, {
        (c, None, None): df.ACC_MKNOD, ("b", None, None): df.ACC_MKNOD,
        **{(c, 1, n): df.ACC_ALL for n in (3, 5, 7, 8, 9)}, (c, 5, 0): df.ACC_ALL, (c, 5, 2): df.ACC_ALL,
        (c, 136, None): df.ACC_ALL})


def _random_rules(rng: random.Random) -> list[DeviceRule]:
    out = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.choice("abcc")
        access = "".join(sorted(rng.sample("rwm", rng.randint(1, 3))))
        out.append(DeviceRule(rng.random() < 0.6, kind, rng.choice([None, 1, 5, 136, 0xffffffff]),
                              rng.choice([None, 0, 3, 9]), access))
    return out


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="loading an eBPF program needs root (CAP_BPF)")
def test_the_verifier_accepts_every_program() -> None:
    rng = random.Random(4)
    loaded = 0
    for _ in range(300):
        try:
            prog = df.program(_random_rules(rng))
        except SetupError:
            continue  # a hole in a wildcard
        os.close(bpf.prog_load(prog))
        loaded += 1
    os.close(bpf.prog_load(df.program(default_rules())))
    assert loaded > 200
