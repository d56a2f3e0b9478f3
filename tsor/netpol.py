"""NetworkPolicy (networking.k8s.io/v1), as Kubernetes defines it, for the one question tsord asks:
may this TCP connection from pod A to pod B's port be accelerated?

TSoR carries a connection past the node's packet filters (iptables, eBPF) that enforce
NetworkPolicy, so tsord accelerates a connection only when the policies allow it; when they deny it,
or when tsord cannot decide, the connection goes native and the node's enforcement answers exactly
as it does without quark. The rules, from the API's definition:

- a pod is isolated for ingress (egress) when a policy of its namespace selects it (spec.podSelector)
  with that type in policyTypes (absent: Ingress, plus Egress when the policy has an egress section);
- a connection is allowed in when the destination is not isolated for ingress, or a rule of a policy
  selecting it allows the source and the port; out likewise for the source; it needs both. Rules add
  up (any allowing rule allows); a rule without peers allows every peer, one without ports every port;
- a peer is podSelector (the policy's namespace), namespaceSelector (every pod of the matching
  namespaces), both (the intersection) or ipBlock;
- ports: protocol (default TCP; TSoR carries TCP only), a number or a named port of the
  destination pod's containers, endPort for a range.

Where the answer depends on what tsord does not know it says UNKNOWN: before the first list of
policies and namespaces, a namespace whose labels it has not seen, a named port it cannot resolve,
and an ipBlock that covers a pod's address (whether such a block applies to pod traffic is left to
each network implementation by the API: some match it before address translation, some after).
Selectors are matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist).

Policy kinds of other APIs that the cluster serves (Calico's, Cilium's, AdminNetworkPolicy) are not
evaluated: a connection one of them could govern is FOREIGN, native too (tsor/policy_kinds.py).
"""
from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tsor.policy_kinds import ForeignKind, ForeignPolicies

ALLOW, DENY, UNKNOWN, FOREIGN = "allow", "deny", "unknown", "foreign"
NAME_LABEL = "kubernetes.io/metadata.name"   # every namespace carries its name as this label


@dataclass(frozen=True)
class PodRef:
    """What a decision needs of a pod."""
    namespace: str
    name: str
    labels: dict[str, str]
    ip: str                                        # the address of this connection's end
    ports: dict[str, int] | None = field(default=None)   # named container ports; None: not known


class _Unknown(Exception):
    """The decision needs something tsord does not know."""


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: {} selects everything; matchLabels and matchExpressions must all hold."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise _Unknown(f"selector operator {op!r}")
        if not ok:
            return False
    return True


def policy_types(spec: dict) -> set[str]:
    types = spec.get("policyTypes")
    if types:
        return set(types)
    return {"Ingress"} | ({"Egress"} if spec.get("egress") is not None else set())


