"""A createRuntime hook (runs on the host after the runtime made the container's mounts, before
pivot_root): appends the container init's mounts, as one JSON line, to the file in argv[1]:
{"id", "mounts": [mount point, ...], "lines": [[root, mount point, options], ...]}."""
import json
import re
import sys


def unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


state = json.load(sys.stdin)
with open(f"/proc/{state['pid']}/mountinfo") as f:
    lines = [[unescape(ln.split()[3]), unescape(ln.split()[4]), ln.split()[5]] for ln in f]
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"id": state["id"], "mounts": [p for _, p, _ in lines], "lines": lines}) + "\n")
