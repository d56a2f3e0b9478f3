"""A stand-in for the API server's list/watch HTTP interface; not a Kubernetes.

No Kubernetes API server can be installed on these machines, so the route source
(tsor/routes_k8s.py) is tested with the official client against this: a local HTTP/1.1 server that
answers the list and watch requests of six collections (nodes, pods, services, endpointslices,
networkpolicies, namespaces), and of any other kind a test serves (`serve_kind`: a CRD's, such as
Calico's or Cilium's policies), in the API's wire format:

  GET /api/v1/pods?limit=N&continue=T     a JSON list, metadata.resourceVersion (and continue)
  GET ...?watch=true&resourceVersion=N&allowWatchBookmarks=true&timeoutSeconds=S
                                          a chunked stream, one JSON event a line:
                                          {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}
  GET /apis                               the APIGroupList: the built-in groups above, and the served kinds'
  GET /apis/GROUP/VERSION                 that group version's APIResourceList

Objects are whatever the test puts in: the builders below make them from the `kubernetes` client's
own models (`ApiClient().sanitize_for_serialization`). One resourceVersion counter serves every
collection, as etcd's revision does. A test drives the faults: `bookmark()`, `compact()` (watches from
older versions get an ERROR event with a 410 Status, as after etcd's compaction), `expire_watches()`
(the open watches get that ERROR now), `drop_watches()` (their connections are cut mid-stream),
`stop()` / `start()` (the server gone, then back on the same port), `unserve_kind()` (a CRD deleted: it
leaves discovery, its collection answers 404 and its open watches end), `forbid()` (the collection
answers 403, as RBAC does to a client without the grant). Nothing else of the API
(no writes but a merge PATCH of an object, selectors, auth, admission) exists here.

With `tls` (a certificate and key: `make_tls` makes a self-signed pair for an IP) it speaks HTTPS,
as an API server does to pods: `write_service_account` then writes what kubelet mounts at
/var/run/secrets/kubernetes.io/serviceaccount, and the client's in-cluster configuration
(KUBERNETES_SERVICE_HOST and _PORT) reaches it; the token is not checked.
"""
from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

COLLECTIONS = {
    "nodes": ("/api/v1/nodes", "NodeList", "v1"),
    "pods": ("/api/v1/pods", "PodList", "v1"),
    "services": ("/api/v1/services", "ServiceList", "v1"),
    "endpointslices": ("/apis/discovery.k8s.io/v1/endpointslices", "EndpointSliceList", "discovery.k8s.io/v1"),
    "networkpolicies": ("/apis/networking.k8s.io/v1/networkpolicies", "NetworkPolicyList", "networking.k8s.io/v1"),
    "namespaces": ("/api/v1/namespaces", "NamespaceList", "v1"),
}
# the built-in groups discovery lists (core's kinds are under /api, which nothing here reads)
BUILT_IN_RESOURCES = {
    "discovery.k8s.io/v1": [("endpointslices", "EndpointSlice", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True), ("ingresses", "Ingress", True),
                             ("ingresses/status", "Ingress", True)],
}


def _key(obj: dict) -> tuple[str, str]:
    m = obj["metadata"]
    return (m.get("namespace") or "", m["name"])


