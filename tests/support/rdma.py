"""The host's RDMA device for the tests marked rdma_device, or a skip that says where they run."""
from __future__ import annotations

import pytest

from tsor.verbs import NoDevice
from tsor.verbs.pyverbs_provider import PyverbsDevice, open_device


def device_or_skip() -> PyverbsDevice:
    """The first RDMA device through pyverbs (the caller closes it); skips the test without one."""
    try:
        return open_device()
    except NoDevice as e:   # "no RDMA device (...)"
        pytest.skip(f"{e}: `make test-rdma` runs these on soft-RoCE in a qemu guest")
