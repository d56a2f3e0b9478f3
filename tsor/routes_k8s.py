"""Routes from the Kubernetes API server: a `RouteSource` (routes.py) that lists and watches Nodes,
Pods, Services and EndpointSlices with the official `kubernetes` client and keeps tsord's RouteTable
current.

What goes into the table:
  nodes     name, InternalIP + the tsords' port (`Config.tsord_port`) as the node's tsord, podCIDRs
            (kept for information: a node's CIDR is not routed, its runc pods stay native)
  pods      quark pods only: spec.runtimeClassName == the configured runtime class, phase Running,
            scheduled on a node, not on the host network; by each of status.podIPs, with their
            namespace and labels (what NetworkPolicy needs)
  services  each TCP port of each ClusterIP (not headless, not ExternalName)
  slices    EndpointSlices by their kubernetes.io/service-name label: ports and endpoints
            (first address, ready, nodeName), what tsord picks a Service's endpoint from

NetworkPolicy kinds of other APIs (Calico's, Cilium's, AdminNetworkPolicy: tsor/policy_kinds.py) are
found by API discovery every `discovery_seconds`; each one served gets a list-and-watch thread of
its own (only its objects' names and namespaces are read), stopped when the kind goes.

One thread per kind, each the informer's loop: list (in pages), then watch from the list's
resourceVersion with bookmarks. A watch that ends at its timeout resumes from the last
resourceVersion seen (an event's or a BOOKMARK's); one that drops, or an API server that cannot be
reached, is retried with exponential backoff, resuming from that resourceVersion; 410 Gone (as the
watch's HTTP status or as an ERROR event) means that version is compacted away: relist, and the
relist replaces that kind in the table whole, so objects deleted meanwhile go too. While the API
server is away the table stays as it was: pods it knew keep their paths, pods it never saw are
unknown to tsord and connect natively.

Objects are read as JSON, not deserialised into the client's models: a model per object is too
slow for 10,000 pods (bench/routes_k8s.py; measured: bench/README.md, "Routes from Kubernetes").
Only the fields the entries below read are decoded (tsor/k8s_fields.py). The requests go through
the client's ApiClient (its configuration: server, TLS, credentials and their refresh) but not its
generated CoreV1Api & co., whose import brings hundreds of model modules, and tsord's memory with
them, for nothing here (same section).
"""
from __future__ import annotations

import contextlib
import gc
import ipaddress
import json
import logging
import queue
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tsor.config import HostPort, Kubernetes
from tsor.errors import ConfigError
from tsor.k8s_fields import Decoder
from tsor.netpol import PolicySet
from tsor.policy_kinds import ForeignKind, foreign_kinds
from tsor.routes import EndpointSlice, Network, Node, Pod, RouteTable, ServicePort

log = logging.getLogger("tsor.routes_k8s")

PAGE = 500                  # objects per list request (the API server's chunking)
WATCH_SECONDS = 240         # the server ends each watch after this long; it is then resumed
READ_TIMEOUT = 60           # no byte (not even a bookmark) for this long: the connection is dead
CONNECT_TIMEOUT = 5
BACKOFF = (0.5, 30.0)       # first and longest wait before retrying an API server that failed
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Key = tuple[str, str]       # (namespace, name); namespace "" for nodes


# every (API group, resource) the source lists and watches: deploy/rbac.yaml must grant them
WATCHED = (("", "nodes"), ("", "pods"), ("", "services"), ("discovery.k8s.io", "endpointslices"),
           ("networking.k8s.io", "networkpolicies"), ("", "namespaces"))


class Gone(Exception):
    """410: the resourceVersion is too old; relist."""


def collection_path(group: str, resource: str) -> str:
    """The URL path of a WATCHED collection across all namespaces (every group here serves v1)."""
    return f"/api/v1/{resource}" if not group else f"/apis/{group}/v1/{resource}"


