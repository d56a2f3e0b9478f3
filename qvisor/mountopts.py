"""OCI mount options -> mount(2) flags, propagation flags and the filesystem data string."""
from __future__ import annotations

from dataclasses import dataclass

from qvisor import linux as L

# option -> (clear, set): "ro" sets MS_RDONLY, "rw" clears it, and so on.
FLAGS: dict[str, tuple[bool, int]] = {
    "ro": (False, L.MS_RDONLY), "rw": (True, L.MS_RDONLY),
    "nosuid": (False, L.MS_NOSUID), "suid": (True, L.MS_NOSUID),
    "nodev": (False, L.MS_NODEV), "dev": (True, L.MS_NODEV),
    "noexec": (False, L.MS_NOEXEC), "exec": (True, L.MS_NOEXEC),
    "sync": (False, L.MS_SYNCHRONOUS), "async": (True, L.MS_SYNCHRONOUS),
    "dirsync": (False, L.MS_DIRSYNC),
    "remount": (False, L.MS_REMOUNT),
    "mand": (False, L.MS_MANDLOCK), "nomand": (True, L.MS_MANDLOCK),
    "noatime": (False, L.MS_NOATIME), "atime": (True, L.MS_NOATIME),
    "nodiratime": (False, L.MS_NODIRATIME), "diratime": (True, L.MS_NODIRATIME),
    "relatime": (False, L.MS_RELATIME), "norelatime": (True, L.MS_RELATIME),
    "strictatime": (False, L.MS_STRICTATIME), "nostrictatime": (True, L.MS_STRICTATIME),
    "lazytime": (False, L.MS_LAZYTIME), "nolazytime": (True, L.MS_LAZYTIME),
    "nosymfollow": (False, L.MS_NOSYMFOLLOW), "symfollow": (True, L.MS_NOSYMFOLLOW),
    "bind": (False, L.MS_BIND), "rbind": (False, L.MS_BIND | L.MS_REC),
}
PROPAGATION: dict[str, int] = {
    "private": L.MS_PRIVATE, "rprivate": L.MS_PRIVATE | L.MS_REC,
    "shared": L.MS_SHARED, "rshared": L.MS_SHARED | L.MS_REC,
    "slave": L.MS_SLAVE, "rslave": L.MS_SLAVE | L.MS_REC,
    "unbindable": L.MS_UNBINDABLE, "runbindable": L.MS_UNBINDABLE | L.MS_REC,
}
# accepted and meaningless for a fresh mount (defaults), like runc
IGNORED = {"defaults", "loud", "acl", "noacl", "iversion", "noiversion"}


@dataclass
class MountOptions:
    flags: int = 0
    propagation: list[int] | None = None
    data: str = ""

    @property
    def is_bind(self) -> bool:
        return bool(self.flags & L.MS_BIND)


def parse(options: list[str]) -> MountOptions:
    flags, prop, data = 0, [], []
    for opt in options:
        if opt in FLAGS:
            clear, bit = FLAGS[opt]
            flags = flags & ~bit if clear else flags | bit
        elif opt in PROPAGATION:
            prop.append(PROPAGATION[opt])
        elif opt in IGNORED:
            continue
        else:
            data.append(opt)
    return MountOptions(flags, prop, ",".join(data))
