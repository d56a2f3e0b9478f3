"""tsord's counters, served in the Prometheus text format over HTTP on a TCP port or unix socket.

Bytes: no process sits in either path's data path, so tsord cannot count them itself. For the tcp
path the kernel does (tcpi_bytes_acked / tcpi_bytes_received of the sockets tsord handed out, read
with sock_diag: tsor/bytecount.py), and `byte_counts` serves them as tsor_bytes_total{path="tcp"}.
Linux keeps no byte count for AF_UNIX sockets, so the local path has no tsor_bytes_total samples.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable

from tsor.config import HostPort

log = logging.getLogger("tsor.metrics")
PATHS = ("local", "tcp", "fallback")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.connections = dict.fromkeys(PATHS, 0)       # outgoing, by the path they took
        self.incoming = dict.fromkeys(PATHS[:2], 0)      # delivered to a listener here
        self.setup_seconds = dict.fromkeys(PATHS, 0.0)
        self.protocol_errors = 0
        self.refused_claims = 0
        self.gauges: Callable[[], dict[str, int]] = lambda: {}
        self.byte_counts: Callable[[], dict[str, int]] = lambda: {}

    def connected(self, path: str, seconds: float) -> None:
        with self._lock:
            self.connections[path] += 1
            self.setup_seconds[path] += seconds

    def delivered(self, path: str) -> None:
        with self._lock:
            self.incoming[path] += 1

    def error(self, kind: str) -> None:
        with self._lock:
            if kind == "protocol":
                self.protocol_errors += 1
            else:
                self.refused_claims += 1

    def render(self) -> str:
        with self._lock:
            lines = ["# HELP tsor_connections_total Connections set up from sandboxes on this node, by path.",
                     "# TYPE tsor_connections_total counter"]
            lines += [f'tsor_connections_total{{path="{p}"}} {n}' for p, n in self.connections.items()]
            lines += ["# HELP tsor_incoming_total Connections delivered to listeners on this node, by path.",
                      "# TYPE tsor_incoming_total counter"]
            lines += [f'tsor_incoming_total{{path="{p}"}} {n}' for p, n in self.incoming.items()]
            lines += ["# HELP tsor_setup_seconds_total Time spent setting connections up, by path.",
                      "# TYPE tsor_setup_seconds_total counter"]
            lines += [f'tsor_setup_seconds_total{{path="{p}"}} {s:.6f}' for p, s in self.setup_seconds.items()]
            lines += ["# HELP tsor_protocol_errors_total Malformed messages from sandboxes.",
                      "# TYPE tsor_protocol_errors_total counter", f"tsor_protocol_errors_total {self.protocol_errors}",
                      "# HELP tsor_refused_total Requests refused: claims of addresses a sandbox does not own.",
                      "# TYPE tsor_refused_total counter", f"tsor_refused_total {self.refused_claims}"]
        lines += ["# HELP tsor_bytes_total Bytes this node's pods sent/received, by path (tcp only: "
                  "AF_UNIX keeps no counts; see tsor/bytecount.py).",
                  "# TYPE tsor_bytes_total counter"]
        lines += [f'tsor_bytes_total{{path="{p}",direction="{d}"}} {n}'
                  for (p, d), n in sorted(self.byte_counts().items())]
        for name, value in self.gauges().items():
            lines += [f"# TYPE tsor_{name} gauge", f"tsor_{name} {value}"]
        return "\n".join(lines) + "\n"


class MetricsServer:
    """A minimal HTTP/1.0 responder: every GET gets the metrics text."""

    def __init__(self, metrics: Metrics, where: HostPort | str) -> None:
        self.metrics = metrics
        if isinstance(where, str):
            try:
                os.unlink(where)
            except FileNotFoundError:
                pass
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.sock.bind(where)
            self.path = where
        else:
            fam = socket.AF_INET6 if ":" in where.host else socket.AF_INET
            self.sock = socket.socket(fam, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((where.host, where.port))
            self.path = None
        self.sock.listen(16)
        threading.Thread(target=self._loop, name="metrics", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2)
                    req = b""
                    while b"\r\n\r\n" not in req and b"\n\n" not in req and len(req) < 8192:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        req += chunk
                    body = self.metrics.render().encode()
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                except OSError as e:
                    log.debug("metrics client: %s", e)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def fetch(where: HostPort | str, timeout: float = 2.0) -> str:
    """The metrics text from a running tsord (used by `quark tsor status`)."""
    if isinstance(where, str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr: object = where
    else:
        s = socket.socket(socket.AF_INET6 if ":" in where.host else socket.AF_INET, socket.SOCK_STREAM)
        addr = (where.host, where.port)
    with s:
        s.settimeout(timeout)
        s.connect(addr)
        s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    _, _, body = data.partition(b"\r\n\r\n")
    return body.decode()


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
