"""CVE-2019-5736 class: the runtime's own binary must never be writable from a container.

The runtime's processes that enter a container — quark's init before it execs the user's program,
quark's exec'd processes (forked from the Python supervisor, so /proc/PID/exe is the host's
python), runc's `runc init` — are watched by a scanner inside the container that opens
/proc/PID/exe of every process that appears (O_PATH and O_RDONLY) and reopens it O_WRONLY through
/proc/self/fd/N, at once and again once the runtime is gone. The runtime's process that sits in a
*created* container is made visible deterministically: a second container joins the attacker's pid
namespace (as a pod with a shared pid namespace does) and waits there for `start`.

The classic exploit's other half, `#!/proc/self/exe` (the runtime executes its own binary as the
container's process), is run too: quark's last execve goes through a sealed in-memory trampoline
(qvisor/trampoline.py), so /proc/self/exe is that trampoline, which refuses to be an interpreter.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time

import pytest

from tests.security.conftest import edit_config, init_pid, record, runtime_name, uid, wait_for

pytestmark = pytest.mark.root

EVIL = """#!/proc/self/exe
import json, os
fd = os.open("/proc/self/exe", os.O_PATH)
st = os.fstat(fd)
try:
    os.close(os.open(f"/proc/self/fd/{fd}", os.O_WRONLY))   # never written to
    wr = 0
except OSError as e:
    wr = e.errno
with open("/out/evil.json", "w") as f:
    json.dump({"dev": st.st_dev, "ino": st.st_ino, "wr": wr}, f)
"""


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def host_binaries() -> dict[str, str]:
    from tests.security.conftest import RUNC
    return {"quark": os.path.realpath(sys.executable), "runc": os.path.realpath(RUNC)}


def is_runtime(rt: str, comm: str) -> bool:
    """quark's processes before execve are the `quark` script's python; runc's are `runc:[N:...]`."""
    return comm == "quark" if rt == "quark" else comm.startswith("runc")


