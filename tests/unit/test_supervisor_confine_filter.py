"""The supervisor's own seccomp filter (qvisor/confine.py) is compiled once per outcome, kept as BPF
(the sandbox factory compiles the usual one before it forks supervisors) and loaded as it is."""
from __future__ import annotations

import ast
import errno
import os

import pytest

from qlib import linux as L
from qvisor import confine


def test_the_filter_key_names_only_the_grants_a_container_gets():
    assert confine.filter_key("seccomp", False, frozenset({"CAP_KILL"}), frozenset({"pid", "mount"})) == \
        (False, False, ())
    admin = confine.filter_key("seccomp", False, frozenset({"CAP_SYS_ADMIN"}), frozenset({"mount", "uts"}))
    assert {"mount", "sethostname"} <= set(admin[2]) and "reboot" not in admin[2]
    assert confine.filter_key("ptrace", True, frozenset(), frozenset()) == (True, True, ())


def test_each_outcome_is_compiled_once_and_a_grant_compiles_another(monkeypatch):
    compiled = []
    real = confine._compile
    monkeypatch.setattr(confine, "_COMPILED", {})
    monkeypatch.setattr(confine, "_compile", lambda *key: compiled.append(key) or real(*key))
    monkeypatch.setattr(confine, "_load_bpf", lambda bpf: None)
    for caps in (frozenset(), frozenset({"CAP_KILL"}), frozenset({"CAP_SYS_ADMIN"})):   # no grant without "mount"
        confine.install_filter("seccomp", False, caps, frozenset({"pid"}))
    assert compiled == [(False, False, ())]
    confine.install_filter("seccomp", False, frozenset({"CAP_SYS_ADMIN"}), frozenset({"mount"}))
    assert len(compiled) == 2 and "mount" in compiled[1][2]
    assert confine._COMPILED[compiled[0]] != confine._COMPILED[compiled[1]]


@pytest.mark.skipif(os.geteuid() != 0, reason="loading a seccomp filter without no_new_privs needs root")
def test_the_loaded_filter_denies_what_the_supervisor_never_does():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the filter stays with this process: a child of the test's
        code = 1
        try:
            confine.install_filter("seccomp", False, frozenset(), frozenset())
            got = []
            for call in (lambda: os.chroot("/"), lambda: L.unshare(L.CLONE_NEWNS), os.getpid):
                try:
                    call()
                    got.append(0)
                except OSError as e:
                    got.append(e.errno)
            with open("/proc/self/status") as f:
                got += [ln.split()[1] for ln in f if ln.startswith(("Seccomp:", "NoNewPrivs:"))]
            os.write(w, repr(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # chroot and unshare answer EPERM, the rest runs; a filter (mode 2) without no_new_privs
    assert ast.literal_eval(out) == [errno.EPERM, errno.EPERM, 0, "0", "2"]