class Kind:
    """One watched kind: where to list it, and how its objects become table entries."""

    def __init__(self, name: str, convert: Callable[[dict], Any],
                 sync: Callable[[dict[Key, Any]], None], apply: Callable[[Key, Any], None],
                 path: str | None = None, fields: str | None = None,
                 unchanged: Callable[[Key, dict], Any] | None = None) -> None:
        self.name, self.convert, self.sync, self.apply = name, convert, sync, apply
        # a relist's shortcut: the table's entry of an object listed again unchanged, or None
        self.unchanged = unchanged
        self.path = path or next(collection_path(g, r) for g, r in WATCHED if r == name)
        self.decoder = Decoder(fields or name)
        self.retired = threading.Event()   # a policy kind discovery no longer finds: its thread ends
        self.unlisted: Callable[[str], None] | None = None   # told why a list failed (policy kinds)
        self.response: Any = None          # the open watch's, to cut when the kind is retired
        self.resource_version: str | None = None
        self.synced = threading.Event()   # listed at least once
        self.relists = 0
        self.events = 0
        self.errors = 0

    def entry(self, obj: dict) -> Any:
        """The table entry of an object; None (not routed) for one the conversion cannot read, so
        that one odd object never stops a list or, replayed after every retry, a watch."""
        try:
            return self.convert(obj)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            log.warning("routes from Kubernetes: %s %s/%s not understood, not routed: %s", self.name,
                        *_key(obj), e)
            return None


def _ip(value: object) -> str | None:
    """An address in its canonical text (the table's keys), None if it is not one. inet_pton: far
    cheaper than ipaddress, which counts at 10,000 pods."""
    if not isinstance(value, str):
        return None
    for fam in (socket.AF_INET, socket.AF_INET6) if ":" not in value else (socket.AF_INET6,):
        try:
            return socket.inet_ntop(fam, socket.inet_pton(fam, value))
        except OSError:
            continue
    return None


def _intern(s: object) -> object:
    """One string object for the many pods sharing a namespace, a node or a label."""
    return sys.intern(s) if type(s) is str else s


def _key(obj: dict) -> Key:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


# ---- API objects -> table entries (None: not something the table holds) --------------------------

def node_entry(obj: dict, port: int) -> Node | None:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    ips = [_ip(a.get("address")) for a in status.get("addresses") or () if a.get("type") == "InternalIP"]
    address = next((HostPort(ip, port) for ip in ips if ip), None)
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    nets: list[Network] = []
    for c in cidrs:
        try:
            nets.append(ipaddress.ip_network(c, strict=False))
        except (ValueError, TypeError):
            pass
    return Node(meta.get("name", ""), address, (), tuple(nets))


def pod_entry(obj: dict, runtime_class: str) -> Pod | None:
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if (spec.get("runtimeClassName") != runtime_class or status.get("phase") != "Running"
            or not spec.get("nodeName") or spec.get("hostNetwork")):
        return None
    ips = [p.get("ip") for p in status.get("podIPs") or ()] or [status.get("podIP")]
    valid = [ip for ip in map(_ip, ips) if ip]
    if not valid:
        return None
    ports = {p["name"]: p["containerPort"] for c in spec.get("containers") or () for p in c.get("ports") or ()
             if p.get("name") and isinstance(p.get("containerPort"), int) and (p.get("protocol") or "TCP") == "TCP"}
    return Pod(_intern(meta.get("namespace", "")), meta.get("name", ""), _intern(spec["nodeName"]), tuple(valid),
               _labels(meta.get("labels") or {}), ports, _version(meta))


def _version(meta: dict) -> object:
    """An object's resourceVersion, kept beside its entry: an int where it is one (etcd's are: less
    memory than their text, and equal exactly when the text is), else the text. Only compared for
    equality, as the API says to treat it."""
    rv = meta.get("resourceVersion")
    if type(rv) is str and rv.isdigit() and (len(rv) == 1 or rv[0] != "0"):
        return int(rv)
    return rv


def _unchanged_pod(table: RouteTable, key: Key, obj: dict) -> Pod | None:
    """The table's entry of a pod listed again at the version it was made from (a relist after a
    410: most pods have not changed), else None (convert it)."""
    pod = table.pod(key)
    if pod is None or pod.version is None:
        return None
    return pod if _version(obj.get("metadata") or {}) == pod.version else None


_LABEL_SETS: dict[tuple, dict] = {}
_MAX_LABEL_SETS = 1 << 16   # then it starts again: label sets come and go with Deployments' revisions


def _labels(value: Any) -> dict:
    """A pod's labels: one dict for each distinct set, shared by the pods that carry it (a
    ReplicaSet's pods carry the same), read-only by the table's convention: less memory than a dict
    of interned strings per pod."""
    items = tuple((value if type(value) is dict else dict(value)).items())
    try:
        shared = _LABEL_SETS.get(items)
    except TypeError:   # an odd, unhashable value: that pod's own dict, as before
        return {_intern(k): _intern(v) for k, v in items}
    if shared is None:
        if len(_LABEL_SETS) >= _MAX_LABEL_SETS:
            _LABEL_SETS.clear()
        shared = _LABEL_SETS[items] = {_intern(k): _intern(v) for k, v in items}
    return shared


