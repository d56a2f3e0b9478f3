"""Which of a spec's mounts stay out of quark's lock (qvisor/rootfs_lock.unlocked_binds): the binds
that guard nothing (containerd's /etc files, volumes), attached after the lock so that a non-recursive
bind of a directory holding them works as with runc; never a mask, a read-only path, anything in the
kernel's trees, nor a bind whose late attach would change what covers what."""
from __future__ import annotations

from qvisor.rootfs_lock import unlocked_binds
from qvisor.spec import default_spec, parse_spec


def spec(mounts: list[dict], **linux) -> object:
    data = default_spec()
    data["mounts"] = data["mounts"] + mounts
    data["linux"].update(linux)
    return parse_spec(data, "/b/config.json", "/b")


def bind(dest: str, src: str = "/var/lib/vol", *opts: str) -> dict:
    return {"destination": dest, "type": "bind", "source": src, "options": ["rbind", *opts]}


def names(s) -> list[str]:
    return [s.mounts[i].destination for i in unlocked_binds(s)]


def test_containerds_etc_binds_and_volumes_stay_out_of_the_lock_the_kernel_trees_do_not():
    s = spec([bind("/etc/hosts"), bind("/etc/resolv.conf", "/x", "ro"), bind("/data"),
              bind("/dev/termination-log"), bind("/proc/driver/x"), bind("/sys/x")])
    assert names(s) == ["/etc/hosts", "/etc/resolv.conf", "/data"]
    # the default spec's own mounts (proc, /dev, /dev/pts, /sys, ...) are never among them
    assert all(not s.mounts[i].destination.startswith(("/proc", "/dev", "/sys")) for i in unlocked_binds(s))


def test_no_bind_at_above_or_below_a_masked_or_read_only_path():
    s = spec([bind("/etc"), bind("/opt/secret/inner"), bind("/srv")],
             maskedPaths=["/etc/shadow-like"], readonlyPaths=["/opt/secret"])
    assert names(s) == ["/srv"]


def test_no_late_attach_that_would_change_what_covers_what():
    # a mount listed later at or above it would have covered it (as in runc): it stays in order
    s = spec([bind("/data/sub"), {"destination": "/data", "type": "tmpfs", "source": "tmpfs", "options": []}])
    assert names(s) == []
    # a mount that stays locked beneath it would be covered by its late attach
    s = spec([bind("/data"), {"destination": "/data/tmp", "type": "tmpfs", "source": "tmpfs", "options": []}])
    assert names(s) == []
    # binds beneath binds that both stay out keep their order
    s = spec([bind("/data"), bind("/data/sub")])
    assert names(s) == ["/data", "/data/sub"]


def test_none_when_create_container_hooks_see_the_rootfs_before_pivot_root():
    data = default_spec()
    data["mounts"].append(bind("/etc/hosts"))
    data["hooks"] = {"createContainer": [{"path": "/bin/true"}]}
    assert unlocked_binds(parse_spec(data, "/b/config.json", "/b")) == []
