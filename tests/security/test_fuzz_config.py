"""Fuzzing config.json: random mutations of a valid spec never crash quark, and a failed create
leaves nothing behind.

* The parser, in process (many examples): parse_spec + check_supported either accept the spec or
  raise a ConfigError/QuarkError whose message is `<file>: <field>: <reason>` — never another
  exception (the CLI would print a traceback). A replaced or deleted value is named by its field
  (or an enclosing one).
* Real `quark create`s (a sample): values that pass the parser but can break set-up (odd args and
  env, hostnames, mounts, devices, sysctls, rlimits, masked paths, propagation, hooks, resources).
  Exit 0 or 1, `quark: <message>` and no traceback; after a failure, or a successful create and
  `delete --force`: no state directory, no cgroup, no mount and no process left.
"""
from __future__ import annotations

import atexit
import copy
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlib.errors import ConfigError, QuarkError
from qvisor.spec import CAPABILITIES, PROPAGATIONS, RLIMITS, default_spec, parse_spec
from tests.security.conftest import edit_config, record, uid

PARSER_EXAMPLES = int(os.environ.get("QUARK_FUZZ_PARSER_EXAMPLES", 600))
CREATE_EXAMPLES = int(os.environ.get("QUARK_FUZZ_CREATE_EXAMPLES", 16))
COUNTS: dict[str, int] = {"accepted": 0, "refused": 0}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


def node_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from node_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from node_paths(v, prefix + (i,))


def dotted(path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


@st.composite
def mutated(draw):
    spec = default_spec()
    muts = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([p for p in node_paths(spec) if p]))
        parent = spec
        for p in path[:-1]:
            parent = parent[p]
        kind = draw(st.sampled_from(["delete", "replace", "add"]))
        if kind == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif kind == "add" and isinstance(parent, (dict, list)):
            value = draw(json_values)
            if isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = value
            else:
                parent.append(value)
                path = path[:-1] + (len(parent) - 1,)
        else:
            kind = "replace"
            parent[path[-1]] = draw(json_values)
        muts.append((kind, path))
    return spec, muts


def related(field: str, path) -> bool:
    """Does the error's field name the mutated node, an enclosing one or one inside it?"""
    target = dotted(path)
    return field == target or target.startswith(field + ".") or target.startswith(field + "[") \
        or field.startswith(target + ".") or field.startswith(target + "[")


BUNDLE = tempfile.mkdtemp(prefix="quark-fuzz-bundle-")   # root.path "rootfs" exists: check_supported passes
os.mkdir(os.path.join(BUNDLE, "rootfs"))
atexit.register(shutil.rmtree, BUNDLE, True)


