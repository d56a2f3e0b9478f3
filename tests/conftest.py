"""Session-wide clean-up: the parent cgroups quark and containerd create for the tests' containers
(`/quark` by default, `/<containerd namespace>`, the tests' own `/quark-*` paths) are removed at the
end of the session when they are empty and did not exist before it. A non-empty one is left alone:
that is a leaked container, which the per-test checks report."""
from __future__ import annotations

import os

import pytest

CGROUP_ROOT = "/sys/fs/cgroup"


def _quark_cgroup_dirs() -> set[str]:
    found = set()
    if not os.path.isdir(CGROUP_ROOT):
        return found
    tops = [CGROUP_ROOT] if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")) else [
        os.path.join(CGROUP_ROOT, h) for h in os.listdir(CGROUP_ROOT)]
    for top in tops:
        try:
            names = os.listdir(top)
        except OSError:
            continue
        found.update(os.path.join(top, n) for n in names
                     if n.startswith("quark") and os.path.isdir(os.path.join(top, n)))
    return found


@pytest.fixture(scope="session", autouse=True)
def remove_parent_cgroups_made_by_the_session():
    before = _quark_cgroup_dirs()
    yield
    if os.geteuid() != 0:
        return
    for top in sorted(_quark_cgroup_dirs() - before):
        for d, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(d)
            except OSError:
                pass   # not empty: something still lives there
