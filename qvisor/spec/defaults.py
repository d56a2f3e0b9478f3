"""What `quark spec` writes: `default_spec()`, runc 1.1's example config with quark's hostname, and
`make_rootless`, which adapts it for an unprivileged user as `runc spec --rootless` does.

These are plain dicts (the JSON to write), not the model: the file is read back through `parse`.
"""
from __future__ import annotations

import os


def default_spec() -> dict:
    """The config `runc spec` (runc 1.1) writes, with quark's hostname; a fresh dict each call."""
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    no_exec = ["nosuid", "noexec", "nodev"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": True,
            "user": {"uid": 0, "gid": 0},
            "args": ["sh"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "TERM=xterm"],
            "cwd": "/",
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted", "ambient")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "quark",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": no_exec + ["mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": list(no_exec)},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": no_exec + ["ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": no_exec + ["relatime", "ro"]},
        ],
        "linux": {
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                            "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def make_rootless(spec: dict, uid: int, gid: int) -> dict:
    """Adapt a default spec for an unprivileged user, as runc's specconv.ToRootless does."""
    linux = spec.setdefault("linux", {})
    # No network namespace: an unprivileged user could not configure its interfaces anyway.
    linux["namespaces"] = [ns for ns in linux.get("namespaces", []) if ns["type"] not in ("network", "user")]
    linux["namespaces"].append({"type": "user"})
    linux["uidMappings"] = [{"containerID": 0, "hostID": uid, "size": 1}]
    linux["gidMappings"] = [{"containerID": 0, "hostID": gid, "size": 1}]
    mounts = []
    for m in spec.get("mounts", []):
        if os.path.normpath(m["destination"]) == "/sys":
            # sysfs can't be mounted without owning the network namespace; bind the host's instead.
            mounts.append({"destination": "/sys", "type": "none", "source": "/sys",
                           "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]})
            continue
        # uid=/gid= options name ids that need not be mapped in the new user namespace.
        if "options" in m:
            m["options"] = [o for o in m["options"] if not o.startswith(("uid=", "gid="))]
        mounts.append(m)
    spec["mounts"] = mounts
    linux.pop("resources", None)  # an unprivileged user usually can't write cgroups
    return spec
