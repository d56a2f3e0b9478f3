"""Hibernation (quark snapshot): the requests; qvisor/supervisor/snapshot.py does the work."""
from __future__ import annotations

from qlib.errors import InvalidState
from qvisor.client import Connection
from qvisor.state import RUNNING, StateStore


def hibernate(root: str, container_id: str, reason: str = "request") -> dict:
    """Freeze the container and page its memory out; returns the supervisor's account of it."""
    store = StateStore(root)
    st = store.load(container_id)
    if store.hibernation(container_id) is not None or st.status == RUNNING:
        with Connection(store.dir(container_id)) as c:
            return c.call({"op": "hibernate", "reason": reason})[0]
    raise InvalidState(f"cannot hibernate container {container_id!r}: it is {st.status} (only a running "
                       "container can be)")


def wake(root: str, container_id: str, prefetch: bool = True) -> dict:
    store = StateStore(root)
    store.load(container_id)   # an unknown id says so
    if store.hibernation(container_id) is None:
        raise InvalidState(f"container {container_id!r} is not hibernated")
    with Connection(store.dir(container_id)) as c:
        return c.call({"op": "wake", "prefetch": prefetch})[0]


def snapshot_info(root: str, container_id: str) -> dict:
    store = StateStore(root)
    store.load(container_id)
    with Connection(store.dir(container_id)) as c:
        return c.call({"op": "snapshot"})[0]
