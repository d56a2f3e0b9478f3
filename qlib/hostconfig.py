"""quark's host configuration: /etc/quark/config.yaml (or $QUARK_CONFIG), what an operator sets for
every container of the host. One file, read here for every part that has a section in it:

  platform     seccomp | ptrace            qkernel/config.py
  security     privileged, unconfined_seccomp   qvisor/security.py
  snapshot     swapfile                    qvisor/swap.py
  supervisor   memory_merge, scope         qvisor/page_merge.py, qvisor/pods.py
  factory      idle_seconds                qvisor/factory/wire.py
  shim         scope                       shim/paths.py

Each part checks its own section and names the field it refuses; a key no part knows is refused
here (a setting quark cannot honour is never silently dropped). The file is parsed once per
change, however many sections a create reads.
"""
from __future__ import annotations

import os

from qlib.errors import ConfigError

CONFIG_PATH = "/etc/quark/config.yaml"
SECTIONS = ("platform", "security", "snapshot", "supervisor", "factory", "shim")


def path() -> str:
    """quark's host configuration file: $QUARK_CONFIG, else /etc/quark/config.yaml."""
    return os.environ.get("QUARK_CONFIG") or CONFIG_PATH


def entry(config_path: str, key: str) -> object:
    """A top-level entry of the config file as YAML gives it (None: no file, or no such key)."""
    try:
        st = os.stat(config_path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(config_path, "", e.strerror or str(e)) from None
    stamp = (config_path, st.st_ino, st.st_mtime_ns, st.st_size)
    if _parsed[0] != stamp:
        _parsed[:] = [stamp, _parse(config_path)]
    raw = _parsed[1]
    return None if raw is None else raw.get(key)


_parsed: list = [None, None]   # [(path, inode, mtime, size), its top-level mapping or None]


def section(config_path: str, name: str, keys: tuple[str, ...], shape: str) -> dict | None:
    """The section `name` as a mapping of the `keys` a part knows (None: no file, or no section);
    refused naming the field otherwise (`shape`: what it should look like, for the message)."""
    value = entry(config_path, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(config_path, name, f"expected a mapping {shape}")
    for key in value:
        if key not in keys:
            raise ConfigError(config_path, f"{name}.{key}", f"unknown setting (known: {', '.join(keys)})")
    return value


def _parse(config_path: str) -> dict | None:
    # imported here, not at the top: the CLI's create path imports this module and reads the file
    # only when --platform is not given, and yaml's import is a noticeable part of a CLI start
    import yaml
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(config_path, "", e.strerror or str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(config_path, "", f"not valid YAML: {e}") from None
    if raw is None:
        return None   # an empty file (or only comments)
    if not isinstance(raw, dict):
        raise ConfigError(config_path, "", "expected a mapping at the top level")
    for key in raw:
        if key not in SECTIONS:
            raise ConfigError(config_path, str(key), f"unknown setting (known: {', '.join(SECTIONS)})")
    return raw
