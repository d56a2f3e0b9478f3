"""Session-wide clean-up: the parent cgroups made for the tests' containers are removed at the end
of the session when they are empty and did not exist before it (tests/cleanup.py)."""
from __future__ import annotations

import pytest

from tests.cleanup import quark_cgroup_dirs, remove_empty_since


@pytest.fixture(scope="session", autouse=True)
def remove_parent_cgroups_made_by_the_session():
    before = quark_cgroup_dirs()
    yield
    remove_empty_since(before)
