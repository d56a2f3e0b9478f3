"""quark update: new linux.resources applied to a live container's cgroup."""
from __future__ import annotations

import dataclasses
import json
import os

from qlib.errors import InvalidState
from qvisor import cgroups
from qvisor.container.common import CONFIG_COPY, DEVICE_UPDATES, state
from qvisor.state import CREATED, PAUSED, RUNNING, ContainerState, StateStore


def update(root: str, container_id: str, resources: dict, source: str) -> None:
    """Apply new linux.resources (the decoded JSON object; errors name `source`) to a live
    container's cgroup."""
    from qvisor.spec import parse_resources
    st = state(root, container_id)
    if st.status not in (CREATED, RUNNING, PAUSED):
        raise InvalidState(f"container {container_id!r} is not running (status {st.status})")
    res = parse_resources(resources, source)
    cg = cgroups.open_cgroup(st.cgroup_path)
    if not (res.devices and cg.version == "v2"):
        cg.apply(res)
        return
    store = StateStore(root)
    rules, updates = _devices_after_update(store, st, resources["devices"])
    cg.apply(dataclasses.replace(res, devices=rules))
    path = store.path(st.id, DEVICE_UPDATES)   # kept once applied, for the next update
    with open(path + ".tmp", "w") as f:
        json.dump(updates, f)
    os.replace(path + ".tmp", path)


def _devices_after_update(store: StateStore, st: ContainerState, new_rules: list) -> tuple[list, list]:
    """Every device rule of a container after an update adds `new_rules`: on v2 they become one
    eBPF program that replaces the last one, so it must hold the rules of the create (the spec's,
    the defaults, the container's own devices) and of every update so far, in order, the last
    match winning as on v1 (where an update only appends rules to the kernel's list)."""
    from qvisor.devices import cgroup_resources
    from qvisor.spec import parse_resources, parse_spec
    path = store.path(st.id, DEVICE_UPDATES)
    try:
        with open(path) as f:
            updates = json.load(f)
    except FileNotFoundError:
        updates = []
    with open(store.path(st.id, CONFIG_COPY)) as f:
        spec = parse_spec(json.load(f), store.path(st.id, CONFIG_COPY), st.bundle)
    updates += new_rules
    return cgroup_resources(spec).devices + parse_resources({"devices": updates}, path).devices, updates
