"""The fields of each Kubernetes kind that the route source reads (tsor/routes_k8s.py), and the
decoding of list pages and watch events to plain dicts holding only those fields.

Why: a real Pod is kilobytes of JSON (containers' env, volumes, managedFields) of which the route
source reads a small part. The standard library's `json` (and orjson alike) builds every dict and
string of it, most of a 10,000-pod list's time. msgspec decoding into the TypedDicts below walks
past the fields not named here without building them, several times faster (measured, with the
pods' sizes: bench/README.md, "Routes from Kubernetes").

A field the converters in routes_k8s.py (node_entry, pod_entry, ...) read must be named here, or
they would find it missing; tests/unit/test_routes_k8s.py checks that each converter makes the same
entry from the decoded dict as from the whole object. Leaves are `Any`: a value of an unexpected type
reaches the converter as it is, and the converter decides, as with the whole object. An object
whose shape does not fit (a string where an object is expected, a null in a list) makes msgspec
refuse the page or the event, which is then decoded whole by `json`, so an odd object is handled
exactly as before. msgspec is optional: without it everything goes through `json`.
"""
from __future__ import annotations

import json
from typing import Any, Optional, TypedDict

try:
    import msgspec
except ImportError:   # pragma: no cover - the slower path, same results
    msgspec = None


class Meta(TypedDict, total=False):
    name: Any
    namespace: Any
    resourceVersion: Any
    labels: Any


class _Object(TypedDict, total=False):
    metadata: Optional[Meta]
    code: Any       # an ERROR event's object is a Status: its code and message
    message: Any


# ---- nodes: name, InternalIP, podCIDRs ----------------------------------------------------------
class NodeAddress(TypedDict, total=False):
    type: Any
    address: Any


class NodeSpec(TypedDict, total=False):
    podCIDR: Any
    podCIDRs: Any


class NodeStatus(TypedDict, total=False):
    addresses: Optional[list[NodeAddress]]


class NodeObject(_Object, total=False):
    spec: Optional[NodeSpec]
    status: Optional[NodeStatus]


# ---- pods: runtime class, node, phase, addresses, named container ports -------------------------
class ContainerPort(TypedDict, total=False):
    name: Any
    containerPort: Any
    protocol: Any


class Container(TypedDict, total=False):
    ports: Optional[list[ContainerPort]]


class PodSpec(TypedDict, total=False):
    runtimeClassName: Any
    nodeName: Any
    hostNetwork: Any
    containers: Optional[list[Container]]


class PodIP(TypedDict, total=False):
    ip: Any


class PodStatus(TypedDict, total=False):
    phase: Any
    podIP: Any
    podIPs: Optional[list[PodIP]]


class PodObject(_Object, total=False):
    spec: Optional[PodSpec]
    status: Optional[PodStatus]


# ---- services: type, ClusterIPs, TCP ports, affinity, internal traffic policy -------------------
class ServicePortSpec(TypedDict, total=False):
    name: Any
    port: Any
    protocol: Any


class ClientIPConfig(TypedDict, total=False):
    timeoutSeconds: Any


class SessionAffinityConfig(TypedDict, total=False):
    clientIP: Optional[ClientIPConfig]


class ServiceSpec(TypedDict, total=False):
    type: Any
    clusterIP: Any
    clusterIPs: Any
    ports: Optional[list[ServicePortSpec]]
    sessionAffinity: Any
    sessionAffinityConfig: Optional[SessionAffinityConfig]
    internalTrafficPolicy: Any


class ServiceObject(_Object, total=False):
    spec: Optional[ServiceSpec]


# ---- endpointslices: address type, ports, endpoints (addresses, ready, node) --------------------
class EndpointConditions(TypedDict, total=False):
    ready: Any


class Endpoint(TypedDict, total=False):
    addresses: Any
    conditions: Optional[EndpointConditions]
    nodeName: Any


class SliceObject(_Object, total=False):
    addressType: Any
    ports: Optional[list[ServicePortSpec]]
    endpoints: Optional[list[Endpoint]]


# NetworkPolicies and Namespaces go whole to tsor/netpol.py: Any (decoded whole, by msgspec); of
# the policy kinds tsord does not evaluate (tsor/policy_kinds.py) only where each object is
OBJECTS: dict[str, Any] = {"nodes": NodeObject, "pods": PodObject, "services": ServiceObject,
                           "endpointslices": SliceObject, "networkpolicies": Any, "namespaces": Any,
                           "foreign": _Object}


class Decoder:
    """One kind's list pages and watch events to dicts (`json`'s types) holding what the source reads."""

    def __init__(self, kind: str) -> None:
        obj = OBJECTS[kind]
        self._page = self._event = self._list_meta = None
        if msgspec is not None:
            list_meta = TypedDict("ListMeta", {"resourceVersion": Any, "continue": Any}, total=False)
            page = TypedDict("Page", {"metadata": Optional[list_meta], "items": Optional[list[obj]]}, total=False)
            event = TypedDict("Event", {"type": Any, "object": Optional[obj]}, total=False)
            self._page, self._event = msgspec.json.Decoder(page), msgspec.json.Decoder(event)
            self._list_meta = msgspec.json.Decoder(TypedDict("ListOnly", {"metadata": Optional[list_meta]},
                                                             total=False))

    def page(self, data: bytes) -> Any:
        return _decode(self._page, data)

    def list_meta(self, data: bytes) -> Any:
        """A list page's metadata alone (its continue token): msgspec skips the items unbuilt."""
        return _decode(self._list_meta, data)

    def event(self, line: bytes | str) -> Any:
        return _decode(self._event, line)


def _decode(decoder: Any, data: bytes | str) -> Any:
    if decoder is not None:
        try:
            return decoder.decode(data)
        except msgspec.DecodeError:   # a shape the schema does not take, or JSON msgspec refuses:
            pass                      # `json` decides, as it always did
    return json.loads(data)
