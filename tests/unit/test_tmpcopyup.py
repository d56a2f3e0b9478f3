"""Mount options podman and docker put in specs: runc's `tmpcopyup`/`notmpcopyup` extensions are
read as such, never passed to the kernel (podman's --read-only and --tmpfs failed with EINVAL), and
the copy gives the tmpfs the image directory's contents without following its links."""
from __future__ import annotations

import os
import stat

from qlib import linux as L
from qvisor import mountopts, tmpcopyup


def test_copy_up_options_are_extensions_not_data():
    # what podman writes for --tmpfs /run (and for --read-only's /run, /tmp and /var/tmp)
    opts = mountopts.parse(["rw", "rprivate", "nosuid", "nodev", "tmpcopyup"])
    assert opts.copy_up and opts.data == "" and opts.flags == L.MS_NOSUID | L.MS_NODEV
    assert opts.propagation == [L.MS_PRIVATE | L.MS_REC]
    assert not mountopts.parse(["tmpcopyup", "notmpcopyup", "size=65536k"]).copy_up
    assert mountopts.parse(["notmpcopyup", "size=65536k"]).data == "size=65536k"
    # docker's /dev/pts options stay the filesystem's data
    assert mountopts.parse(["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]).data == \
        "newinstance,ptmxmode=0666,mode=0620,gid=5"


def test_copy_keeps_contents_modes_owners_times_and_links(tmp_path):
    src, dst = tmp_path / "image-run", tmp_path / "tmpfs"
    (src / "lock" / "deep").mkdir(parents=True)
    dst.mkdir()
    (src / "lock" / "deep" / "pid").write_bytes(b"42\n" * 50000)
    os.chmod(src / "lock", 0o1750)
    (src / "setuid").write_text("x")
    os.chmod(src / "setuid", 0o4755)
    os.symlink("/etc/passwd", src / "abs-link")      # the host's file: copied as a link, never read
    os.symlink("missing", src / "dangling")
    os.mkfifo(src / "fifo")
    os.chmod(src / "fifo", 0o620)
    os.utime(src / "setuid", ns=(1_000_000_000, 2_000_000_000))
    sfd, dfd = os.open(src, os.O_PATH), os.open(dst, os.O_PATH)
    try:
        tmpcopyup.copy_contents(sfd, dfd)
    finally:
        os.close(sfd)
        os.close(dfd)
    assert sorted(os.listdir(dst)) == ["abs-link", "dangling", "fifo", "lock", "setuid"]
    assert (dst / "lock" / "deep" / "pid").read_bytes() == b"42\n" * 50000
    assert stat.S_IMODE(os.stat(dst / "lock").st_mode) == 0o1750
    assert stat.S_IMODE(os.stat(dst / "setuid").st_mode) == 0o4755
    assert os.stat(dst / "setuid").st_mtime_ns == 2_000_000_000
    assert os.readlink(dst / "abs-link") == "/etc/passwd" and os.path.islink(dst / "abs-link")
    assert os.readlink(dst / "dangling") == "missing"
    assert stat.S_ISFIFO(os.stat(dst / "fifo").st_mode) and stat.S_IMODE(os.stat(dst / "fifo").st_mode) == 0o620
    own = os.stat(src / "lock")
    assert (os.stat(dst / "lock").st_uid, os.stat(dst / "lock").st_gid) == (own.st_uid, own.st_gid)