def service_entry(obj: dict) -> dict[tuple[str, int], ServicePort] | None:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return None
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    timeout = _affinity_seconds(spec)
    out = {}
    for ip in map(_ip, ips):
        if ip is None:   # "None" (headless) is not an address
            continue
        for p in spec.get("ports") or ():
            if (p.get("protocol") or "TCP") != "TCP" or not isinstance(p.get("port"), int):
                continue
            out[(ip, p["port"])] = ServicePort(meta.get("namespace", ""), meta.get("name", ""), p.get("name") or "",
                                               spec.get("sessionAffinity") == "ClientIP",
                                               spec.get("internalTrafficPolicy") == "Local", timeout)
    return out or None


AFFINITY_DEFAULT_S, AFFINITY_MAX_S = 10800, 86400   # the API's default and its validation's bound


def _affinity_seconds(spec: dict) -> int:
    """sessionAffinityConfig.clientIP.timeoutSeconds, the API's default where it is not set (or not
    a number in its range, which the API server would have refused)."""
    value = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get("timeoutSeconds")
    return value if type(value) is int and 0 < value <= AFFINITY_MAX_S else AFFINITY_DEFAULT_S


def slice_entry(obj: dict) -> EndpointSlice | None:
    meta = obj.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    family = {"IPv4": socket.AF_INET, "IPv6": socket.AF_INET6}.get(obj.get("addressType"))
    if not service or family is None:
        return None
    ports = tuple((p.get("name") or "", p["port"], p.get("protocol") or "TCP")
                  for p in obj.get("ports") or () if isinstance(p.get("port"), int))
    endpoints = []
    for e in obj.get("endpoints") or ():
        address = _ip((e.get("addresses") or [None])[0])   # kube-proxy, too, takes only the first
        if address is None:
            continue
        # the API: a readiness not reported (null) is to be taken as ready
        ready = (e.get("conditions") or {}).get("ready") is not False
        endpoints.append((address, ready, e.get("nodeName")))
    return EndpointSlice(meta.get("namespace", ""), service, family, ports, tuple(endpoints))


# ---- the source ---------------------------------------------------------------------------------

