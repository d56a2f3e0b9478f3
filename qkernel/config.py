"""Which interception platform a sandbox uses: the CLI flag, else `platform:` in quark's host
configuration (qlib/hostconfig.py), else seccomp."""
from __future__ import annotations

from qkernel.errors import UnknownPlatform
from qlib import hostconfig

PLATFORMS = ("seccomp", "ptrace")
DEFAULT_PLATFORM = "seccomp"


def check_platform(value: str, source: str = "platform") -> str:
    if value not in PLATFORMS:
        raise UnknownPlatform(value, source)
    return value


def load_platform(cli_value: str | None, config_path: str | None = None) -> str:
    if cli_value:
        return check_platform(cli_value, "--platform")
    config_path = config_path or hostconfig.path()
    value = hostconfig.entry(config_path, "platform")
    if value is not None:
        return check_platform(str(value), f"{config_path}: platform")
    return DEFAULT_PLATFORM
