"""Inside the container: are maskedPaths masked, readonlyPaths read-only, and the classic escape
files (core_pattern, sysrq-trigger, uevent_helper, cgroup release_agent) out of reach for writing?

    python3 paths_probe.py '{"masked": [...], "readonly": [...]}'

Prints one JSON object. Files are opened for writing only to see whether the open succeeds; they are
closed at once, never written to.
"""
import errno
import glob
import json
import os
import stat
import sys

cfg = json.loads(sys.argv[1])
out = {"masked": {}, "readonly": {}, "sensitive": {}}


def try_write_open(p):
    try:
        fd = os.open(p, os.O_WRONLY | os.O_NOCTTY)
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    os.close(fd)          # never written to
    return "OPENED"


for p in cfg["masked"]:
    if not os.path.lexists(p):
        out["masked"][p] = "absent"
        continue
    st = os.stat(p)
    if stat.S_ISDIR(st.st_mode):
        out["masked"][p] = "empty dir" if not os.listdir(p) else f"dir with {len(os.listdir(p))} entries"
    elif stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3):
        with open(p, "rb") as f:
            out["masked"][p] = "null device" if f.read(16) == b"" else "null device with data?"
    else:
        out["masked"][p] = f"NOT MASKED (mode {oct(st.st_mode)})"

for p in cfg["readonly"]:
    if not os.path.lexists(p):
        out["readonly"][p] = "absent"
        continue
    ro = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    out["readonly"][p] = "read-only mount" if ro else "WRITABLE MOUNT"
    if not os.path.isdir(p):
        out["readonly"][p] += f", open for write: {try_write_open(p)}"

for p in ["/proc/sys/kernel/core_pattern", "/proc/sys/kernel/modprobe", "/proc/sysrq-trigger",
          "/sys/kernel/uevent_helper", "/proc/sys/fs/binfmt_misc/register", "/sys/kernel/notes"] + \
        glob.glob("/sys/fs/cgroup/**/release_agent", recursive=True) + \
        glob.glob("/sys/fs/cgroup/**/notify_on_release", recursive=True):
    out["sensitive"][p] = try_write_open(p) if os.path.lexists(p) else "absent"
print(json.dumps(out))
