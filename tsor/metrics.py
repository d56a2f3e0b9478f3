"""tsord's counters, served in the Prometheus text format over HTTP on a TCP port or unix socket.

prometheus_client does the exposition (its registry, text format and HTTP handler) and the parsing
(`parse`, for `quark tsor status` and the tests). `Metrics` is a custom collector: the counts live
here as plain numbers under one lock and become metric families only at scrape time, because two of
them (gauges, bytes) are read from the daemon and the kernel on each scrape anyway. prometheus_client
is imported only where it is used: importing it (http.server, email, urllib) costs tsord start-up
time that a tsord without a metrics endpoint need not pay.

Bytes: no process sits in the local and tcp paths' data path, so tsord cannot count them itself. For
the tcp path the kernel does (tcpi_bytes_acked / tcpi_bytes_received of the sockets tsord handed out,
read with sock_diag: tsor/bytecount.py), and `byte_counts` serves them as tsor_bytes_total{path="tcp"}.
Linux keeps no byte count for AF_UNIX sockets, so the local path has no tsor_bytes_total samples. The
rdma path's pump is tsord's own (transport/rdma.py): it counts the application bytes it moves.

`rdma_links` gives the rdma links that are up, by peer node (tsor_rdma_links{node,provider,device,pump},
provider "pyverbs" (or the host tests' "softverbs"), and tsor_rdma_connections{node}); `rdma_resets` the links reset, by
reason (tsor_rdma_link_resets_total{reason}: transport/rdma.py).
"""
from __future__ import annotations

import http.client
import logging
import os
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tsor.config import HostPort

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

log = logging.getLogger("tsor.metrics")
PATHS = ("local", "tcp", "rdma", "fallback")
GAUGE_HELP = {"sandboxes": "Sandboxes registered with this node's tsord.",
              "listeners": "Listening sockets sandboxes on this node have announced.",
              "pods": "Pods quark-cni registered with this node's tsord.",
              "route_pods": "Quark pod addresses in the route table (routes from Kubernetes).",
              "route_services": "Service ClusterIP:ports in the route table (routes from Kubernetes).",
              "service_ports_left_to_node": "Service ports the connect-time balancer's maps had no room for: "
                                            "the node's NAT (kube-proxy) serves them.",
              "sockmap_addresses_not_carried": "Registered pod addresses the sockmap path's address map had no "
                                               "room for: their connections take the stack.",
              "remote_path_accepted": "Pods' connections to other nodes' pods the pump's listener took and "
                                      "carried (the kernel-chosen remote path, tsor/remote_path.py).",
              "remote_path_unclaimed": "Connections the pump's listener reset: no note of where they went, "
                                       "or no link or slot to carry them.",
              "remote_path_verdicts": "NetworkPolicy verdicts tsord decided for the remote path's connects.",
              "remote_path_networks_left_native": "Linked nodes' pod networks the remote path's map had no room "
                                                  "for: their connects are native."}