@settings(max_examples=PARSER_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(mutated())
def test_parser_never_crashes_and_names_the_field(case):
    from qvisor.validate import check_supported
    spec, muts = case
    cfg = os.path.join(BUNDLE, "config.json")
    try:
        parsed = parse_spec(copy.deepcopy(spec), cfg, BUNDLE)
        check_supported(parsed)
        COUNTS["accepted"] += 1
    except ConfigError as e:
        COUNTS["refused"] += 1
        assert str(e).startswith(cfg + ": ")
        assert e.field or e.message == "must contain a JSON object", str(e)
        if len(muts) == 1 and muts[0][0] in ("replace", "delete"):
            kind, path = muts[0]
            # a deleted required field is named; a replaced value is named, or an enclosing field
            # that its change makes invalid (a duplicate, a missing partner: uidMappings/user), or,
            # once a namespace is gone, a setting that needed it (hostname, mounts, a sysctl)
            assert related(e.field, path) or e.field.startswith(("linux.namespaces", "linux.uidMappings",
                                                                  "linux.gidMappings")) \
                or related("linux.namespaces", path), (str(e), muts)
    except QuarkError as e:
        COUNTS["refused"] += 1
        assert str(e), muts
    record("fuzz: config.json parser", "quark",
           f"{PARSER_EXAMPLES} mutated specs: {COUNTS['accepted']} accepted, {COUNTS['refused']} refused with a "
           "named field, 0 crashes")


# ---- real creates -------------------------------------------------------------------------------

paths = st.sampled_from(["/", "/proc", "/proc/self", "/dev/null", "/sys/kernel", "/etc/../..", "/tmp/x y",
                         "/a/" + "b" * 200, "/dev/pts", "/proc/self/fd/3", "/\u00e9t\u00e9", "/run/../proc/1"]) \
    | st.text(min_size=1, max_size=30).map(lambda s: "/" + s)
texts = st.text(max_size=70)


@st.composite
def setup_mutation(draw, bundle_dir: str):
    """A spec edit that passes the parser (mostly) but may break set-up."""
    choice = draw(st.sampled_from(["args", "env", "hostname", "mount", "device", "sysctl", "rlimit", "masked",
                                   "propagation", "hook", "resources", "user", "caps", "cwd"]))
    if choice == "args":
        v = [draw(texts) or "x", draw(texts)]
        return choice, lambda s: s["process"].__setitem__("args", v)
    if choice == "env":
        v = [draw(texts), draw(texts) + "=" + draw(texts)]
        return choice, lambda s: s["process"].__setitem__("env", v)
    if choice == "cwd":
        v = draw(paths)
        return choice, lambda s: s["process"].__setitem__("cwd", v)
    if choice == "hostname":
        v = draw(texts)
        return choice, lambda s: s.__setitem__("hostname", v)
    if choice == "mount":
        m = {"destination": draw(paths), "type": draw(st.sampled_from(["tmpfs", "proc", "sysfs", "bind", "devpts",
                                                                      "mqueue", "cgroup", "nosuchfs", ""])),
             "source": draw(st.sampled_from(["tmpfs", "none", "/dev/null", "/nonexistent", bundle_dir, "rootfs/bin"])),
             "options": draw(st.lists(st.sampled_from(["ro", "rw", "rbind", "bind", "nosuid", "size=1k", "size=x",
                                                       "mode=7777", "rshared", "unbindable", "private", "remount",
                                                       "foo=bar", "idmap", "nodev", "noexec"]), max_size=4))}
        return choice, lambda s: s["mounts"].append(m)
    if choice == "device":
        d = {"path": draw(paths), "type": draw(st.sampled_from(["c", "b", "p", "u"])),
             "major": draw(st.integers(0, 2**32)), "minor": draw(st.integers(0, 2**32)),
             "fileMode": draw(st.integers(0, 2**32 - 1))}
        return choice, lambda s: s["linux"].setdefault("devices", []).append(d)
    if choice == "sysctl":
        kv = {draw(st.sampled_from(["net.ipv4.ip_forward", "kernel.shmmax", "net.core.somaxconn", "fs.mqueue.msg_max",
                                    "kernel.hostname", "net.nosuch.key"])): draw(texts)}
        return choice, lambda s: s["linux"].__setitem__("sysctl", kv)
    if choice == "rlimit":
        soft = draw(st.integers(0, 2**64 - 1))
        r = {"type": draw(st.sampled_from(sorted(RLIMITS))), "soft": soft, "hard": draw(st.integers(soft, 2**64 - 1))}
        return choice, lambda s: s["process"].__setitem__("rlimits", [r])
    if choice == "masked":
        v = draw(st.lists(paths, min_size=1, max_size=3))
        key = draw(st.sampled_from(["maskedPaths", "readonlyPaths"]))
        return choice, lambda s: s["linux"].__setitem__(key, v)
    if choice == "propagation":
        v = draw(st.sampled_from(PROPAGATIONS))
        return choice, lambda s: s["linux"].__setitem__("rootfsPropagation", v)
    if choice == "hook":
        h = {"path": draw(st.sampled_from(["/bin/false", "/nonexistent/hook", "/bin/sh"])),
             "args": ["hook", "-c", "exit 3"], "timeout": draw(st.integers(1, 3))}
        kind = draw(st.sampled_from(["prestart", "createRuntime", "createContainer", "startContainer"]))
        return choice, lambda s: s.setdefault("hooks", {}).__setitem__(kind, [h])
    if choice == "resources":
        r = draw(st.fixed_dictionaries({}, optional={
            "memory": st.fixed_dictionaries({"limit": st.integers(-1, 2**40) | st.integers(4096, 4 << 20)}),
            "pids": st.fixed_dictionaries({"limit": st.integers(-1, 10)}),
            "cpu": st.fixed_dictionaries({}, optional={"shares": st.integers(0, 2**20), "quota": st.integers(-1, 10**6),
                                                       "cpus": st.sampled_from(["0", "0-1", "99", "x", ""])})}))
        return choice, lambda s: s["linux"].setdefault("resources", {}).update(r)
    if choice == "user":
        u = {"uid": draw(st.integers(0, 2**32 - 1)), "gid": draw(st.integers(0, 2**32 - 1)),
             "additionalGids": draw(st.lists(st.integers(0, 2**32 - 1), max_size=3))}
        return choice, lambda s: s["process"].__setitem__("user", u)
    caps = draw(st.lists(st.sampled_from(sorted(CAPABILITIES)), max_size=5))
    return choice, lambda s: s["process"].__setitem__("capabilities", {k: caps for k in ("bounding", "effective",
                                                                                        "permitted", "ambient")})


# What a config.json could change on the host if quark applied it outside the container's own
# namespaces: the host's names and the namespaced sysctls the fuzzers write.
HOST_FILES = ["/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/kernel/shmmax",
              "/proc/sys/kernel/shmmni", "/proc/sys/kernel/msgmax", "/proc/sys/fs/mqueue/msg_max",
              "/proc/sys/fs/mqueue/queues_max", "/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/core/somaxconn",
              "/proc/sys/net/ipv4/ip_default_ttl"]


def host_values() -> dict[str, str]:
    out = {}
    for path in HOST_FILES:
        with open(path) as f:
            out[path] = f.read()
    return out


def assert_nothing_left(quark, cid: str, bundle_dir: str, cgroup_path: str) -> None:
    from tests.integration.conftest import cgroup_dirs
    assert cid not in quark.ids()
    assert cgroup_dirs(cgroup_path) == []
    assert [ln for ln in open("/proc/self/mountinfo") if bundle_dir in ln] == []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if bundle_dir in open(f"/proc/{pid}/cmdline").read() or os.readlink(f"/proc/{pid}/cwd").startswith(bundle_dir):
                raise AssertionError(f"process {pid} still uses {bundle_dir}")
        except OSError:
            continue


CREATES: dict[str, int] = {"created": 0, "refused": 0}


def remove_fuzz_cgroups(paths: list[str]) -> None:
    """After a failure mid-create: kill what is left in our own cgroups, remove them and their parent."""
    import signal

    from qvisor import cgroups
    for path in paths:
        cg = cgroups.open_cgroup(path)
        if any(os.path.isdir(d) for d in cg.dirs()):
            try:
                cg.kill_all(signal.SIGKILL)
                cg.destroy()
            except Exception:  # noqa: BLE001 - best effort; the assertions already failed the test
                pass
    for d in os.listdir("/sys/fs/cgroup"):
        try:
            os.rmdir(f"/sys/fs/cgroup/{d}/quark-sec-fuzz")
        except OSError:
            pass


@pytest.mark.root
def test_create_with_fuzzed_specs_fails_cleanly(quark, bundle):
    b = bundle(["true"])
    with open(os.path.join(b, "config.json")) as f:
        pristine = f.read()
    seen: list[str] = []
    made: list[str] = []

    @settings(max_examples=CREATE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.data())
    def one(data):
        with open(os.path.join(b, "config.json"), "w") as f:
            f.write(pristine)
        choice, edit = data.draw(setup_mutation(b))
        cid = uid("fuzz")
        cgroup_path = f"/quark-sec-fuzz/{cid}"
        made.append(cgroup_path)

        def apply(s: dict) -> None:
            edit(s)
            s["linux"]["cgroupsPath"] = cgroup_path    # never a host cgroup, whatever the mutation
        edit_config(b, apply)
        if os.environ.get("QUARK_FUZZ_VERBOSE"):
            print(choice, open(os.path.join(b, "config.json")).read()[-600:], flush=True)
        t0 = time.monotonic()
        host_before = host_values()
        try:
            r = quark("create", "--bundle", b, cid, check=False, timeout=30)
        except subprocess.TimeoutExpired:
            with open(os.path.join(b, "config.json")) as f:
                raise AssertionError(f"quark create hung ({choice}): {f.read()}") from None
        if os.environ.get("QUARK_FUZZ_VERBOSE"):
            print("->", r.returncode, f"{time.monotonic() - t0:.2f}s", r.stderr.strip()[:200], flush=True)
        assert r.returncode in (0, 1), (choice, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, (choice, r.stderr)
        if r.returncode == 0:
            CREATES["created"] += 1
            quark("delete", "--force", cid)
        else:
            CREATES["refused"] += 1
            assert re.match(r"quark: \S", r.stderr), r.stderr
            seen.append(f"{choice}: {r.stderr.strip()[:160]}")
        assert_nothing_left(quark, cid, b, cgroup_path)
        assert host_values() == host_before, choice

    try:
        one()
    finally:
        remove_fuzz_cgroups(made)
    print("\n".join(seen))
    record("fuzz: quark create with set-up-breaking specs", "quark",
           f"{CREATES['created']} created and deleted, {CREATES['refused']} refused with a message; no traceback, "
           "nothing left")


@pytest.mark.root
@pytest.mark.parametrize("limit", [64 * 1024, 680 * 1024, 1 << 20])
def test_create_under_a_tight_memory_limit_fails_cleanly(quark, bundle, limit):
    """Found by the fuzzer: with ~680 KiB the OOM killer took stage 1 after it forked the init and
    before it reported the init's pid; `quark create` then waited forever."""
    b = bundle(["true"])
    cid = uid("oom")
    cgroup_path = f"/quark-sec-fuzz/{cid}"

    def edit(s: dict) -> None:
        s["linux"]["resources"]["memory"] = {"limit": limit}
        s["linux"]["cgroupsPath"] = cgroup_path
    edit_config(b, edit)
    try:
        r = quark("create", "--bundle", b, cid, check=False, timeout=30)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
        if r.returncode == 0:
            quark("delete", "--force", cid)
        assert_nothing_left(quark, cid, b, cgroup_path)
    finally:
        remove_fuzz_cgroups([cgroup_path])


# ---- host namespaces: nothing reaches the host ---------------------------------------------------

HOST_NS_EXAMPLES = int(os.environ.get("QUARK_FUZZ_HOST_NS_EXAMPLES", 14))
HOST_SETTINGS = ["kernel.shmmax", "kernel.shmmni", "kernel.msgmax", "fs.mqueue.msg_max", "fs.mqueue.queues_max",
                 "net.ipv4.ip_forward", "net.core.somaxconn", "net/ipv4/ip_default_ttl", "kernel.hostname",
                 "kernel.domainname"]


@st.composite
def host_namespace_spec(draw):
    """Some of the uts, ipc, network and mount namespaces left out (inherited: the host's) or
    joined by a path naming the runtime's own, with names and sysctls that would land there."""
    kinds = draw(st.lists(st.sampled_from(["uts", "ipc", "network", "mount"]), min_size=1, unique=True))
    joined = {k: draw(st.booleans()) for k in kinds}
    proc = {"uts": "uts", "ipc": "ipc", "network": "net", "mount": "mnt"}
    names = {k: draw(st.sampled_from(["", "fuzzhost"])) for k in ("hostname", "domainname")}
    sysctl = {k: draw(st.sampled_from(["7", "1", "64"]))
              for k in draw(st.lists(st.sampled_from(HOST_SETTINGS), max_size=3, unique=True))}
    strip_mounts = draw(st.booleans())

    def edit(s):
        s["linux"]["namespaces"] = [ns for ns in s["linux"]["namespaces"] if ns["type"] not in kinds]
        s["linux"]["namespaces"] += [{"type": k, "path": f"/proc/self/ns/{proc[k]}"} for k in kinds if joined[k]]
        s.update(names)
        s["linux"]["sysctl"] = sysctl
        if strip_mounts:   # without them a container without its own mount namespace gets further
            s["mounts"] = []
            s["linux"].pop("maskedPaths", None)
            s["linux"].pop("readonlyPaths", None)
            s["root"]["readonly"] = False
    return f"{sorted(kinds)} joined={joined} {names} {sysctl}", edit


@pytest.mark.root
def test_settings_for_host_namespaces_never_change_the_host(quark, bundle):
    b = bundle(["true"])
    with open(os.path.join(b, "config.json")) as f:
        pristine = f.read()
    made: list[str] = []
    outcomes = {"created": 0, "refused": 0}

    @settings(max_examples=HOST_NS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(host_namespace_spec())
    def one(case):
        what, edit = case
        with open(os.path.join(b, "config.json"), "w") as f:
            f.write(pristine)
        cid = uid("hostns")
        cgroup_path = f"/quark-sec-fuzz/{cid}"
        made.append(cgroup_path)
        edit_config(b, lambda s: (edit(s), s["linux"].__setitem__("cgroupsPath", cgroup_path)))
        before = host_values()
        r = quark("run", "--bundle", b, cid, check=False, timeout=30)
        assert "Traceback" not in r.stderr, (what, r.stderr)
        outcomes["created" if r.returncode == 0 else "refused"] += 1
        if r.returncode:
            assert re.match(r"quark: .*config.json: \S", r.stderr), (what, r.stderr)
        assert host_values() == before, what
        assert_nothing_left(quark, cid, b, cgroup_path)

    try:
        one()
    finally:
        remove_fuzz_cgroups(made)
    record("fuzz: settings for the host's namespaces", "quark",
           f"{outcomes['created']} ran, {outcomes['refused']} refused naming the field; host names and "
           "sysctls unchanged after every one")
