"""What several verbs share: a container's state, its saved config and --preserve-fds."""
from __future__ import annotations

import json
import os

from qlib.errors import InvalidArgument, QuarkError
from qvisor.state import ContainerState, StateStore

CONFIG_COPY = "config.json"              # the bundle's config.json as the create read it
DEVICE_UPDATES = "device-updates.json"   # rules `quark update` added (cgroup v2 rebuilds its program)


def state(root: str, container_id: str) -> ContainerState:
    return StateStore(root).load(container_id)


def preserved_fds(count: int) -> list[int]:
    """The caller's fds that --preserve-fds N passes to the container's process: 3 .. 2+N, which
    must be open (they cannot be the runtime's own: those open above the caller's)."""
    if count < 0:
        raise InvalidArgument(f"--preserve-fds {count}: must not be negative")
    for fd in range(3, 3 + count):
        try:
            os.fstat(fd)
        except OSError:
            raise InvalidArgument(f"--preserve-fds {count}: fd {fd} is not open") from None
    return list(range(3, 3 + count))


def config_process(root: str, container_id: str) -> dict:
    """The container's own process object, the base of `quark exec ARGS`."""
    state(root, container_id)  # an unknown id says so
    with open(StateStore(root).path(container_id, CONFIG_COPY)) as f:
        return dict(json.load(f).get("process") or {})


def saved_spec(store: StateStore, st: ContainerState, only_if_hook: str):
    """The container's saved config, parsed only if it has `only_if_hook` hooks (parsing is the
    slow part and most containers have none); None otherwise or if it cannot be read."""
    from qvisor.spec import parse_spec
    try:
        with open(store.path(st.id, CONFIG_COPY)) as f:
            raw = json.load(f)
        if not (raw.get("hooks") or {}).get(only_if_hook):
            return None
        return parse_spec(raw, store.path(st.id, CONFIG_COPY), st.bundle)
    except (OSError, ValueError, AttributeError, QuarkError):
        return None
