"""cgroup v2 device rules for real: V2Cgroup.apply attaches a BPF_CGROUP_DEVICE program to a cgroup
under /sys/fs/cgroup/unified, and a process moved into that cgroup finds exactly the devices the
rules allow. Where the host also has the v1 devices controller, the same rules are applied there
too and both processes must see the same verdicts: the v1 kernel is the reference.

A probe opens (O_NONBLOCK) and closes nodes the test made in a temporary directory, or makes and
removes a node; the device cgroup answers EPERM before the driver is asked, so any other outcome
(even ENXIO for a device this host lacks) means the rules let it through.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid

import pytest

from qlib.errors import SetupError
from qvisor.cgroups import bpf
from qvisor.cgroups.v1 import V1Cgroup, hierarchies
from qvisor.cgroups.v2 import V2Cgroup
from qvisor.devices import cgroup_resources
from qvisor.spec import Resources, default_spec, parse_resources, parse_spec

# a hybrid host's cgroup2 mount (this machine), or the whole hierarchy on a v2 host (the qemu lane)
UNIFIED = next((d for d in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
                if os.path.exists(os.path.join(d, "cgroup.procs")) and os.path.exists(os.path.join(d, "cgroup.stat"))),
               "/sys/fs/cgroup/unified")
pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="device programs and cgroups need root"),
    pytest.mark.skipif(not os.path.exists(os.path.join(UNIFIED, "cgroup.procs")),
                       reason="needs a cgroup2 hierarchy at /sys/fs/cgroup/unified or /sys/fs/cgroup"),
]

# Answers each line of probes ([op, path, arg]) with one line of results.
PROBE = r"""
import errno, json, os, sys
def run(op, path, arg):
    try:
        if op == "open":
            os.close(os.open(path, arg | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC))
        else:
            os.mknod(path, arg[0], arg[1])
            os.unlink(path)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
for line in sys.stdin:
    print(json.dumps([run(*p) for p in json.loads(line)]), flush=True)
