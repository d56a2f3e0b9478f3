"""OCI mount options -> mount(2) flags, propagation flags and the filesystem data string."""
from __future__ import annotations

from dataclasses import dataclass

from qlib import linux as L

# option -> (clear, flag), propagation option -> flags: qlib.linux's tables, shared with the shim
FLAGS = L.MOUNT_FLAGS
PROPAGATION = L.MOUNT_PROPAGATION
# accepted and meaningless for a fresh mount (defaults), like runc
IGNORED = {"defaults", "loud", "acl", "noacl", "iversion", "noiversion"}
# runc's and crun's extensions, never passed to the kernel: a tmpfs starts with the contents of the
# directory it covers (qvisor/tmpcopyup.py), or not (the default)
COPY_UP = {"tmpcopyup": True, "notmpcopyup": False}


@dataclass
class MountOptions:
    flags: int = 0
    propagation: list[int] | None = None
    data: str = ""
    copy_up: bool = False

    @property
    def is_bind(self) -> bool:
        return bool(self.flags & L.MS_BIND)


def parse(options: list[str]) -> MountOptions:
    flags, prop, data, copy_up = 0, [], [], False
    for opt in options:
        if opt in FLAGS:
            clear, bit = FLAGS[opt]
            flags = flags & ~bit if clear else flags | bit
        elif opt in PROPAGATION:
            prop.append(PROPAGATION[opt])
        elif opt in COPY_UP:
            copy_up = COPY_UP[opt]
        elif opt in IGNORED:
            continue
        else:
            data.append(opt)
    return MountOptions(flags, prop, ",".join(data), copy_up)
