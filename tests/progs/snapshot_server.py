"""A Python HTTP server with warm state, for hibernation tests and bench/snapshot.py.

    python3 snapshot_server.py PORT [STATE_MIB]

It imports a realistic set of the standard library (what a small web service loads), builds
STATE_MIB MiB of state (default 32) whose digest it keeps, and serves:
    GET /        {"digest": ..., "requests": N}   (the digest is recomputed over the whole state,
                 so a response proves every page of it came back intact)
    GET /hello   a few bytes, touching little (the "first request" of the benchmark)
"""
from __future__ import annotations

import collections  # noqa: F401 — the imports are the point: a warm service has them loaded
import csv  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import email.message  # noqa: F401
import hashlib
import http.server
import json
import logging  # noqa: F401
import random
import re  # noqa: F401
import sqlite3  # noqa: F401
import sys
import urllib.parse  # noqa: F401
import uuid  # noqa: F401
import xml.etree.ElementTree  # noqa: F401

PORT = int(sys.argv[1])
STATE = [random.randbytes(1 << 16) for _ in range(int(sys.argv[2]) * 16 if len(sys.argv) > 2 else 32 * 16)]
DIGEST = hashlib.sha256(b"".join(STATE)).hexdigest()
served = 0


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        global served
        served += 1
        if self.path == "/hello":
            body = b"hello\n"
        else:
            body = json.dumps({"digest": hashlib.sha256(b"".join(STATE)).hexdigest(), "expected": DIGEST,
                               "requests": served}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


http.server.HTTPServer(("0.0.0.0", PORT), Handler).serve_forever()