class FakeKubeAPI:
    def __init__(self, listener: socket.socket | None = None, tls: tuple[str, str] | None = None) -> None:
        """`listener`: a bound, listening TCP socket to serve on (one made in another network
        namespace, say); default: a port of 127.0.0.1 here. `tls`: (certificate, key) files."""
        self.listener = listener
        self.tls = tls
        self.cond = threading.Condition()
        self.rv = 1
        self.collections = dict(COLLECTIONS)
        self.resources = {gv: list(rs) for gv, rs in BUILT_IN_RESOURCES.items()}   # discovery's
        self.forbidden: set[str] = set()
        self.objects: dict[str, dict[tuple[str, str], dict]] = {k: {} for k in COLLECTIONS}
        self._encoded: dict[str, list[bytes] | None] = dict.fromkeys(COLLECTIONS)   # each kind's items, sorted
        self.log: list[tuple[int, str, str, dict]] = []   # (rv, kind, type, object)
        self.compacted = 0          # watches from a version below this get 410
        self.expired_continues = 0  # this many next list requests with a continue token get 410
        self.generation = {"bookmark": 0, "expire": 0, "drop": 0}
        self.requests: list[tuple[str, dict[str, str]]] = []   # (kind, query) of every request
        self._open: set[socket.socket] = set()
        self._watching: dict[str, int] = dict.fromkeys(COLLECTIONS, 0)
        self.port = 0
        self.httpd: _Server | None = None
        self.start()

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Serve (again, on the same port after stop())."""
        api = self

        class Handler(_Handler):
            fake = api
        if self.listener is not None:
            httpd = _Server(self.listener.getsockname()[:2], Handler, bind_and_activate=False)
            httpd.socket.close()
            httpd.socket = self.listener
        else:
            httpd = _Server(("127.0.0.1", self.port), Handler)
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*self.tls)
            # the handshake in the handler's thread, not in accept(): one slow client holds no other
            httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
        httpd.daemon_threads = True
        self.port = httpd.server_address[1]
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        """The API server gone: no listener, every open connection cut."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        self.drop_watches()
        with self.cond:
            for s in list(self._open):
                _cut(s)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def kubeconfig(self, path: str) -> str:
        return write_kubeconfig(path, self.url)

    # ---- kinds ---------------------------------------------------------------------------------
    def serve_kind(self, group: str, version: str, resource: str, kind: str, namespaced: bool = True) -> str:
        """Serve another kind (as a CRD does): in discovery, listed and watched at its collection.
        Its key for put()/delete(): "GROUP/RESOURCE"."""
        key, gv = f"{group}/{resource}", f"{group}/{version}"
        with self.cond:
            self.collections[key] = (f"/apis/{gv}/{resource}", f"{kind}List", gv)
            self.resources.setdefault(gv, []).append((resource, kind, namespaced))
            self.objects[key], self._encoded[key] = {}, None
            self._watching[key] = 0
            self.cond.notify_all()
        return key

    def unserve_kind(self, key: str) -> None:
        """The kind's CRD deleted: out of discovery, its objects gone, its watches ended."""
        with self.cond:
            path, _, gv = self.collections.pop(key)
            resource = path.rsplit("/", 1)[1]
            self.resources[gv] = [r for r in self.resources[gv] if r[0] != resource]
            if not self.resources[gv]:
                del self.resources[gv]
            self.objects.pop(key)
            self.cond.notify_all()

    def forbid(self, key: str, forbidden: bool = True) -> None:
        """The collection answers 403 Forbidden (the client's RBAC does not grant it), or no longer."""
        with self.cond:
            (self.forbidden.add if forbidden else self.forbidden.discard)(key)

    # ---- objects -------------------------------------------------------------------------------
    def put(self, kind: str, obj: dict) -> int:
        """Create or replace an object (ADDED or MODIFIED to watchers); its new resourceVersion."""
        with self.cond:
            self.rv += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            key = _key(obj)
            typ = "MODIFIED" if key in self.objects[kind] else "ADDED"
            self.objects[kind][key] = obj
            self._encoded[kind] = None
            self.log.append((self.rv, kind, typ, obj))
            self.cond.notify_all()
            return self.rv

    def delete(self, kind: str, namespace: str, name: str) -> int:
        with self.cond:
            obj = self.objects[kind].pop((namespace, name))
            self._encoded[kind] = None
            self.rv += 1
            obj = dict(obj, metadata=dict(obj["metadata"], resourceVersion=str(self.rv)))
            self.log.append((self.rv, kind, "DELETED", obj))
            self.cond.notify_all()
            return self.rv

    def put_quietly(self, kind: str, obj: dict) -> None:
        """Change an object without telling any watcher (what a watch misses while it is away)."""
        with self.cond:
            self.rv += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[kind][_key(obj)] = obj
            self._encoded[kind] = None

    def delete_quietly(self, kind: str, namespace: str, name: str) -> None:
        with self.cond:
            self.rv += 1
            self.objects[kind].pop((namespace, name))
            self._encoded[kind] = None

    # ---- faults --------------------------------------------------------------------------------
    def bookmark(self) -> int:
        """A BOOKMARK at a new resourceVersion to every open watch; that version."""
        with self.cond:
            self.rv += 1
            self.generation["bookmark"] += 1
            self.cond.notify_all()
            return self.rv

    def compact(self) -> None:
        """Forget the history: a watch from any version before now gets 410 Gone."""
        with self.cond:
            self.rv += 1
            self.compacted = self.rv
            self.log.clear()

    def expire_watches(self) -> None:
        """Every open watch gets an ERROR event with a 410 Status, then its stream ends."""
        with self.cond:
            self.compact()
            self.generation["expire"] += 1
            self.cond.notify_all()

    def expire_continues(self, count: int = 1) -> None:
        """The next `count` list requests that carry a continue token get 410 Gone, as the API server
        answers a token whose version was compacted away between two pages."""
        with self.cond:
            self.expired_continues = count

    def drop_watches(self) -> None:
        """Cut every open watch's connection mid-stream (no end chunk)."""
        with self.cond:
            self.generation["drop"] += 1
            self.cond.notify_all()

    def watches(self, kind: str) -> list[dict[str, str]]:
        """The queries of the watch requests made for `kind` so far."""
        with self.cond:
            return [q for k, q in self.requests if k == kind and q.get("watch") == "true"]

    def watching(self, kind: str) -> int:
        """How many watches of `kind` are open now (each sees the faults from here on)."""
        with self.cond:
            return self._watching[kind]

    def lists(self, kind: str) -> int:
        with self.cond:
            return sum(1 for k, q in self.requests if k == kind and q.get("watch") != "true" and "continue" not in q)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # a client that went away, or a connection the test cut, is nothing to print a traceback for
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, ssl.SSLEOFError)):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeKubeAPI

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # headers and body go out in separate writes: without this, Nagle and the client's delayed
        # ACK hold every second response on a kept-alive connection for 40 ms (Go's server sets it too)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()
        with self.fake.cond:
            self.fake._open.add(self.connection)

    def finish(self) -> None:
        with self.fake.cond:
            self.fake._open.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self.fake.cond:
            kind = next((k for k, (path, _, _) in self.fake.collections.items() if path == url.path), None)
            discovery = self._discovery(url.path) if kind is None else None
            forbidden = kind in self.fake.forbidden
            self.fake.requests.append((kind or url.path, query))
        if discovery is not None:
            return self._json(200, discovery)
        if kind is None:
            return self._json(404, _status(404, "NotFound", f"{url.path} is not served by this stand-in"))
        if forbidden:
            return self._json(403, _status(403, "Forbidden", f"{url.path}: forbidden by the stand-in"))
        try:
            if query.get("watch") == "true":
                return self._watch(kind, query)
            self._list(kind, query)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True   # the client went away (or the test cut it): nothing to say

    def do_PATCH(self) -> None:
        """A merge patch (or a strategic merge patch: the same for maps such as metadata.labels)
        of one object: PATCH COLLECTION/NAME. 404 for an object it does not hold, 415 for a JSON
        patch (a list of operations), which nothing of quark's sends."""
        url = urlsplit(self.path)
        collection, _, name = url.path.rpartition("/")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.fake.cond:
            kind = next((k for k, (path, _, _) in self.fake.collections.items() if path == collection), None)
            self.fake.requests.append((f"PATCH {kind or collection}", {"name": name}))
            forbidden = kind in self.fake.forbidden
            current = self.fake.objects[kind].get(("", name)) if kind else None
        ctype = self.headers.get("Content-Type", "")
        if kind is None or current is None:
            return self._json(404, _status(404, "NotFound", f"{url.path}: no such object in the stand-in"))
        if forbidden:
            return self._json(403, _status(403, "Forbidden", f"{url.path}: forbidden by the stand-in"))
        if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            return self._json(415, _status(415, "UnsupportedMediaType", f"{ctype}: the stand-in merges patches only"))
        self.fake.put(kind, _merge(current, json.loads(body)))   # (watchers see MODIFIED)
        with self.fake.cond:
            patched = self.fake.objects[kind][("", name)]
        self._json(200, patched)

    def _discovery(self, path: str) -> dict | None:
        """/apis (APIGroupList) or /apis/GROUP/VERSION (APIResourceList); None for any other path."""
        resources = self.fake.resources
        if path == "/apis":
            groups = {}
            for gv in sorted(resources):
                group, version = gv.split("/")
                groups.setdefault(group, []).append({"groupVersion": gv, "version": version})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": vs, "preferredVersion": vs[0]} for g, vs in groups.items()]}
        gv = path[len("/apis/"):] if path.startswith("/apis/") else None
        if gv not in resources:
            return None
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": [
            {"name": r, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["get", "list", "watch"]}
            for r, k, ns in resources[gv]]}

    def _json(self, code: int, body: dict) -> None:
        self._send(code, json.dumps(body).encode())

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _list(self, kind: str, query: dict[str, str]) -> None:
        fake = self.fake
        _, list_kind, version = fake.collections[kind]
        with fake.cond:
            expired = "continue" in query and fake.expired_continues > 0
            fake.expired_continues -= expired
        if expired:
            return self._json(410, _status(410, "Expired", "The provided continue parameter is too old"))
        with fake.cond:
            if "continue" in query:
                rv, start = (int(x) for x in query["continue"].split(":"))
            else:
                rv, start = fake.rv, 0
            if fake._encoded[kind] is None:   # kept until the kind changes: serving stays cheap
                fake._encoded[kind] = [json.dumps(fake.objects[kind][k]).encode() for k in sorted(fake.objects[kind])]
            items = fake._encoded[kind]
        limit = int(query.get("limit") or 0) or len(items) + 1
        meta = {"resourceVersion": str(rv)}
        if start + limit < len(items):
            meta["continue"] = f"{rv}:{start + limit}"
        head = json.dumps({"kind": list_kind, "apiVersion": version, "metadata": meta}).encode()
        self._send(200, head[:-1] + b', "items": [' + b", ".join(items[start:start + limit]) + b"]}")

    def _watch(self, kind: str, query: dict[str, str]) -> None:
        fake = self.fake
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with fake.cond:
            seen = dict(fake.generation)
            if since < fake.compacted:
                gone = f"too old resource version: {since} ({fake.compacted})"
                self._chunk({"type": "ERROR", "object": _status(410, "Expired", gone)})
                return self._end()
            fake._watching[kind] += 1
        try:
            self._stream(kind, since, seen, deadline, bookmarks)
        finally:
            with fake.cond:
                fake._watching[kind] -= 1

    def _stream(self, kind: str, cursor: int, seen: dict, deadline: float, bookmarks: bool) -> None:
        fake = self.fake
        while True:
            with fake.cond:
                fake.cond.wait_for(lambda: fake.generation != seen or time.monotonic() >= deadline
                                   or kind not in fake.collections
                                   or any(rv > cursor and k == kind for rv, k, _, _ in fake.log[-50:]), 0.2)
                gen = dict(fake.generation)
                events = [(rv, t, o) for rv, k, t, o in fake.log if rv > cursor and k == kind]
                current = fake.rv
                served = kind in fake.collections
            if not served:
                return self._end()   # the kind's CRD went: the API server ends its watches
            if gen["drop"] != seen["drop"]:
                return _cut(self.connection)
            for rv, typ, obj in events:
                self._chunk({"type": typ, "object": obj})
                cursor = rv
            if gen["expire"] != seen["expire"]:
                self._chunk({"type": "ERROR", "object": _status(410, "Expired", "the watch expired")})
                return self._end()
            if gen["bookmark"] != seen["bookmark"] and bookmarks:
                self._chunk({"type": "BOOKMARK", "object": {
                    "kind": fake.collections[kind][1][:-4], "apiVersion": fake.collections[kind][2],
                    "metadata": {"resourceVersion": str(current)}}})
                cursor = max(cursor, current)
            seen = gen
            if time.monotonic() >= deadline:
                return self._end()

    def _chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _merge(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch: maps merge key by key, null removes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def write_kubeconfig(path: str, server: str) -> str:
    """A kubeconfig for the official client: `server`, no credentials (this stand-in asks for none)."""
    with open(path, "w") as f:
        json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                   "clusters": [{"name": "fake", "cluster": {"server": server}}],
                   "users": [{"name": "fake", "user": {}}],
                   "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}, f)
    return path


def make_tls(directory: str, ip: str = "127.0.0.1") -> tuple[str, str]:
    """A self-signed certificate for `ip` (openssl) and its key: (certificate, key) paths. The
    certificate is its own CA: it is the ca.crt a service account is given."""
    cert, key = os.path.join(directory, "apiserver.crt"), os.path.join(directory, "apiserver.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=kube-apiserver", "-addext", f"subjectAltName=IP:{ip}",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


def write_service_account(directory: str, ca_cert: str, namespace: str) -> str:
    """What kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount: token, ca.crt,
    namespace. Answers `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(ca_cert) as f:
        ca = f.read()
    for name, text in (("token", "stand-in-token"), ("ca.crt", ca), ("namespace", namespace)):
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return directory


def _cut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


# ---- objects from the client's own models -------------------------------------------------------

def _plain(model) -> dict:
    from kubernetes.client import ApiClient
    return ApiClient().sanitize_for_serialization(model)


def node(name: str, internal_ip: str, pod_cidrs: list[str]) -> dict:
    from kubernetes.client import V1Node, V1NodeAddress, V1NodeSpec, V1NodeStatus, V1ObjectMeta
    return _plain(V1Node(api_version="v1", kind="Node", metadata=V1ObjectMeta(name=name),
                         spec=V1NodeSpec(pod_cidr=pod_cidrs[0] if pod_cidrs else None, pod_cidrs=pod_cidrs),
                         status=V1NodeStatus(addresses=[V1NodeAddress(type="InternalIP", address=internal_ip),
                                                        V1NodeAddress(type="Hostname", address=name)])))


def pod(name: str, ips: list[str], node_name: str | None, *, namespace: str = "default",
        runtime_class: str | None = "quark", phase: str = "Running", labels: dict | None = None,
        host_network: bool = False) -> dict:
    from kubernetes.client import V1Container, V1ObjectMeta, V1Pod, V1PodIP, V1PodSpec, V1PodStatus
    return _plain(V1Pod(
        api_version="v1", kind="Pod",
        metadata=V1ObjectMeta(name=name, namespace=namespace, labels=labels or {"app": name}, uid=f"uid-{name}"),
        spec=V1PodSpec(containers=[V1Container(name="c", image="busybox")], node_name=node_name,
                       runtime_class_name=runtime_class, host_network=host_network or None),
        status=V1PodStatus(phase=phase, pod_ip=ips[0] if ips else None, pod_ips=[V1PodIP(ip=i) for i in ips])))


def service(name: str, cluster_ip: str, ports: list[tuple[str | None, int, int]], *, namespace: str = "default",
            affinity: str | None = None, internal_policy: str | None = None,
            affinity_seconds: int | None = None) -> dict:
    """ports: (name, port, targetPort). affinity_seconds: sessionAffinityConfig.clientIP.timeoutSeconds."""
    from kubernetes.client import (V1ClientIPConfig, V1ObjectMeta, V1Service, V1ServicePort, V1ServiceSpec,
                                   V1SessionAffinityConfig)
    config = None if affinity_seconds is None else V1SessionAffinityConfig(
        client_ip=V1ClientIPConfig(timeout_seconds=affinity_seconds))
    return _plain(V1Service(
        api_version="v1", kind="Service", metadata=V1ObjectMeta(name=name, namespace=namespace),
        spec=V1ServiceSpec(cluster_ip=cluster_ip, cluster_ips=[cluster_ip], type="ClusterIP",
                           session_affinity=affinity, internal_traffic_policy=internal_policy,
                           session_affinity_config=config,
                           ports=[V1ServicePort(name=n, port=p, target_port=t, protocol="TCP") for n, p, t in ports],
                           selector={"app": name})))


def endpoint_slice(name: str, service_name: str, endpoints: list[tuple[str, bool | None, str | None]],
                   ports: list[tuple[str | None, int]], *, namespace: str = "default",
                   address_type: str = "IPv4") -> dict:
    """endpoints: (address, ready, nodeName); ports: (name, port)."""
    from kubernetes.client import (DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice,
                                   V1ObjectMeta)
    return _plain(V1EndpointSlice(
        api_version="discovery.k8s.io/v1", kind="EndpointSlice", address_type=address_type,
        metadata=V1ObjectMeta(name=name, namespace=namespace,
                              labels={"kubernetes.io/service-name": service_name}),
        endpoints=[V1Endpoint(addresses=[a], conditions=V1EndpointConditions(ready=r), node_name=n)
                   for a, r, n in endpoints],
        ports=[DiscoveryV1EndpointPort(name=n, port=p, protocol="TCP") for n, p in ports]))


def network_policy(name: str, spec, *, namespace: str = "default") -> dict:
    """spec: a V1NetworkPolicySpec (the client's model)."""
    from kubernetes.client import V1NetworkPolicy, V1ObjectMeta
    return _plain(V1NetworkPolicy(api_version="networking.k8s.io/v1", kind="NetworkPolicy",
                                  metadata=V1ObjectMeta(name=name, namespace=namespace), spec=spec))


def namespace(name: str, labels: dict | None = None) -> dict:
    from kubernetes.client import V1Namespace, V1ObjectMeta
    return _plain(V1Namespace(api_version="v1", kind="Namespace", metadata=V1ObjectMeta(name=name, labels=labels)))
