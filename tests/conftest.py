"""Session-wide clean-up: the parent cgroups made for the tests' containers are removed at the end
of the session when they are empty and did not exist before it (tests/cleanup.py); the sandbox
factory the tests' creates start (qvisor/factory/) serves a directory of the session's own, never
the host's /run/quark, and is stopped at the end."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.cleanup import quark_cgroup_dirs, remove_empty_since


@pytest.fixture(scope="session", autouse=True)
def remove_parent_cgroups_made_by_the_session():
    before = quark_cgroup_dirs()
    yield
    remove_empty_since(before)


@pytest.fixture(scope="session", autouse=True)
def sandbox_factory_of_the_session():
    from qvisor.factory import client
    where = tempfile.mkdtemp(prefix="quark-factory-")
    old = os.environ.get("QUARK_FACTORY_DIR")
    os.environ["QUARK_FACTORY_DIR"] = where   # inherited by every quark, shim and containerd started
    yield where
    client.stop(where)
    if old is None:
        os.environ.pop("QUARK_FACTORY_DIR", None)
    else:
        os.environ["QUARK_FACTORY_DIR"] = old
    shutil.rmtree(where, ignore_errors=True)
