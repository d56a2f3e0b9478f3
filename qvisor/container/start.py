"""quark start (from Python: the C front end goes to the supervisor itself, qvisor/frontend.c)."""
from __future__ import annotations

from qlib.errors import InvalidState
from qvisor.client import Connection
from qvisor.container.common import saved_spec, state
from qvisor.state import CREATED, StateStore


def start(root: str, container_id: str) -> None:
    st = state(root, container_id)
    if st.status != CREATED:
        raise InvalidState(f"cannot start a container in the {st.status} state")
    store = StateStore(root)
    with Connection(store.dir(container_id)) as c:
        c.call({"op": "start"})
    # like runc, the runtime (not the sandbox's supervisor) runs poststart, after start succeeded
    spec = saved_spec(store, st, only_if_hook="poststart")
    if spec is not None:
        from qvisor import hooks
        hooks.run_hooks("poststart", spec.hooks.poststart, state(root, container_id).oci(), fatal=False)