"""
FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR}
Probe = tuple[str, int, int, str]  # (type 'b'/'c', major, minor, access 'r'/'w'/'rw'/'m')


def rules(*oci: dict) -> list:
    return parse_resources({"devices": list(oci)}, "test").devices


DENY_ALL = {"allow": False, "access": "rwm"}
ALLOW_ALL = {"allow": True, "access": "rwm"}


def dev(kind: str, major: int | None, minor: int | None, access: str = "rwm", allow: bool = True) -> dict:
    return {"allow": allow, "type": kind, "major": -1 if major is None else major,
            "minor": -1 if minor is None else minor, "access": access}


def default_rules() -> list:
    """The rules quark gives a container made from the default config (`quark spec`)."""
    return cgroup_resources(parse_spec(default_spec(), "config.json", "/nonexistent")).devices


class Prober:
    """A process in its own cgroup that tries device accesses on request."""

    def __init__(self, cg, nodes: str) -> None:
        self.cg, self.nodes = cg, nodes
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        cg.add_pid(self.proc.pid)

    def raw(self, probes: list[Probe]) -> list[str]:
        ask = []
        for kind, major, minor, access in probes:
            name = os.path.join(self.nodes, f"{kind}{major}_{minor}")
            if access == "m":
                mode = (stat.S_IFBLK if kind == "b" else stat.S_IFCHR) | 0o600
                ask.append(["mknod", name + "-m", [mode, os.makedev(major, minor)]])
            else:
                if not os.path.exists(name):
                    os.mknod(name, (stat.S_IFBLK if kind == "b" else stat.S_IFCHR) | 0o600, os.makedev(major, minor))
                ask.append(["open", name, FLAGS[access]])
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def allowed(self, probes: list[Probe]) -> dict[Probe, bool]:
        return {p: r != "EPERM" for p, r in zip(probes, self.raw(probes))}

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def make():
    """make(version) -> (cgroup, Prober) in a fresh cgroup; all removed afterwards, with the nodes."""
    made: list[tuple[object, Prober | None]] = []
    nodes = tempfile.mkdtemp(prefix="quark-devnodes-")

    def make(version: str = "v2"):
        path = f"/quark-test-{uuid.uuid4().hex[:12]}"
        cg = V2Cgroup(path, root=UNIFIED) if version == "v2" else V1Cgroup(path, {"devices": hierarchies()["devices"]})
        made.append((cg, None))
        cg.create()
        prober = Prober(cg, nodes)
        made[-1] = (cg, prober)
        return cg, prober

    yield make
    for cg, prober in made:
        if prober is not None:
            prober.close()
        if cg.exists():
            cg.kill_all(signal.SIGKILL)
            cg.destroy()
    shutil.rmtree(nodes)


def attached(cg: V2Cgroup) -> list[tuple[int, str]]:
    """(id, name) of the device programs attached to the cgroup itself."""
    fd = os.open(cg.dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _, ids = bpf.prog_query(fd)
        out = []
        for prog_id in ids:
            pfd = bpf.prog_fd_by_id(prog_id)
            out.append((prog_id, bpf.prog_name(pfd)))
            os.close(pfd)
        return out
    finally:
        os.close(fd)


NULL, ZERO, FULL, RANDOM, URANDOM, TTY = ("c", 1, 3), ("c", 1, 5), ("c", 1, 7), ("c", 1, 8), ("c", 1, 9), ("c", 5, 0)
PTMX, PTS0, CONSOLE, TUN, KMSG, LOOP0 = ("c", 5, 2), ("c", 136, 0), ("c", 5, 1), ("c", 10, 200), ("c", 1, 11), ("b", 7, 0)


def probes(*devs: tuple[str, int, int], access: str = "r w rw m") -> list[Probe]:
    return [(*d, a) for d in devs for a in access.split()]


def test_default_rules_allow_the_default_devices(make) -> None:
    cg, p = make()
    cg.apply(Resources(devices=default_rules()))
    got = p.allowed(probes(NULL, ZERO, FULL, RANDOM, URANDOM, TTY, PTMX, PTS0, ("c", 136, 7)))
    assert all(got.values()), [k for k, v in got.items() if not v]
    denied = p.allowed(probes(CONSOLE, TUN, KMSG, LOOP0, ("b", 254, 0), access="r w rw"))
    assert not any(denied.values()), [k for k, v in denied.items() if v]
    # mknod of any node is allowed (as runc's and quark's v1 rules: a node is useless without rw)
    assert all(p.allowed([(*KMSG, "m"), (*LOOP0, "m"), ("b", 254, 0, "m")]).values())
    assert [name for _, name in attached(cg)] == [bpf.PROG_NAME]


def test_deny_all_and_allow_all(make) -> None:
    cg, p = make()
    every = probes(NULL, ZERO, LOOP0)
    cg.apply(parse_resources({"devices": [DENY_ALL]}, "test"))
    assert not any(p.allowed(every).values())
    cg.apply(parse_resources({"devices": [ALLOW_ALL]}, "test"))  # replaces deny-all
    # every outcome is the driver's (ENXIO, EIO...), none the cgroup's: the probe's premise
    assert "EPERM" not in p.raw(ALL_PROBES)


def test_one_device_by_number(make) -> None:
    cg, p = make()
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, 3)]}, "test"))
    assert all(p.allowed(probes(NULL)).values())
    assert not any(p.allowed(probes(ZERO, ("c", 3, 1), ("b", 1, 3))).values())  # same numbers, other type


def test_wildcard_minor(make) -> None:
    cg, p = make()
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, None, "rw")]}, "test"))
    assert all(p.allowed(probes(NULL, ZERO, URANDOM, access="r w rw")).values())
    assert not any(p.allowed(probes(TTY, access="r w rw") + [(*NULL, "m")]).values())


def test_access_is_a_subset_check(make) -> None:
    cg, p = make()
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, 5, "r")]}, "test"))
    assert p.allowed(probes(ZERO)) == {(*ZERO, "r"): True, (*ZERO, "w"): False, (*ZERO, "rw"): False,
                                       (*ZERO, "m"): False}


def test_block_and_char_are_told_apart(make) -> None:
    cg, p = make()
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("b", None, None, "m"), dev("c", 7, 0, "r")]}, "test"))
    got = p.allowed([(*LOOP0, "m"), ("c", 7, 0, "m"), (*LOOP0, "r"), ("c", 7, 0, "r")])
    assert got == {(*LOOP0, "m"): True, ("c", 7, 0, "m"): False, (*LOOP0, "r"): False, ("c", 7, 0, "r"): True}


def test_last_rule_wins(make) -> None:
    cg, p = make()
    # a later deny takes back an earlier allow; a later 'a' rule undoes everything before it
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, 3), dev("c", 1, 5), dev("c", 1, 5, "rwm", False)]},
                             "test"))
    assert p.allowed(probes(NULL, ZERO, access="r")) == {(*NULL, "r"): True, (*ZERO, "r"): False}
    cg.apply(parse_resources({"devices": [dev("c", 1, 3, "rwm", False), ALLOW_ALL, dev("c", 1, 5, "w", False)]},
                             "test"))
    # a deny of w denies every request that asks for w, as v1 does
    assert p.allowed(probes(NULL, ZERO, access="r w rw")) == {
        (*NULL, "r"): True, (*NULL, "w"): True, (*NULL, "rw"): True,
        (*ZERO, "r"): True, (*ZERO, "w"): False, (*ZERO, "rw"): False}


def test_update_replaces_the_program(make) -> None:
    cg, p = make()
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, 3)]}, "test"))
    first = attached(cg)
    assert [name for _, name in first] == [bpf.PROG_NAME]
    assert p.allowed(probes(NULL, ZERO, access="r")) == {(*NULL, "r"): True, (*ZERO, "r"): False}
    cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, 5)]}, "test"))  # as `quark update` does
    second = attached(cg)
    assert [name for _, name in second] == [bpf.PROG_NAME] and second != first
    assert p.allowed(probes(NULL, ZERO, access="r")) == {(*NULL, "r"): False, (*ZERO, "r"): True}
    cg.apply(parse_resources({"memory": {}}, "test"))  # an update without devices keeps the program
    assert attached(cg) == second


def test_refusals_attach_nothing(make) -> None:
    cg, p = make()
    # punching a hole in a wildcard: v1 would ignore the deny and leave /dev/zero open
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[2\]: cannot deny 'c 1:5 rwm' inside"):
        cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1, None), dev("c", 1, 5, allow=False)]}, "test"))
    with pytest.raises(SetupError, match=r"^linux.resources.devices\[1\].major: 4294967296 is out of range"):
        cg.apply(parse_resources({"devices": [DENY_ALL, dev("c", 1 << 32, 0)]}, "test"))
    assert attached(cg) == []
    assert all(p.allowed(probes(ZERO, access="r")).values())


def test_exclusive_program_of_someone_else_is_refused(make) -> None:
    cg, p = make()
    fd = os.open(cg.dir, os.O_RDONLY | os.O_DIRECTORY)
    prog = bpf.prog_load(bytes.fromhex("b700000001000000" "9500000000000000"))  # r0 = 1; exit
    try:
        bpf.prog_attach(fd, prog, flags=0)  # neither ALLOW_MULTI nor ALLOW_OVERRIDE
        with pytest.raises(SetupError, match=r"^linux.resources.devices: .*without BPF_F_ALLOW_MULTI"):
            cg.apply(parse_resources({"devices": [DENY_ALL]}, "test"))
        assert len(attached(cg)) == 1 and all(p.allowed(probes(ZERO, access="r")).values())
    finally:
        os.close(prog)
        os.close(fd)


def test_errors_name_the_field(tmp_path) -> None:
    d = tmp_path / "not-a-cgroup" / "c"
    d.mkdir(parents=True)
    (d / "cgroup.controllers").write_text("")
    with pytest.raises(SetupError, match=r"^linux.resources.devices: listing the cgroup's device programs: "):
        V2Cgroup("/c", str(tmp_path / "not-a-cgroup")).apply(parse_resources({"devices": [DENY_ALL]}, "test"))


# ---- the same verdicts as the v1 devices controller ----

def _v1_devices() -> bool:
    try:
        return "devices" in hierarchies()
    except OSError:
        return False


# Rule lists that start with an 'a' rule, so that v1's result does not depend on its parent's.
SAME_AS_V1 = {
    "default": default_rules(),
    "deny-all": rules(DENY_ALL),
    "merged-access": rules(DENY_ALL, dev("c", 1, 3, "r"), dev("c", 1, 3, "w"), dev("c", 1, 5, "rw"),
                           dev("c", 1, 5, "w", False)),
    "wildcards": rules(DENY_ALL, dev("c", None, 3, "r"), dev("b", 7, None, "rm"), dev("c", None, None, "m")),
    "deny-partial": rules(ALLOW_ALL, dev("c", 1, 5, "w", False), dev("c", 5, None, "r", False),
                          dev("b", None, None, "m", False)),
    "allow-back": rules(ALLOW_ALL, dev("c", 1, 3, "rwm", False), dev("c", 1, 3, "r")),
    "reset": rules(dev("c", 1, 3), DENY_ALL, dev("c", 1, 5), ALLOW_ALL, dev("c", 1, 7, "rw", False), DENY_ALL,
                   dev("c", 1, 9, "rw")),
}
ALL_PROBES = probes(NULL, ZERO, FULL, URANDOM, TTY, PTMX, PTS0, KMSG, LOOP0, ("b", 7, 3), ("c", 3, 1), ("b", 1, 3))


@pytest.mark.skipif(not _v1_devices(), reason="needs the cgroup v1 devices controller as the reference")
@pytest.mark.parametrize("name", list(SAME_AS_V1))
def test_same_verdicts_as_v1(make, name) -> None:
    r = Resources(devices=SAME_AS_V1[name])
    v1, p1 = make("v1")
    v1.apply(r)
    v2, p2 = make("v2")
    v2.apply(r)
    want = p1.allowed(ALL_PROBES)
    assert p2.allowed(ALL_PROBES) == want
    assert any(want.values()) or name == "deny-all"
