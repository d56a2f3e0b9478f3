"""Which interception platform a sandbox uses: the CLI flag, else /etc/quark/config.yaml, else seccomp."""
from __future__ import annotations

import os

from qkernel.errors import UnknownPlatform
from qlib.errors import ConfigError

PLATFORMS = ("seccomp", "ptrace")
DEFAULT_PLATFORM = "seccomp"
CONFIG_PATH = "/etc/quark/config.yaml"


def check_platform(value: str, source: str = "platform") -> str:
    if value not in PLATFORMS:
        raise UnknownPlatform(value, source)
    return value


def host_config_path() -> str:
    """quark's host configuration file: $QUARK_CONFIG, else /etc/quark/config.yaml."""
    return os.environ.get("QUARK_CONFIG") or CONFIG_PATH


def load_platform(cli_value: str | None, config_path: str | None = None) -> str:
    if cli_value:
        return check_platform(cli_value, "--platform")
    config_path = config_path or host_config_path()
    value = _config_value(config_path, "platform")
    if value is not None:
        return check_platform(value, f"{config_path}: platform")
    return DEFAULT_PLATFORM


def _config_value(path: str, key: str) -> str | None:
    """A top-level `key: value` from the config file (YAML; an absent file or key is None)."""
    value = config_entry(path, key)
    return None if value is None else str(value)


def config_entry(path: str, key: str) -> object:
    """A top-level entry of the config file as YAML gives it (None: no file, or no such key)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(path, "", e.strerror or str(e)) from None
    # one create reads several sections (platform, security, supervisor): the file is parsed once
    stamp = (path, st.st_ino, st.st_mtime_ns, st.st_size)
    if _parsed[0] != stamp:
        _parsed[:] = [stamp, _parse(path)]
    raw = _parsed[1]
    return None if raw is None else raw.get(key)


_parsed: list = [None, None]   # [(path, inode, mtime, size), its top-level mapping or None]


def _parse(path: str) -> dict | None:
    # imported here, not at the top: the CLI's create path imports this module and reads the file
    # only when --platform is not given, and importing yaml costs start-up time that nothing else
    # there pays
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(path, "", e.strerror or str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(path, "", f"not valid YAML: {e}") from None
    if raw is None:
        return None   # an empty file (or only comments)
    if not isinstance(raw, dict):
        raise ConfigError(path, "", "expected a mapping at the top level")
    return raw
