"""Policy kinds tsord does not evaluate, found through API discovery, and where they apply.

tsord evaluates NetworkPolicy (networking.k8s.io/v1, tsor/netpol.py) and nothing else. A cluster
whose network plugin enforces kinds of its own — Calico's NetworkPolicy and GlobalNetworkPolicy
(crd.projectcalico.org, projectcalico.org), Cilium's CiliumNetworkPolicy and
CiliumClusterwideNetworkPolicy (cilium.io), Antrea's (crd.antrea.io), the AdminNetworkPolicy API
(policy.networking.k8s.io) — enforces them in the node's packet filters, which a connection TSoR
carries never meets. So tsord fails closed on them: a connection such a policy could govern goes
native, where the plugin decides it.

Which kinds: every resource whose kind ends in "NetworkPolicy" (any group: the convention every
plugin above follows) and every kind of policy.networking.k8s.io, but networking.k8s.io's own
NetworkPolicy; found in each group's preferred version, from the API's discovery documents
(/apis, then /apis/GROUP/VERSION), again every `discovery_seconds` so that the choice follows
kinds appearing and disappearing (a plugin installed or removed).

Where: a namespaced kind governs connections from or to pods of the namespaces that hold objects of
it (tsord lists and watches the kind for their namespaces only); a cluster-wide kind with objects
governs every connection; and a kind tsord cannot list (RBAC forbids it, the list fails) or has not
listed yet governs every connection too, since its objects are unknown.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

EVALUATED = frozenset({("networking.k8s.io", "NetworkPolicy")})
POLICY_GROUPS = frozenset({"policy.networking.k8s.io"})   # every kind of it is a policy


@dataclass(frozen=True)
class ForeignKind:
    """A policy kind the cluster serves and tsord does not evaluate."""
    group: str
    version: str
    resource: str          # the collection's name in URLs (plural)
    kind: str
    namespaced: bool

    @property
    def path(self) -> str:
        """Its collection across all namespaces."""
        return f"/apis/{self.group}/{self.version}/{self.resource}"

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.group}/{self.version})"


def is_policy(group: str, kind: str) -> bool:
    """Is `kind` of `group` a network policy kind tsord does not evaluate?"""
    return (group, kind) not in EVALUATED and (kind.endswith("NetworkPolicy") or group in POLICY_GROUPS)


def foreign_kinds(groups: dict, resources: Callable[[str], dict | None]) -> list[ForeignKind]:
    """The policy kinds tsord does not evaluate, from an APIGroupList (`groups`, GET /apis) and
    `resources(group_version)`, the APIResourceList of GET /apis/GROUP/VERSION (None: that group
    version is not served after all, as when its CRD goes between the two requests)."""
    found = []
    for group in groups.get("groups") or ():
        name = group.get("name") or ""
        preferred = (group.get("preferredVersion") or {}).get("groupVersion")
        if not preferred:
            versions = group.get("versions") or ()
            preferred = versions[0].get("groupVersion") if versions else None
        if not name or not preferred:
            continue
        listing = resources(preferred)
        for r in (listing or {}).get("resources") or ():
            resource, kind = r.get("name") or "", r.get("kind") or ""
            if "/" in resource or not is_policy(name, kind):
                continue   # (a subresource: status, scale)
            found.append(ForeignKind(name, preferred.split("/", 1)[1], resource, kind, bool(r.get("namespaced"))))
    return sorted(found, key=lambda k: (k.group, k.kind))


class _State:
    def __init__(self, kind: ForeignKind) -> None:
        self.kind = kind
        self.listed = False
        self.unreadable: str | None = None             # why it cannot be listed
        self.objects: set[tuple[str, str]] = set()     # (namespace, name): "" namespace for cluster-wide
        self.namespaces: Counter[str] = Counter()      # objects per namespace: what a decision reads

    def replace(self, keys: list[tuple[str, str]]) -> None:
        self.objects = set(keys)
        self.namespaces = Counter(ns for ns, _ in self.objects)

    def put(self, key: tuple[str, str], present: bool) -> None:
        if present and key not in self.objects:
            self.objects.add(key)
            self.namespaces[key[0]] += 1
        elif not present and key in self.objects:
            self.objects.discard(key)
            self.namespaces[key[0]] -= 1
            if not self.namespaces[key[0]]:
                del self.namespaces[key[0]]


class ForeignPolicies:
    """The foreign kinds served now and where their objects are (the route source keeps it)."""

    def __init__(self, changed: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._kinds: dict[ForeignKind, _State] = {}
        self.discovered = False
        self.changed = changed

    def set_kinds(self, kinds: list[ForeignKind]) -> tuple[list[ForeignKind], list[ForeignKind]]:
        """The kinds discovery found now: (those new, those gone). A new one governs every connection
        until it is listed."""
        with self._lock:
            new = [k for k in kinds if k not in self._kinds]
            gone = [k for k in self._kinds if k not in kinds]
            for k in new:
                self._kinds[k] = _State(k)
            for k in gone:
                del self._kinds[k]
            first, self.discovered = not self.discovered, True
        if new or gone or first:
            self.changed()
        return new, gone

    def sync(self, kind: ForeignKind, keys: list[tuple[str, str]]) -> None:
        """A fresh list of the kind's objects."""
        with self._lock:
            st = self._kinds.get(kind)
            if st is None:
                return
            st.replace(keys)
            st.listed, st.unreadable = True, None
        self.changed()

    def put(self, kind: ForeignKind, key: tuple[str, str], present: bool) -> None:
        with self._lock:
            st = self._kinds.get(kind)
            if st is None:
                return
            st.put(key, present)
        self.changed()

    def unreadable(self, kind: ForeignKind, why: str) -> None:
        with self._lock:
            st = self._kinds.get(kind)
            if st is None or st.unreadable == why:
                return
            st.unreadable = why
        self.changed()

    def governs(self, *namespaces: str) -> str | None:
        """Why a connection between pods of `namespaces` must go native (a foreign kind could govern
        it), or None."""
        with self._lock:
            states = list(self._kinds.values())
        for st in states:
            k = st.kind
            if st.unreadable is not None:
                return f"{k.label} cannot be listed ({st.unreadable}): it could govern any connection"
            if not st.listed:
                return f"{k.label} not listed yet"
            if not k.namespaced and st.objects:
                return f"{len(st.objects)} cluster-wide {k.label} object(s) tsord does not evaluate"
            if k.namespaced:
                for ns in namespaces:
                    if ns in st.namespaces:
                        return f"{k.label} objects in namespace {ns}, which tsord does not evaluate"
        return None

    def scopes(self) -> list[tuple[ForeignKind, str]]:
        """(kind, where it sends connections native) for every kind that does: "cluster" (every
        connection: cluster-wide objects, not listed, or unreadable) or "namespace/NAME"."""
        out = []
        with self._lock:   # (the watch threads change the states meanwhile)
            for st in self._kinds.values():
                if st.unreadable is not None or not st.listed or (not st.kind.namespaced and st.objects):
                    out.append((st.kind, "cluster"))
                elif st.kind.namespaced:
                    out.extend((st.kind, f"namespace/{ns}") for ns in sorted(st.namespaces))
        return out
