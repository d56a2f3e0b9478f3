"""Inside the container: make device nodes and try to open them (never reading or writing).

    python3 devices_probe.py '[["name", "b"|"c", major, minor], ...]' /dev/configured...

Prints one JSON object: for each node made, mknod's result and open's (O_RDONLY, then O_WRONLY);
for each configured device path, whether it opens and (for a zero device) reads zeros.
"""
import errno
import json
import os
import stat
import sys


def err(e):
    return errno.errorcode.get(e.errno, str(e.errno))


out = {"made": {}, "configured": {}}
for name, kind, major, minor in json.loads(sys.argv[1]):
    path = f"/dev/{name}"
    r = {}
    try:
        os.mknod(path, 0o600 | (stat.S_IFBLK if kind == "b" else stat.S_IFCHR), os.makedev(major, minor))
        r["mknod"] = "ok"
    except OSError as e:
        r["mknod"] = err(e)
    if r["mknod"] == "ok":
        for label, flags in (("open_r", os.O_RDONLY), ("open_w", os.O_WRONLY)):
            try:
                os.close(os.open(path, flags | os.O_NONBLOCK))   # closed at once: no I/O
                r[label] = "OPENED"
            except OSError as e:
                r[label] = err(e)
        os.unlink(path)
    out["made"][f"{kind} {major}:{minor}"] = r
for path in sys.argv[2:]:
    try:
        with open(path, "rb") as f:
            data = f.read(8)
        out["configured"][path] = "reads zeros" if data == b"\0" * 8 else f"read {data!r}"
    except OSError as e:
        out["configured"][path] = err(e)
print(json.dumps(out))
