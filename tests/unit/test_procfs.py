"""The mountinfo readers: the full parse and the fast one a mount check uses agree, escapes included."""
from __future__ import annotations

import os

from qlib import procfs

SAMPLE = (b"22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
          b"40 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=10k\n"
          b"61 40 0:50 / /tmp/with\\040space\\134back rw master:7 - tmpfs none\\040x rw\n"
          b"62 61 0:51 /sub /tmp/with\\040space\\134back/in rw - tmpfs t rw\n")


def test_the_fast_mount_tree_agrees_with_the_full_parse():
    full = {m.mount_id: (m.parent_id, m.mount_point) for m in procfs.parse_mountinfo(SAMPLE)}
    assert procfs.parse_mount_tree(SAMPLE) == full
    assert full[61] == (40, "/tmp/with space\\back")


def test_on_this_host_too():
    assert procfs.mount_tree() == {m.mount_id: (m.parent_id, m.mount_point) for m in procfs.mountinfo()}


def test_read_small_reads_to_the_end(tmp_path):
    """procfs.read_small (TSoR's /proc reads without a buffered file) reads past its first read's size."""
    data = os.urandom(200_000)
    (tmp_path / "f").write_bytes(data)
    assert procfs.read_small(str(tmp_path / "f")) == data
    with open("/proc/self/fdinfo/0") as f:
        assert procfs.fdinfo(0)["flags"] == procfs.parse_keyed(f.read())["flags"]