CLIENT_TIMEOUT = 2.0   # a scraper that connects and says nothing holds its thread this long


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.connections = dict.fromkeys(PATHS, 0)       # outgoing, by the path they took
        self.incoming = dict.fromkeys(PATHS[:3], 0)      # delivered to a listener here
        self.setup_seconds = dict.fromkeys(PATHS, 0.0)
        self.protocol_errors = 0
        self.refused_claims = 0
        self._policy_native = {"deny": 0, "unknown": 0, "foreign": 0}   # connections policy kept native
        self._limited = {"setups": 0, "offers": 0, "backlog": 0}          # ... and per-sandbox bounds
        self.gauges: Callable[[], dict[str, int]] = dict
        self.byte_counts: Callable[[], dict[tuple[str, str], int]] = dict
        self.rdma_links: Callable[[], dict[str, dict]] = dict   # RdmaTransport.status()
        self.rdma_resets: Callable[[], dict[str, int]] = dict   # RdmaEngine.resets: links reset, by reason
        self.route_source: Callable[[], dict[str, dict]] = dict  # KubernetesSource.status(), by kind
        # (ForeignKind, scope) of the policy kinds tsord does not evaluate that send connections
        # native now (tsor/policy_kinds.py ForeignPolicies.scopes)
        self.foreign_policies: Callable[[], list] = list
        self.warm_setups: Callable[[], int] = int   # TcpTransport's warm set-ups taken
        self._registry: CollectorRegistry | None = None

    def connected(self, path: str, seconds: float) -> None:
        with self._lock:
            self.connections[path] += 1
            self.setup_seconds[path] += seconds

    def delivered(self, path: str) -> None:
        with self._lock:
            self.incoming[path] += 1

    def tallied(self, path: str, connections: int, incoming: int = 0) -> None:
        """Connections sandboxes made (and took) without asking tsord: over their direct channels,
        or native on a cached fallback answer (tsor/peers.py). Nothing is delivered on fallback."""
        with self._lock:
            self.connections[path] += connections
            if incoming:
                self.incoming[path] += incoming

    def limited(self, limit: str) -> None:
        """A connection left native because a per-sandbox bound was reached (tsor/daemon.py)."""
        with self._lock:
            self._limited[limit] += 1

    def policy_native(self, verdict: str) -> None:
        with self._lock:
            self._policy_native[verdict] += 1

    def error(self, kind: str) -> None:
        with self._lock:
            if kind == "protocol":
                self.protocol_errors += 1
            else:
                self.refused_claims += 1

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: the metric families, from the counts of now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        with self._lock:
            per_path = [("tsor_connections_total", "Connections set up from sandboxes on this node, by path.",
                         dict(self.connections)),
                        ("tsor_incoming_total", "Connections delivered to listeners on this node, by path.",
                         dict(self.incoming)),
                        ("tsor_setup_seconds_total", "Time spent setting connections up, by path.",
                         dict(self.setup_seconds))]
            errors, refused = self.protocol_errors, self.refused_claims
            policy = dict(self._policy_native)
            limited = dict(self._limited)
        for name, doc, values in per_path:
            fam = CounterMetricFamily(name, doc, labels=["path"])
            for p, n in values.items():
                fam.add_metric([p], n)
            yield fam
        yield CounterMetricFamily("tsor_protocol_errors_total", "Malformed messages from sandboxes.", value=errors)
        fam = CounterMetricFamily("tsor_policy_native_total", "Connections left native because NetworkPolicy "
                                  "denies them (deny), tsord cannot evaluate it (unknown), or a policy kind "
                                  "tsord does not evaluate could govern them (foreign).", labels=["verdict"])
        for v, n in policy.items():
            fam.add_metric([v], n)
        yield fam
        fam = CounterMetricFamily("tsor_limited_total", "Connections left native because a per-sandbox bound "
                                  "was reached: setups (the connecting sandbox's connects being set up at once), "
                                  "offers (connections waiting for the listening sandbox to take them), backlog "
                                  "(its listener's backlog of queued connections).", labels=["limit"])
        for v, n in limited.items():
            fam.add_metric([v], n)
        yield fam
        yield CounterMetricFamily("tsor_tcp_warm_setups_total", "tcp-path connections whose set-up started "
                                  "on a connection to the peer tsord opened ahead.", value=self.warm_setups())
        yield CounterMetricFamily("tsor_refused_total",
                                  "Requests refused: claims of addresses a sandbox does not own.", value=refused)
        fam = CounterMetricFamily("tsor_bytes_total", "Bytes this node's pods sent/received, by path (tcp and "
                                  "rdma: AF_UNIX keeps no counts; see tsor/metrics.py).", labels=["path", "direction"])
        for (p, d), n in sorted(self.byte_counts().items()):
            fam.add_metric([p, d], n)
        yield fam
        links = GaugeMetricFamily("tsor_rdma_links", "rdma links up, by peer node, verbs provider "
                                  "(pyverbs; softverbs: the tests' software RDMA) and pump "
                                  "(compiled: transport/rdma_pump.c; python: transport/rdma.py).",
                                  labels=["node", "provider", "device", "pump"])
        conns = GaugeMetricFamily("tsor_rdma_connections", "Connections open on the rdma link to each peer node.",
                                  labels=["node"])
        for node, link in sorted(self.rdma_links().items()):
            if link["up"]:
                links.add_metric([node, link["provider"], link["device"], link["pump"]], 1)
                conns.add_metric([node], link["connections"])
        yield links
        yield conns
        fam = CounterMetricFamily("tsor_rdma_link_resets_total", "rdma links reset, by reason: protocol (the "
                                  "peer broke the ring protocol), stalled (it granted no link credits), verbs (a "
                                  "work request or verb failed, e.g. the peer's QP went).", labels=["reason"])
        for reason, n in sorted(self.rdma_resets().items()):
            fam.add_metric([reason], n)
        yield fam
        yield from _route_source_families(self.route_source())
        foreign = GaugeMetricFamily("tsor_policy_foreign", "Policy kinds the cluster serves that tsord does not "
                                    "evaluate, and where they send connections native: scope cluster (every "
                                    "connection) or namespace/NAME (from or to its pods).",
                                    labels=["kind", "api", "scope"])
        for k, scope in self.foreign_policies():
            foreign.add_metric([k.kind, f"{k.group}/{k.version}", scope], 1)
        yield foreign
        for name, value in self.gauges().items():
            yield GaugeMetricFamily(f"tsor_{name}", GAUGE_HELP.get(name, f"tsor {name}."), value=value)

    def registry(self) -> CollectorRegistry:
        """A registry of its own (not prometheus_client's global one, which also holds the Python
        process collectors): several daemons can run in one process, as the tests do."""
        if self._registry is None:
            from prometheus_client.registry import CollectorRegistry
            reg = CollectorRegistry()
            reg.register(self)
            self._registry = reg
        return self._registry

    def render(self) -> str:
        """The Prometheus text format (0.0.4)."""
        from prometheus_client.exposition import generate_latest
        return generate_latest(self.registry()).decode()


