"""qlib.syscalls gives the kernel's numbers for each architecture, from libseccomp's tables, so no
module hard-codes x86_64's (a call by the wrong number is another syscall on aarch64)."""
from __future__ import annotations

import platform

import pytest

from qlib import syscalls

# from the kernel's tables: arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h
KERNEL = {
    "x86_64": {"pivot_root": 155, "setns": 308, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
               "open_tree": 428, "move_mount": 429},
    "aarch64": {"pivot_root": 41, "setns": 268, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
                "open_tree": 428, "move_mount": 429},
}


@pytest.mark.parametrize("arch", sorted(KERNEL))
def test_numbers_per_architecture(arch: str) -> None:
    assert {name: syscalls.number(name, arch) for name in KERNEL[arch]} == KERNEL[arch]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="checks the native table on an x86_64 host")
def test_native_is_this_hosts() -> None:
    assert {name: syscalls.number(name) for name in KERNEL["x86_64"]} == KERNEL["x86_64"]


def test_unknown_is_refused() -> None:
    with pytest.raises(LookupError):
        syscalls.number("no_such_syscall")
    with pytest.raises(LookupError):
        syscalls.number("setns", "pdp11")
