"""OCI device rules as a cgroup v2 device program (BPF_PROG_TYPE_CGROUP_DEVICE), pure logic.

cgroup v2 has no devices controller: a program attached to the cgroup decides each device
access. To behave exactly as the v1 devices controller does, the rules are first played through
an emulator of that controller (as runc does): an 'a' rule resets it to allow-all or deny-all and
clears its exceptions, any other rule adds an exception (against the default) or takes one away
(towards it). What remains is a default and a set of exceptions that all say the same thing, so
their order in the program does not matter. As in runc the emulator starts at deny-all.

The program then checks the exceptions the way the v1 kernel does (security/device_cgroup.c):
with a deny-all default a request must be wholly inside one allow exception (its access bits a
subset of the rule's); with an allow-all default any overlap with a deny exception denies it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qlib.bpf import (ALU32_AND_K, ALU32_MOV_X, ALU32_RSH_K, ALU64_MOV_K, EXIT, JEQ_K, JNE_K, JSET_K, LDX_MEM_W, R0, R1,
                      R2, R3, R4, R5, insn)
from qlib.errors import SetupError

from ..spec import DeviceRule
from .base import RESOURCES

# struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }, access_type = access << 16 | type
DEV_BLOCK, DEV_CHAR = 1, 2
ACC_MKNOD, ACC_READ, ACC_WRITE = 1, 2, 4
ACC_ALL = ACC_MKNOD | ACC_READ | ACC_WRITE
TYPES = {"b": DEV_BLOCK, "c": DEV_CHAR}
ACCESS = {"m": ACC_MKNOD, "r": ACC_READ, "w": ACC_WRITE}
U32_MAX = (1 << 32) - 1

Meta = tuple[str, int | None, int | None]  # (type 'b'/'c', major, minor); None = any


@dataclass
class Ruleset:
    """The v1 devices controller's state: a default and exceptions to it (meta -> access bits)."""
    default_allow: bool = False
    exceptions: dict[Meta, int] = field(default_factory=dict)


def _access(rule: DeviceRule, i: int) -> int:
    bits = 0
    for c in rule.access or "rwm":  # empty is all, as in runc
        if c not in ACCESS:
            raise SetupError(f"{RESOURCES}.devices[{i}].access: {rule.access!r} is not a combination of r, w and m")
        bits |= ACCESS[c]
    return bits


def _number(n: int | None, i: int, name: str) -> int | None:
    if n is None or n < 0:  # -1 (or absent) is any
        return None
    if n > U32_MAX:  # the kernel's device numbers are u32 (in fact 12 and 20 bits)
        raise SetupError(f"{RESOURCES}.devices[{i}].{name}: {n} is out of range (at most {U32_MAX})")
    return n


def emulate(rules: Sequence[DeviceRule]) -> Ruleset:
    """Play `rules` through the v1 devices controller, starting from deny-all, as runc's
    emulator does. A rule that would take access out of a wider wildcard exception is refused
    (v1 silently ignores it, which would leave the device usable), as runc refuses it."""
    state = Ruleset()
    for i, rule in enumerate(rules):
        kind = rule.type or "a"
        if kind == "a":  # v1 reads only the 'a': every device, every access
            state = Ruleset(default_allow=rule.allow)
            continue
        if kind not in TYPES:
            raise SetupError(f"{RESOURCES}.devices[{i}].type: {kind!r} is not one of a, b, c")
        meta: Meta = (kind, _number(rule.major, i, "major"), _number(rule.minor, i, "minor"))
        bits = _access(rule, i)
        if rule.allow != state.default_allow:  # an exception against the default
            state.exceptions[meta] = state.exceptions.get(meta, 0) | bits
            continue
        for wider in ((kind, None, meta[2]), (kind, meta[1], None), (kind, None, None)):
            if wider != meta and state.exceptions.get(wider, 0) & bits:
                raise SetupError(
                    f"{RESOURCES}.devices[{i}]: cannot {'allow' if rule.allow else 'deny'} {_show(meta, bits)} "
                    f"inside the earlier wildcard rule {_show(wider, state.exceptions[wider])} (cgroup v1 would "
                    "ignore it, as runc refuses it)")
        left = state.exceptions.pop(meta, 0) & ~bits
        if left:
            state.exceptions[meta] = left
    return state


def _show(meta: Meta, bits: int) -> str:
    kind, major, minor = meta
    access = "".join(c for c, b in (("r", ACC_READ), ("w", ACC_WRITE), ("m", ACC_MKNOD)) if bits & b)
    return f"'{kind} {'*' if major is None else major}:{'*' if minor is None else minor} {access}'"


def _order(item: tuple[Meta, int]) -> tuple[int, int, str]:
    (kind, major, minor), _ = item  # runc's order: (major, minor, type), wildcards first
    return (-1 if major is None else major, -1 if minor is None else minor, kind)


def compile_ruleset(state: Ruleset) -> bytes:
    """The program for `state`: each exception is a block that returns its verdict when the
    request matches and jumps to the next block otherwise; the last block returns the default."""
    code = [insn(LDX_MEM_W, R2, R1, 0), insn(ALU32_AND_K, R2, imm=0xffff),  # R2 = type
            insn(LDX_MEM_W, R3, R1, 0), insn(ALU32_RSH_K, R3, imm=16),      # R3 = access
            insn(LDX_MEM_W, R4, R1, 4), insn(LDX_MEM_W, R5, R1, 8)]         # R4 = major, R5 = minor
    verdict = int(not state.default_allow)  # every exception says the opposite of the default
    for (kind, major, minor), bits in sorted(state.exceptions.items(), key=_order):
        # (opcode, dst, imm) of each test that skips to the next block when it holds
        skips: list[tuple[int, int, int]] = [(JNE_K, R2, TYPES[kind])]
        body: list[bytes] = []
        if bits != ACC_ALL and verdict:  # allow: the request must ask for nothing outside `bits`
            skips.append((JSET_K, R3, ACC_ALL & ~bits))
        elif bits != ACC_ALL:  # deny: any access in common denies (match_exception_partial)
            body = [insn(ALU32_MOV_X, R1, R3), insn(ALU32_AND_K, R1, imm=bits)]
            skips.append((JEQ_K, R1, 0))
        if major is not None:
            skips.append((JNE_K, R4, major))
        if minor is not None:
            skips.append((JNE_K, R5, minor))
        code += _block(skips, body, [insn(ALU64_MOV_K, R0, imm=verdict), insn(EXIT)])
    return b"".join(code + [insn(ALU64_MOV_K, R0, imm=int(state.default_allow)), insn(EXIT)])


def _block(skips: list[tuple[int, int, int]], body: list[bytes], tail: list[bytes]) -> list[bytes]:
    """Lay out one block: the type test, the access test (after `body`, which prepares it), the
    number tests, then `tail`; each test jumps past the block's end, to the next block."""
    size = len(skips) + len(body) + len(tail)
    out: list[bytes] = []
    for n, (op, dst, imm) in enumerate(skips):
        if n == 1:
            out += body
        out.append(insn(op, dst, off=size - len(out) - 1, imm=imm))  # off counts from the next insn
    return out + tail


def program(rules: Sequence[DeviceRule]) -> bytes:
    """The device program for OCI `rules` (linux.resources.devices)."""
    return compile_ruleset(emulate(rules))
