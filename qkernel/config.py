"""Which interception platform a sandbox uses: the CLI flag, else /etc/quark/config.yaml, else seccomp."""
from __future__ import annotations

import os

from qkernel.errors import UnknownPlatform

PLATFORMS = ("seccomp", "ptrace")
DEFAULT_PLATFORM = "seccomp"
CONFIG_PATH = "/etc/quark/config.yaml"


def check_platform(value: str, source: str = "platform") -> str:
    if value not in PLATFORMS:
        raise UnknownPlatform(value, source)
    return value


def load_platform(cli_value: str | None, config_path: str = CONFIG_PATH) -> str:
    if cli_value:
        return check_platform(cli_value, "--platform")
    value = _config_value(config_path, "platform")
    if value is not None:
        return check_platform(value, f"{config_path}: platform")
    return DEFAULT_PLATFORM


def _config_value(path: str, key: str) -> str | None:
    """A top-level `key: value` from the config file. Only that subset of YAML is read, so the
    runtime does not depend on a YAML library for one scalar."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].rstrip()
            if not line or line[0].isspace() or ":" not in line:
                continue
            k, v = (part.strip() for part in line.split(":", 1))
            if k == key:
                return v.strip("'\"")
    return None
