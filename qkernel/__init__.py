"""QKernel: traps the container's syscalls at the sandbox boundary and answers them in user space.

The runtime calls `install_filter` in the container process right before execve; the supervisor
runs a `Kernel` on its event loop. See qkernel/table.py for what happens to each syscall.
"""
from qkernel.config import PLATFORMS, load_platform
from qkernel.errors import FilterError, UnknownPlatform
from qkernel.kernel import Kernel, SandboxContext
from qkernel.policy import install_filter

__all__ = ["PLATFORMS", "FilterError", "Kernel", "SandboxContext", "UnknownPlatform",
           "install_filter", "load_platform"]
