"""TSoR's socket-option offload (tsor/sockopt_offload.py): the cgroup BPF programs of
tsor/bpf/sockopt.bpf.c answer TCP_NODELAY/TCP_CORK on AF_UNIX sockets made in quark's cgroup, and
nothing else.

Each check runs in a forked child that joins a scratch cgroup of its own (the test process never
moves); the cgroup, and with it the programs, is removed at the end. Needs root and a cgroup2
hierarchy (loading cgroup BPF programs)."""
from __future__ import annotations

import errno
import json
import os
import socket

import pytest

from qlib import bpf
from tsor import sockopt_offload as so

NODELAY, CORK = socket.TCP_NODELAY, socket.TCP_CORK


@pytest.fixture
def cgroup():
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroup BPF programs)")
    root = so.cgroup2_root()
    if root is None:
        pytest.skip("needs a cgroup2 hierarchy")
    name = f"quark-tsor-test-{os.getpid()}"
    yield root, name
    assert so.remove_if_unused(root, name)
    assert not os.path.exists(os.path.join(root, name))


def _in_child(root: str, name: str, body) -> dict:
    """Run body() in a child that joined the cgroup; its JSON-able answer."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = {"joined": so.join(root, name) is not None, **body()}
        except Exception as e:   # reported, not raised: this is a forked pytest
            out = {"error": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _try(f):
    try:
        return f()
    except OSError as e:
        return -e.errno


def test_local_path_style_ends_take_nodelay_and_cork_and_read_them_back(cgroup):
    def body():
        a, b = socket.socketpair()
        got = {"fresh": [a.getsockopt(6, CORK), a.getsockopt(6, NODELAY)]}
        a.setsockopt(6, CORK, 1)
        got["corked"] = [a.getsockopt(6, CORK), a.getsockopt(6, NODELAY), b.getsockopt(6, CORK)]
        a.setsockopt(6, NODELAY, 7)   # any non-zero is on; read back as 1, as on TCP
        a.setsockopt(6, CORK, 0)
        got["uncorked"] = [a.getsockopt(6, CORK), a.getsockopt(6, NODELAY)]
        got["short_set"] = _try(lambda: a.setsockopt(6, CORK, b"\1"))   # the trap's EINVAL to give
        got["other_tcp_option"] = _try(lambda: a.setsockopt(6, socket.TCP_KEEPIDLE, 5))
        got["other_get"] = _try(lambda: a.getsockopt(6, socket.TCP_KEEPIDLE))
        t = socket.socket()
        t.setsockopt(6, CORK, 1)
        got["tcp"] = t.getsockopt(6, CORK)
        return got
    got = _in_child(*cgroup, body)
    assert got == {"joined": True, "fresh": [0, 0], "corked": [1, 0, 0], "uncorked": [0, 1],
                   "short_set": -errno.EOPNOTSUPP, "other_tcp_option": -errno.EOPNOTSUPP,
                   "other_get": -errno.EOPNOTSUPP, "tcp": 1}


def test_sockets_made_outside_the_cgroup_keep_linuxs_answer(cgroup):
    made_before = socket.socketpair()   # made here, outside: the child only uses it after joining

    def body():
        return {"before": _try(lambda: made_before[0].setsockopt(6, CORK, 1))}
    assert _in_child(*cgroup, body) == {"joined": True, "before": -errno.EOPNOTSUPP}
    a, _ = socket.socketpair()
    assert _try(lambda: a.setsockopt(6, CORK, 1)) == -errno.EOPNOTSUPP


def test_a_second_process_reuses_the_attached_programs(cgroup):
    root, name = cgroup
    _in_child(root, name, dict)
    fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = {t: bpf.query(fd, t)[1] for t in (bpf.CGROUP_SETSOCKOPT, bpf.CGROUP_GETSOCKOPT)}
        assert all(len(ids) == 1 for ids in first.values())
        assert _in_child(root, name, dict) == {"joined": True}
        assert {t: bpf.query(fd, t)[1] for t in first} == first
    finally:
        os.close(fd)


def test_without_a_cgroup2_hierarchy_nothing_is_offloaded(tmp_path):
    assert so.join(str(tmp_path)) is None   # not a cgroup2 mount: writing cgroup.procs fails
