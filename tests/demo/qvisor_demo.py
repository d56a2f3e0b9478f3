"""`make demo` (`python -m tests.demo.qvisor_demo`): build a busybox bundle, run it under quark, and show
what the sandbox enforces."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from tests.support.busybox import make_bundle

# each probe: (what a user is shown, shell snippet run inside the container)
PROBES = [
    ("hostname (own UTS namespace)", "hostname"),
    ("its own pid 1 (PID namespace)", "echo pid $$"),
    ("network interfaces (own netns)", "ls /sys/class/net | tr '\\n' ' '"),
    ("user", "id"),
    ("effective capabilities", "grep CapEff /proc/self/status | cut -f2"),
    ("no_new_privs", "grep NoNewPrivs /proc/self/status | cut -f2"),
    ("read-only root filesystem", "touch /probe 2>&1 | sed 's/.*: //'"),
    ("/proc/keys is masked", "wc -c < /proc/keys | sed 's/$/ bytes/'"),
    ("/proc/sys is read-only", "echo 1 > /proc/sys/kernel/domainname 2>&1 | sed 's/.*: //'"),
    ("memory limit seen in the container's cgroup", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes"),
    # busybox `free` prints its columns without separators and its "used" wraps (buff/cache
    # comes from the host's /proc/meminfo), so the total column is read by position
    ("memory total per sysinfo(2) (answered by QKernel)", "free | awk '/Mem:/ {print int(substr($0, 5, 15) / 1024) \" MiB\"}'"),
    ("pids limit", "cat /sys/fs/cgroup/pids/pids.max"),
    ("mounting (denied by the base policy)", "mount -t tmpfs t /tmp 2>&1 | sed 's/.*: //'"),
    ("new user namespace (denied)", "unshare -U true 2>&1 | sed 's/.*: //'"),
]


def main() -> int:
    quark = os.path.join(os.path.dirname(sys.executable), "quark")
    work = tempfile.mkdtemp(prefix="quark-demo-")
    root = os.path.join(work, "state")
    script = "; ".join(f"printf '%s\\t%s\\n' {json.dumps(label)} \"$( ({cmd}) 2>&1)\"" for label, cmd in PROBES)
    try:
        spec = make_bundle(os.path.join(work, "bundle"), ["sh", "-c", script])
        spec["linux"]["resources"].update({"memory": {"limit": 256 << 20}, "pids": {"limit": 64}})
        with open(os.path.join(work, "bundle", "config.json"), "w") as f:
            json.dump(spec, f)
        print(f"quark demo: busybox bundle in {work}/bundle, runc's default config.json, "
              "256 MiB memory and 64 pids limits\n")
        r = subprocess.run([quark, "--root", root, "run", "--bundle", os.path.join(work, "bundle"), "demo"],
                           capture_output=True, text=True, timeout=60)
        rows = [line.split("\t", 1) for line in r.stdout.splitlines() if "\t" in line]
        width = max(len(label) for label, _ in PROBES)
        for label, value in rows:
            print(f"  {label:<{width}}  {value.strip()}")
        print(f"\n  container exit status: {r.returncode}")
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        table = json.loads(subprocess.run([quark, "syscalls", "--format", "json"], capture_output=True,
                                          text=True, check=True).stdout)
        rows = table["syscalls"] if isinstance(table, dict) else table
        fates: dict[str, int] = {}
        for row in rows:
            fates[row["fate"]] = fates.get(row["fate"], 0) + 1
        print("  syscall table (`quark syscalls`): " + ", ".join(f"{n} {f}" for f, n in sorted(fates.items())))
        _show_supervisor(quark, root, os.path.join(work, "bundle"))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _show_supervisor(quark: str, root: str, bundle: str) -> None:
    """The host side: how little the sandbox's supervisor holds while the container runs."""
    with open(os.path.join(bundle, "config.json")) as f:
        spec = json.load(f)
    spec["process"]["args"] = ["sleep", "30"]
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f)
    subprocess.run([quark, "--root", root, "run", "-d", "--bundle", bundle, "sup"], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        init = json.loads(subprocess.run([quark, "--root", root, "state", "sup"], capture_output=True,
                                         text=True, check=True).stdout)["pid"]
        from qlib.procfs import parent_pid
        sup = parent_pid(init)
        with open(f"/proc/{sup}/status") as f:
            st = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
        from qvisor.spec import CAPABILITIES
        eff = int(st["CapEff"], 16)
        kept = [n.removeprefix("CAP_").lower() for n, bit in sorted(CAPABILITIES.items(), key=lambda x: x[1])
                if eff & (1 << bit)]
        print(f"\n  the sandbox's supervisor (pid {sup}, host side), confined after create:")
        print(f"    seccomp filter: {'on' if st['Seccomp'].strip() == '2' else 'OFF'}; "
              f"capabilities kept ({len(kept)}): {' '.join(kept)}")
    finally:
        subprocess.run([quark, "--root", root, "delete", "--force", "sup"], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