def _route_source_families(kinds: dict[str, dict]) -> Iterator[Metric]:
    """The Kubernetes route source's health by kind: listed yet, relists (410s), watch events, failures."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    if not kinds:
        return
    synced = GaugeMetricFamily("tsor_route_source_synced", "1 once the kind is listed from the API server.",
                               labels=["kind"])
    counters = [(key, CounterMetricFamily(f"tsor_route_source_{key}_total", doc, labels=["kind"])) for key, doc in (
        ("relists", "Lists of the kind (the first, then one per 410 Gone)."),
        ("events", "Watch events applied (bookmarks included)."),
        ("errors", "Failed lists and watches (dropped, API server unreachable); each retried with backoff."))]
    for kind, st in sorted(kinds.items()):
        synced.add_metric([kind], int(st["synced"]))
        for key, fam in counters:
            fam.add_metric([kind], st[key])
    yield synced
    for _, fam in counters:
        yield fam


class _Quiet:
    def handle_error(self, request: object, client_address: object) -> None:
        # socketserver prints a traceback to stderr (it calls this inside its except clause); a
        # scraper that hung up is not worth one
        log.debug("metrics client %r: %r", client_address, sys.exc_info()[1])


class _UnixServer(_Quiet, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TcpServer(_Quiet, socketserver.ThreadingTCPServer):
    # socketserver's, not http.server's HTTPServer: that one resolves its address's FQDN at bind
    daemon_threads = True
    allow_reuse_address = True


class MetricsServer:
    """prometheus_client's HTTP handler (content negotiation: text or OpenMetrics, gzip) on a TCP
    port or a unix socket; its own start_http_server binds only TCP and sets no client timeout."""

    def __init__(self, metrics: Metrics, where: HostPort | str) -> None:
        from prometheus_client.exposition import MetricsHandler
        handler = type("TsorMetricsHandler", (MetricsHandler,),
                       {"registry": metrics.registry(), "timeout": CLIENT_TIMEOUT})
        self.metrics = metrics
        self.server: socketserver.BaseServer
        if isinstance(where, str):
            try:
                os.unlink(where)
            except FileNotFoundError:
                pass
            self.server = _UnixServer(where, handler)
            self.path: str | None = where
        else:
            server_class = type("TcpServer", (_TcpServer,),
                                {"address_family": socket.AF_INET6 if ":" in where.host else socket.AF_INET})
            self.server = server_class((where.host, where.port), handler)
            self.path = None
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def fetch(where: HostPort | str, timeout: float = 2.0) -> str:
    """The metrics text from a running tsord (used by `quark tsor status`). OSError when it does not
    answer with them."""
    if isinstance(where, str):
        conn: http.client.HTTPConnection = _UnixHTTPConnection(where, timeout)
    else:
        conn = http.client.HTTPConnection(where.host, where.port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
    except http.client.HTTPException as e:
        raise OSError(f"not an HTTP answer: {e!r}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise OSError(f"HTTP {resp.status} {resp.reason}")
    return body.decode()


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="value",...}': value}, labels sorted by name (as
    prometheus_client writes them), so a key does not depend on the writer. ValueError when the text
    is not in the format."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
