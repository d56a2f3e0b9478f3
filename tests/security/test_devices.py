"""Devices: only the configured ones are usable (device cgroup: v1 `devices` controller here).

A container given CAP_MKNOD (runc's default spec withholds it) makes nodes for the host's root
disk, /dev/mem and /dev/kmsg: mknod is allowed (runc and quark both allow `m` for every node, the
node is useless without `rw`), opening them must fail. A device from linux.devices and the default
devices work. The probe only opens and closes nodes; it never reads or writes one that opened.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.security.conftest import edit_config, record, runtime_name, uid

pytestmark = pytest.mark.root


def host_disk() -> tuple[int, int]:
    """major:minor of the block device holding / (the host's root filesystem)."""
    dev = os.stat("/").st_dev
    return os.major(dev), os.minor(dev)


def test_only_configured_devices_are_usable(cli, host_bundle):
    rt = runtime_name(cli)
    major, minor = host_disk()
    nodes = [["xdisk", "b", major, minor], ["xmem", "c", 1, 1], ["xkmsg", "c", 1, 11], ["xnull", "c", 1, 3]]
    b, _ = host_bundle(["python3", "/progs/devices_probe.py", json.dumps(nodes), "/dev/zero2", "/dev/zero"])

    def edit(s: dict) -> None:
        caps = s["process"]["capabilities"]
        for k in ("bounding", "effective", "permitted"):
            caps[k] = caps[k] + ["CAP_MKNOD"]
        s["linux"]["devices"] = [{"path": "/dev/zero2", "type": "c", "major": 1, "minor": 5, "fileMode": 0o666}]
    edit_config(b, edit)
    r = cli("run", "--bundle", b, uid("devices"), check=False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    made = got["made"]
    for spec, res in made.items():
        assert res["mknod"] == "ok", (spec, res)      # the test needs the nodes to exist
    for spec in (f"b {major}:{minor}", "c 1:1", "c 1:11"):
        assert made[spec]["open_r"] == "EPERM" and made[spec]["open_w"] == "EPERM", (spec, made[spec])
    assert made["c 1:3"]["open_r"] == "OPENED" and made["c 1:3"]["open_w"] == "OPENED"   # a default device
    assert got["configured"] == {"/dev/zero2": "reads zeros", "/dev/zero": "reads zeros"}
    record("device cgroup: mknod + open of host devices", rt,
           f"host disk {major}:{minor}, /dev/mem, /dev/kmsg: mknod ok, open EPERM; configured /dev/zero2 works")