def api_client(settings: Kubernetes) -> Any:
    """An ApiClient from the kubeconfig named in tsor.yaml, or the in-cluster service account."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException
    conf = client.Configuration()
    try:
        if settings.kubeconfig:
            config.load_kube_config(config_file=settings.kubeconfig, context=settings.context,
                                    client_configuration=conf, persist_config=False)
        else:
            config.load_incluster_config(client_configuration=conf)
    except (ConfigException, OSError, ValueError, TypeError) as e:
        field = "kubernetes.kubeconfig" if settings.kubeconfig else "kubernetes"
        where = settings.kubeconfig or "in-cluster configuration"
        raise ConfigError(where, field, f"cannot load the Kubernetes client configuration: {e}") from None
    return client.ApiClient(conf)


class KubernetesSource:
    """Keeps a RouteTable current from the API server (see the module's docstring)."""

    def __init__(self, settings: Kubernetes, tsord_port: int, client: Any = None, *,
                 backoff: tuple[float, float] = BACKOFF, watch_seconds: int = WATCH_SECONDS,
                 read_timeout: float = READ_TIMEOUT, first_sync: float = 5.0,
                 discovery_seconds: float | None = None) -> None:
        self.settings, self.tsord_port = settings, tsord_port
        self._client = client
        self.backoff, self.watch_seconds, self.read_timeout = backoff, watch_seconds, read_timeout
        self.first_sync = first_sync
        self.discovery_seconds = discovery_seconds or settings.discovery_seconds   # (tsor.yaml's)
        self.foreign: dict[ForeignKind, Kind] = {}   # the policy kinds of other APIs being watched
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._responses: set[Any] = set()
        self._lock = threading.Lock()
        self.kinds: list[Kind] = []

    def start(self, table: RouteTable) -> None:
        self._setup(table)
        for kind in self.kinds:
            self._thread(kind)
        discovered = threading.Event()
        t = threading.Thread(target=self._discover_loop, args=(discovered,), name="k8s-discovery", daemon=True)
        t.start()
        self._threads.append(t)
        # tsord serves at once either way; waiting a little lets its first connections see the routes
        deadline = time.monotonic() + self.first_sync
        for kind in self.kinds:
            if not kind.synced.wait(max(0.0, deadline - time.monotonic())):
                log.warning("routes from Kubernetes: %s not listed yet; their connections go native meanwhile",
                            kind.name)
        if not discovered.wait(max(0.0, deadline - time.monotonic())):
            log.warning("routes from Kubernetes: the policy kinds served not discovered yet; connections go "
                        "native meanwhile")

    def _thread(self, kind: Kind) -> None:
        t = threading.Thread(target=self._run, args=(kind,), name=f"k8s-{kind.name}", daemon=True)
        t.start()
        self._threads.append(t)

    # ---- policy kinds of other APIs ------------------------------------------------------------
    def _discover_loop(self, discovered: threading.Event) -> None:
        while not self._stop.is_set():
            try:
                self.discover()
                discovered.set()
            except Exception as e:   # the API server away: keep the kinds known, try again later
                log.warning("routes from Kubernetes: discovering policy kinds: %s (kinds kept as they are)",
                            describe(e))
            self._stop.wait(self.discovery_seconds)

    def discover(self) -> list[ForeignKind]:
        """Look the policy kinds the cluster serves up now, and watch those tsord does not evaluate."""
        from kubernetes.client.rest import ApiException

        def resources(group_version: str) -> dict | None:
            try:
                return self._get_json(f"/apis/{group_version}")
            except ApiException as e:
                if e.status == 404:
                    return None
                raise
        kinds = foreign_kinds(self._get_json("/apis"), resources)
        foreign = self.table.policy.foreign
        new, gone = foreign.set_kinds(kinds)
        for k in gone:
            kind = self.foreign.pop(k)
            kind.retired.set()
            if kind.response is not None:
                _shutdown(kind.response)
            log.info("routes from Kubernetes: %s no longer served", k.label)
        for k in new:
            log.warning("routes from Kubernetes: the cluster serves %s, which tsord does not evaluate: "
                        "connections its objects could govern go native", k.label)
            kind = self.foreign[k] = Kind(
                k.label, lambda o: True, lambda m, k=k: foreign.sync(k, list(m)),
                lambda key, e, k=k: foreign.put(k, key, e is not None), path=k.path, fields="foreign")
            kind.unlisted = lambda why, k=k: foreign.unreadable(k, why)
            self._thread(kind)
        return kinds

    def _get_json(self, path: str) -> Any:
        resp = self._get_path(path, {})
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def list_once(self, table: RouteTable, names: tuple[str, ...]) -> None:
        """List the kinds named into `table` once, as start() does first, and watch nothing (`quark
        tsor check`). Raises what the list raises; describe() says it in a line."""
        self._setup(table)
        for kind in self.kinds:
            if kind.name in names:
                self._list(kind)

    @property
    def server(self) -> str:
        """The API server's URL, from the client's configuration."""
        return self._client.configuration.host

    def _setup(self, table: RouteTable) -> None:
        try:
            import kubernetes.client  # noqa: F401 (whether the client is installed)
        except ImportError:
            raise ConfigError("tsor.yaml", "kubernetes", "routes from Kubernetes need the `kubernetes` Python "
                                                         "client: pip install 'quark-runtime[k8s]'") from None
        self.table = table
        if self._client is None:
            self._client = api_client(self.settings)
        port, rc = self.tsord_port, self.settings.runtime_class
        policy = table.policy = PolicySet()
        self.kinds = [
            Kind("nodes", lambda o: node_entry(o, port),
                 lambda m: table.sync(nodes=[n for n in m.values() if n is not None]),
                 lambda k, n: table.set_node(k[1], n)),
            Kind("pods", lambda o: pod_entry(o, rc),
                 lambda m: table.sync(pods=[p for p in m.values() if p is not None]), table.set_pod,
                 unchanged=lambda key, o: _unchanged_pod(table, key, o)),
            Kind("services", service_entry,
                 lambda m: table.sync(services={k: v for k, v in m.items() if v is not None}), table.set_service),
            Kind("endpointslices", slice_entry,
                 lambda m: table.sync(slices={k: v for k, v in m.items() if v is not None}),
                 lambda k, s: table.set_slice(k[0], k[1], s)),
            # NetworkPolicy: tsord accelerates only what the policies allow (tsor/netpol.py)
            Kind("networkpolicies", lambda o: o,
                 lambda m: policy.sync_policies([o for o in m.values() if o is not None]),
                 lambda k, o: policy.put_policy(o) if o is not None else policy.delete_policy(*k)),
            Kind("namespaces", lambda o: o,
                 lambda m: policy.sync_namespaces([o for o in m.values() if o is not None]),
                 lambda k, o: policy.put_namespace(o) if o is not None else policy.delete_namespace(k[1])),
        ]

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            responses = list(self._responses)
        for resp in responses:   # unblocks the watch threads' reads
            _shutdown(resp)

    def status(self) -> dict[str, dict]:
        return {k.name: {"synced": k.synced.is_set(), "resource_version": k.resource_version,
                         "relists": k.relists, "events": k.events, "errors": k.errors}
                for k in self.kinds + list(self.foreign.values())}

    # ---- one kind: list, watch, and again ------------------------------------------------------
    def _run(self, kind: Kind) -> None:
        delay = self.backoff[0]
        while not self._stop.is_set() and not kind.retired.is_set():
            events = kind.events
            listing = kind.resource_version is None
            try:
                if kind.resource_version is None:
                    self._list(kind)
                if self._watch(kind):
                    delay = self.backoff[0]
                    continue   # ended at its timeout, or delivered events before it dropped: resume now
                reason = "the watch ended early"
            except Gone:
                if kind.resource_version is not None:
                    log.info("routes from Kubernetes: %s: resourceVersion %s is gone, relisting",
                             kind.name, kind.resource_version)
                    kind.resource_version = None
                    continue
                reason = "410 Gone while listing"   # again and again: not at full speed
            except Exception as e:   # the API server down or dropping: keep the routes, try again
                reason = describe(e)
                if kind.events > events:   # a watch that worked for a while: a fresh failure
                    delay = self.backoff[0]
            if self._stop.is_set() or kind.retired.is_set():
                return
            if listing and kind.unlisted is not None:
                kind.unlisted(reason)
            kind.errors += 1
            log.warning("routes from Kubernetes: %s: %s; retrying in %.1f s (routes kept as they are)",
                        kind.name, reason, delay)
            # jitter: a restarted API server is not met by every node's tsord in the same instant
            self._stop.wait(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff[1])

    def _list(self, kind: Kind) -> None:
        from kubernetes.client.rest import ApiException
        try:
            with _collection_paused():
                self._list_pages(kind)
        except ApiException as e:
            if e.status == 410:   # a continue token expired between pages: list again from the start
                raise Gone() from None
            raise

    def _get(self, kind: Kind, query: dict[str, str]) -> Any:
        """A GET of the kind's collection: its raw (urllib3) response; ApiException unless 2xx."""
        return self._get_path(kind.path, query)

    def _get_path(self, path: str, query: dict[str, str]) -> Any:
        """A GET: its raw (urllib3) response; ApiException unless 2xx. Made as the generated CoreV1Api
        & co. make it, without importing them (the module's docstring)."""
        from kubernetes.client.rest import ApiException
        api, timeout = self._client, (CONNECT_TIMEOUT, self.read_timeout)
        headers, auth = {"Accept": "application/json"}, ["BearerToken"]
        if not hasattr(api, "param_serialize"):   # a client of the older generator (python-legacy)
            return api.call_api(path, "GET", query_params=list(query.items()), header_params=headers,
                                auth_settings=auth, _preload_content=False, _return_http_data_only=True,
                                _request_timeout=timeout)
        request = api.param_serialize("GET", path, query_params=list(query.items()), header_params=headers,
                                      auth_settings=auth)
        resp = api.call_api(*request, _request_timeout=timeout)
        if not 200 <= resp.status <= 299:
            resp.read()
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return resp.response

    def _list_pages(self, kind: Kind) -> None:
        entries: dict[Key, Any] = {}
        rv = None
        # a relist (after a 410): the table holds the entries of the last list and its events
        unchanged = kind.unchanged if kind.synced.is_set() else None
        for data in self._pages(kind):
            page = kind.decoder.page(data)
            for obj in page.get("items") or ():
                key = _key(obj)
                entry = unchanged(key, obj) if unchanged is not None else None
                entries[key] = entry if entry is not None else kind.entry(obj)
            rv = (page.get("metadata") or {}).get("resourceVersion") or rv
        if kind.retired.is_set():
            return
        kind.sync(entries)
        kind.resource_version = rv
        kind.relists += 1
        kind.synced.set()
        log.info("routes from Kubernetes: %s listed at resourceVersion %s: %d objects",
                 kind.name, rv, len(entries))

    def _pages(self, kind: Kind) -> Iterator[bytes]:
        """The list's pages as the API server sent them, each next one fetched (by a thread of its
        own) while this one is read, so that the server's time and ours overlap (measured:
        bench/README.md, "Routes from Kubernetes"). Its errors are raised here."""
        pages: queue.Queue = queue.Queue(maxsize=2)
        done = threading.Event()

        def put(item: Any) -> None:
            while not done.is_set():
                try:
                    return pages.put(item, timeout=0.5)
                except queue.Full:
                    continue

        def fetch() -> None:
            cont = None
            try:
                while not done.is_set():
                    query = {"limit": str(PAGE)}
                    if cont:
                        query["continue"] = cont
                    resp = self._get(kind, query)
                    try:
                        data = resp.data
                    finally:
                        resp.release_conn()
                    put(data)
                    cont = (kind.decoder.list_meta(data).get("metadata") or {}).get("continue")
                    if not cont:
                        break
                put(None)
            except BaseException as e:   # noqa: BLE001 - the list's own thread raises it
                put(e)

        threading.Thread(target=fetch, name=f"k8s-{kind.name}-pages", daemon=True).start()
        try:
            while (item := pages.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            done.set()   # a list given up (an error while reading a page): the fetch ends too

    def _watch(self, kind: Kind) -> bool:
        """Apply one watch's events. True: it ended at its timeout or delivered something (resume at
        once); False: it ended early without an event (a drop: back off). Raises Gone on 410."""
        from kubernetes.client.rest import ApiException
        from kubernetes.watch.watch import iter_resp_lines
        t0 = time.monotonic()
        try:
            resp = self._get(kind, {"watch": "true", "resourceVersion": kind.resource_version,
                                    "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_seconds)})
        except ApiException as e:
            if e.status == 410:
                raise Gone() from None
            raise
        with self._lock:
            self._responses.add(resp)
        kind.response = resp
        seen = False
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set() or kind.retired.is_set():
                    return True
                if not line:
                    continue
                self._event(kind, kind.decoder.event(line))
                seen = True
        finally:
            with self._lock:
                self._responses.discard(resp)
            resp.release_conn()
        return seen or time.monotonic() - t0 >= self.watch_seconds * 0.9

    def _event(self, kind: Kind, ev: dict) -> None:
        typ, obj = ev.get("type"), ev.get("object")
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata") or {}, dict):
            log.warning("routes from Kubernetes: %s: a %s event without an object, ignored", kind.name, typ)
            return
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if typ == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        if kind.retired.is_set():
            return
        if typ in ("ADDED", "MODIFIED"):
            kind.apply(_key(obj), kind.entry(obj))
        elif typ == "DELETED":
            kind.apply(_key(obj), None)
        elif typ != "BOOKMARK":
            raise RuntimeError(f"unknown watch event type {typ!r}")
        kind.events += 1
        if rv:
            kind.resource_version = rv


_paused = [0, False]   # lists under way, whether the collector was on before the first
_paused_lock = threading.Lock()


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """CPython's cyclic collector off while lists are under way (any kind's thread). A list allocates
    millions of small objects (decoded pages, entries), each 700 of which start a collection that
    scans what is young, and the growing table triggers full ones over it all (their share of a list
    at cluster scale: bench/README.md, "Routes from Kubernetes"). What a list builds holds no cycles,
    so reference counting frees it as before; the collector runs again once the last list is done."""
    with _paused_lock:
        if _paused[0] == 0:
            _paused[1] = gc.isenabled()
            gc.disable()
        _paused[0] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused[0] -= 1
            if _paused[0] == 0 and _paused[1]:
                gc.enable()


def _shutdown(resp: Any) -> None:
    try:
        if hasattr(resp, "shutdown"):
            resp.shutdown()
        else:
            resp.close()
    except Exception:
        pass


def describe(e: BaseException) -> str:
    """A failure to reach or read the API server in a line: its answer, or the socket's error under
    urllib3's wrappers ("Connection refused", not a MaxRetryError's repr of a connection pool)."""
    from kubernetes.client.rest import ApiException
    if isinstance(e, ApiException):
        return f"API server answered {e.status} {e.reason}"
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:   # MaxRetryError.reason, then __cause__s
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        if isinstance(cause, TimeoutError) or type(cause).__name__.endswith("TimeoutError"):
            return "timed out"
        reason = getattr(cause, "reason", None)
        cause = reason if isinstance(reason, BaseException) else (cause.__cause__ or cause.__context__)
    return f"{type(e).__name__}: {e}"
