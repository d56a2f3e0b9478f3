"""tests/cgroup2: tests that need a real cgroup v2 (unified) host. On any other host they skip;
`make test-cgroup2` runs them inside a qemu guest that boots Debian 12's kernel with a cgroup2-only
/sys/fs/cgroup (tests/vm/lane.py). The integration fixtures (`quark`, `bundle`) are shared here."""
from __future__ import annotations

import pytest

from qlib.errors import QuarkError
from qvisor import cgroups
from tests.integration.conftest import bundle, quark  # noqa: F401  (fixtures for this directory)

V2_REASON = "needs a cgroup v2 host: run `make test-cgroup2` (qemu guest)"


def _unified() -> bool:
    try:
        return cgroups.detect() == "v2"
    except QuarkError:   # no /sys/fs/cgroup at all
        return False


UNIFIED = _unified()


@pytest.fixture(autouse=True)
def _needs_cgroup2() -> None:
    if not UNIFIED:
        pytest.skip(V2_REASON)