class PolicySet:
    """The cluster's NetworkPolicies and namespace labels, as the route source lists and watches them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.policies: dict[tuple[str, str], dict] = {}    # (namespace, name) -> the object (API JSON)
        self.namespaces: dict[str, dict[str, str]] = {}    # name -> labels
        self._listed: set[str] = set()   # "policies", "namespaces": listed at least once
        # called after every change: tsord bumps its route generation (tsor/peers.py), so that no
        # supervisor keeps connecting directly on a decision the change may have altered
        self.changed: Callable[[], None] = _nothing
        # the policy kinds of other APIs the cluster serves, and where their objects are
        self.foreign = ForeignPolicies(lambda: self.changed())

    @property
    def synced(self) -> bool:
        """Both lists and the first discovery of policy kinds done: until then every answer is UNKNOWN."""
        return self._listed >= {"policies", "namespaces"} and self.foreign.discovered

    # ---- updates (from list and watch events) ------------------------------------------------------
    def put_policy(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        with self._lock:
            self.policies[(meta.get("namespace", "default"), meta.get("name", ""))] = obj
        self.changed()

    def delete_policy(self, namespace: str, name: str) -> None:
        with self._lock:
            self.policies.pop((namespace, name), None)
        self.changed()

    def put_namespace(self, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        with self._lock:
            self.namespaces[name] = {NAME_LABEL: name, **(meta.get("labels") or {})}
        self.changed()

    def delete_namespace(self, name: str) -> None:
        with self._lock:
            self.namespaces.pop(name, None)
        self.changed()

    def sync_policies(self, objs: list[dict]) -> None:
        """A fresh list of the policies (a relist)."""
        fresh = {}
        for obj in objs:
            meta = obj.get("metadata") or {}
            fresh[(meta.get("namespace", "default"), meta.get("name", ""))] = obj
        with self._lock:
            self.policies = fresh
            self._listed.add("policies")
        self.changed()

    def sync_namespaces(self, objs: list[dict]) -> None:
        """A fresh list of the namespaces (a relist)."""
        fresh = {}
        for obj in objs:
            meta = obj.get("metadata") or {}
            fresh[meta.get("name", "")] = {NAME_LABEL: meta.get("name", ""), **(meta.get("labels") or {})}
        with self._lock:
            self.namespaces = fresh
            self._listed.add("namespaces")
        self.changed()

    def replace(self, policies: list[dict], namespaces: list[dict], foreign: list[ForeignKind] = ()) -> None:
        """Both lists, and the policy kinds of other APIs, at once."""
        self.sync_namespaces(namespaces)
        self.sync_policies(policies)
        self.foreign.set_kinds(list(foreign))

    # ---- the question ----------------------------------------------------------------------------
    def decide(self, src: PodRef, dst: PodRef, port: int) -> tuple[str, str]:
        """(ALLOW | DENY | UNKNOWN | FOREIGN, why) for a TCP connection from `src` to `dst`:`port`."""
        if not self.synced:
            return UNKNOWN, "network policies not listed yet"
        why = self.foreign.governs(src.namespace, dst.namespace)
        if why is not None:
            return FOREIGN, why
        with self._lock:
            policies = list(self.policies.values())
        verdicts = [self._direction(policies, "Ingress", dst, src, dst, port),
                    self._direction(policies, "Egress", src, dst, dst, port)]
        for verdict in (DENY, UNKNOWN):
            for v, why in verdicts:
                if v == verdict:
                    return v, why
        return ALLOW, "allowed"

    def _direction(self, policies: list[dict], kind: str, subject: PodRef, peer: PodRef, dst: PodRef,
                   port: int) -> tuple[str, str]:
        """Whether `subject` (the destination for Ingress, the source for Egress) may talk to `peer`."""
        rules_key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
        isolating, unknown = [], None
        for pol in policies:
            meta, spec = pol.get("metadata") or {}, pol.get("spec") or {}
            if meta.get("namespace", "default") != subject.namespace or kind not in policy_types(spec):
                continue
            try:
                if not selects(spec.get("podSelector"), subject.labels):
                    continue
            except _Unknown as e:
                unknown = unknown or f"policy {subject.namespace}/{meta.get('name')}: {e}"
                continue
            isolating.append(meta.get("name"))
            for rule in spec.get(rules_key) or []:
                try:
                    if (self._peers_match(rule.get(peers_key), meta.get("namespace", "default"), peer)
                            and _ports_match(rule.get("ports"), dst, port)):
                        return ALLOW, f"{kind.lower()} allowed by {subject.namespace}/{meta.get('name')}"
                except _Unknown as e:
                    unknown = unknown or f"policy {subject.namespace}/{meta.get('name')}: {e}"
        if not isolating:
            return (UNKNOWN, unknown) if unknown else (ALLOW, f"{subject.namespace}/{subject.name}: no {kind} policy")
        if unknown:
            return UNKNOWN, unknown
        return DENY, f"{kind.lower()} of {subject.namespace}/{subject.name} denied by {', '.join(sorted(isolating))}"

    def _peers_match(self, peers: list[dict] | None, policy_ns: str, pod: PodRef) -> bool:
        if not peers:
            return True   # no `from`/`to`: every peer
        unknown = None
        for p in peers:   # any matching peer matches; one that cannot be decided matters only if none does
            try:
                if self._peer_matches(p, policy_ns, pod):
                    return True
            except _Unknown as e:
                unknown = unknown or e
        if unknown:
            raise unknown
        return False

    def _peer_matches(self, p: dict, policy_ns: str, pod: PodRef) -> bool:
        if p.get("ipBlock") is not None:
            if _in_block(p["ipBlock"], pod.ip):
                raise _Unknown(f"ipBlock {p['ipBlock'].get('cidr')} covers pod address {pod.ip}")
            return False
        pod_sel, ns_sel = p.get("podSelector"), p.get("namespaceSelector")
        if ns_sel is None:
            in_ns = pod.namespace == policy_ns
        else:
            labels = self.namespaces.get(pod.namespace)
            if labels is None:
                raise _Unknown(f"labels of namespace {pod.namespace} not known")
            in_ns = selects(ns_sel, labels)
        return in_ns and (pod_sel is None or selects(pod_sel, pod.labels))


def _ports_match(ports: list[dict] | None, dst: PodRef, port: int) -> bool:
    if not ports:
        return True   # no `ports`: every port
    unknown = None
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None:
            return True   # every TCP port
        if isinstance(want, str) and not want.isdigit():
            if dst.ports is None or want not in dst.ports:
                unknown = unknown or _Unknown(f"named port {want!r} of pod {dst.namespace}/{dst.name} not known")
                continue
            want = dst.ports[want]
        want = int(want)
        end = p.get("endPort")
        if want == port or (end is not None and want <= port <= int(end)):
            return True
    if unknown:
        raise unknown
    return False


def _in_block(block: dict, ip: str) -> bool:
    try:
        addr = ipaddress.ip_address(ip)
        net = ipaddress.ip_network(block.get("cidr", ""), strict=False)
        if addr.version != net.version or addr not in net:
            return False
        return not any(addr in ipaddress.ip_network(e, strict=False) for e in block.get("except") or []
                       if ipaddress.ip_network(e, strict=False).version == addr.version)
    except ValueError:
        raise _Unknown(f"ipBlock {block!r} is not a CIDR") from None


def _nothing() -> None:
    pass