def ns_pid(host_pid: int) -> int:
    """host pid -> the pid in its innermost pid namespace."""
    with open(f"/proc/{host_pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("NSpid:")).split()[-1])


def all_caps() -> list[str]:
    from qlib.linux import last_cap
    from qvisor.spec import CAPABILITIES
    return [n for n, bit in CAPABILITIES.items() if bit <= last_cap()]


def in_userns(spec: dict, caps: bool) -> None:
    """A new user namespace (container root = host uid 100000), optionally with every capability."""
    spec["linux"]["namespaces"].append({"type": "user"})
    spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    if caps:
        spec["process"]["capabilities"] = {k: all_caps() for k in ("bounding", "effective", "permitted")}


def traversable(path) -> None:
    """Let the user namespace's root (an unprivileged host uid) walk down to the bundles."""
    for p in [path, *path.parents]:
        if p == p.parent:
            break
        st = os.stat(p)
        if not st.st_mode & 0o001:
            os.chmod(p, st.st_mode | 0o011)


@pytest.mark.parametrize("userns", [False, True], ids=["root", "userns-allcaps"])
def test_runtime_binary_is_not_writable_from_the_container(cli, host_bundle, bundle, tools, userns, tmp_path):
    """`root`: containers as runc's default spec makes them. `userns-allcaps`: both containers in one
    user namespace, the attacker with every capability there — its capabilities then cover the
    parked process's, so only non-dumpability (CAP_SYS_PTRACE over the mm's init user namespace)
    keeps /proc/PID/exe shut."""
    rt = runtime_name(cli)
    binaries = host_binaries()
    before = {p: sha256(p) for p in binaries.values()}
    own = os.stat(binaries[rt])

    a, out = host_bundle(["/bin-tools/exe_attack", "/out", "60"], tools=str(tools))
    with open(os.path.join(a, "rootfs", "evil"), "w") as f:
        f.write(EVIL)
    os.chmod(os.path.join(a, "rootfs", "evil"), 0o755)
    ida, idb = uid("attacker"), uid("joiner")
    if userns:
        traversable(tmp_path)
        edit_config(a, lambda s: in_userns(s, caps=True))
    cli("run", "-d", "--bundle", a, ida)
    wait_for(lambda: os.path.exists(os.path.join(out, "ready")), what="the scanner")
    pid_a = init_pid(cli, ida)

    # a runtime process parked in the attacker's pid namespace: container B, created, not started
    b = bundle(["true"])
    joined = [{"type": "pid", "path": f"/proc/{pid_a}/ns/pid"}]
    if userns:
        joined.append({"type": "user", "path": f"/proc/{pid_a}/ns/user"})

    def join(s: dict) -> None:
        s["linux"]["namespaces"] = joined + [n for n in s["linux"]["namespaces"] if n["type"] != "pid"]
        if userns:   # runc wants the mappings even for a joined user namespace; quark ignores them
            s["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            s["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    edit_config(b, join)
    cli("create", "--bundle", b, idb)
    parked = ns_pid(init_pid(cli, idb))
    time.sleep(0.5)            # the scanner has had many passes over /proc by now
    cli("start", idb)
    for _ in range(3):         # exec'd processes: the pre-exec window is short, the scanner may catch it
        cli("exec", ida, "/bin/true")
    evil = cli("exec", ida, "/evil", check=False)

    open(os.path.join(out, "stop"), "w").close()
    wait_for(lambda: os.path.exists(os.path.join(out, "done")), what="the scanner's report")
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    seen = {s["pid"]: s for s in report["seen"]}

    # the scanner works: an ordinary process's exe opens
    assert seen[report["control"]]["path"] == 0, seen.get(report["control"])
    # it saw the runtime's parked process and could not open its exe (non-dumpable, more caps)
    assert parked in seen, f"the scanner never saw pid {parked}: {sorted(seen)}"
    p = seen[parked]
    assert p["path"] in (errno.EACCES, errno.EPERM) and p["ro"] in (errno.EACCES, errno.EPERM), p
    # ... nor that of any runtime process it caught before its execve (exec'd processes included)
    runtime_procs = [s for s in report["seen"] if is_runtime(rt, s["comm"])]
    opened = [s for s in runtime_procs if s["path"] == 0 or s["ro"] == 0]
    assert opened == [], opened
    # nothing it could open was ever writable, then or after the runtime's processes were gone
    writable = [s for s in report["seen"] if s["wr"] == 0 or s["wr_late"] == 0]
    assert writable == [], writable
    # the host binaries are untouched
    assert {p: sha256(p) for p in binaries.values()} == before

    reached = [s for s in report["seen"] if (s["dev"], s["ino"]) == (own.st_dev, own.st_ino)]
    outcome = [f"parked {p['comm']!r}: {errno.errorcode[p['path']]}; {len(runtime_procs)} runtime processes caught "
               f"before execve, none opened",
               f"{len(report['seen'])} processes seen in {report['scans']} scans, none writable"]
    if rt == "quark":
        # `#!/proc/self/exe`: the last execve goes through quark's sealed trampoline, so the kernel
        # resolves /proc/self/exe to it, and it refuses to run as an interpreter: no host file
        assert evil.returncode == 126, (evil.returncode, evil.stderr)
        assert not os.path.exists(os.path.join(out, "evil.json"))
        outcome.append("#!/proc/self/exe resolves to quark's sealed trampoline, which refuses (126): "
                       "the host's python is never reached")
    else:
        outcome.append(f"#!/proc/self/exe: runc exits {evil.returncode}; host runc reached by scanner: "
                       f"{'yes' if reached else 'no'} (cloned binary)")
    record(f"CVE-2019-5736 exe overwrite ({'userns, all caps' if userns else 'root'})", rt, "; ".join(outcome))
