"""/etc/quark/config.yaml is read in one place (qlib/hostconfig.py): each part gets its section, and
a key no part knows is refused naming the file and the key, never ignored."""
from __future__ import annotations

import pytest

from qkernel.config import load_platform
from qlib import hostconfig
from qlib.errors import ConfigError


def test_each_part_reads_its_section_from_the_one_file(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("platform: ptrace\nsecurity: {privileged: refuse}\nsnapshot: {}\nsupervisor: {memory_merge: false}\n")
    assert hostconfig.entry(str(p), "security") == {"privileged": "refuse"}
    assert load_platform(None, str(p)) == "ptrace"
    assert hostconfig.entry(str(tmp_path / "absent.yaml"), "platform") is None


def test_an_unknown_setting_is_refused_naming_the_file_and_the_key(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("platform: seccomp\nsupervisors: {memory_merge: true}\n")   # a misspelt section
    with pytest.raises(ConfigError) as e:
        hostconfig.entry(str(p), "platform")
    assert str(p) in str(e.value) and "supervisors" in str(e.value) and "unknown setting" in str(e.value)


def test_a_change_of_the_file_is_seen(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text("platform: seccomp\n")
    assert load_platform(None, str(p)) == "seccomp"
    p.write_text("platform: ptrace   \n")   # another size: a new stamp
    assert load_platform(None, str(p)) == "ptrace"


def test_the_path_follows_QUARK_CONFIG(monkeypatch, tmp_path):
    monkeypatch.setenv("QUARK_CONFIG", str(tmp_path / "c.yaml"))
    assert hostconfig.path() == str(tmp_path / "c.yaml")
    monkeypatch.delenv("QUARK_CONFIG")
    assert hostconfig.path() == "/etc/quark/config.yaml"


def test_the_factorys_idle_time_from_the_environment_the_file_or_the_default(monkeypatch, tmp_path):
    from qvisor.factory import wire
    monkeypatch.delenv("QUARK_FACTORY_IDLE", raising=False)
    p = tmp_path / "config.yaml"
    assert wire.idle_seconds(str(p)) == wire.DEFAULT_IDLE_S          # no file
    p.write_text("factory: {idle_seconds: 30}\n")
    assert wire.idle_seconds(str(p)) == 30
    p.write_text("factory: {idle_seconds: 0}\n")                     # a node's: never
    assert wire.idle_seconds(str(p)) == float("inf")
    monkeypatch.setenv("QUARK_FACTORY_IDLE", "5")                    # the environment first
    assert wire.idle_seconds(str(p)) == 5
    monkeypatch.delenv("QUARK_FACTORY_IDLE")
    for bad, field in (("factory: {idle_seconds: -1}", "factory.idle_seconds"),
                       ("factory: {idle_seconds: true}", "factory.idle_seconds"),
                       ("factory: {idle: 3}", "factory.idle"), ("factory: 3", "factory")):
        p.write_text(bad + "\n")
        with pytest.raises(ConfigError) as e:
            wire.idle_seconds(str(p))
        assert f"{p}: {field}:" in str(e.value), str(e.value)
