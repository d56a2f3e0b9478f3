"""`python -m tests.demo.tsor_demo` (`make demo` runs it after qvisor's demo): a server and a client
container on one node with tsord running; prints which path each connection took.

The client container connects three times: to the server pod (TSoR's local path: one AF_UNIX
socketpair, no process in between), to its own loopback (stays in the pod), and to a port nobody
listens on in the server pod (native TCP: ECONNREFUSED, as without quark).
"""
from __future__ import annotations

import os
import sys
import time

from tests.support.testbed import Testbed
from tsor.metrics import fetch, parse

CLIENT = r"""
import socket, struct, os
def kind(s):
    # a kernel TCP socket of this pod is listed in /proc/net/tcp by its inode; a TSoR end is not
    ino = str(os.fstat(s.fileno()).st_ino)
    tcp = any(l.split()[9] == ino for t in ('/proc/net/tcp', '/proc/net/tcp6') for l in open(t).readlines()[1:])
    return 'kernel TCP' if tcp else 'AF_UNIX underneath (TSoR local path)'
s = socket.create_connection(('{ip}', 8080), timeout=5)
s.sendall(b'GET / HTTP/1.0\r\n\r\n'); reply = s.recv(100).split(b'\r\n')[0].decode()
print(f'client -> server {ip}:8080   {{reply}}; getpeername={{s.getpeername()}}; {{kind(s)}}')
l = socket.create_server(('127.0.0.1', 9000)); c = socket.create_connection(('127.0.0.1', 9000))
print(f'client -> own 127.0.0.1:9000 connected; {{kind(c)}} (loopback stays in the pod)')
try:
    socket.create_connection(('{ip}', 8081), timeout=5)
except ConnectionRefusedError as e:
    print(f'client -> server {ip}:8081   {{e.strerror}} (nothing listens: native TCP answered)')
"""


def main() -> int:
    if os.geteuid() != 0:
        print("the TSoR demo needs root (network namespaces, containers)", file=sys.stderr)
        return 1
    bed = Testbed(prefix="qdemo", octet=217)
    try:
        node = bed.node("demo")
        node.start_tsord()
        srv, cli = node.pod("server"), node.pod("client")
        print(f"node 'demo': tsord on {node.socket}; pods: server {srv.ip}, client {cli.ip}")
        bed.start("quark", "tsor-server", bed.bundle("server", ["busybox", "httpd", "-f", "-p", "8080", "-h", "/etc"], srv))
        time.sleep(0.5)
        r = bed.run("quark", "tsor-client", bed.bundle("client", ["python3", "-c", CLIENT.format(ip=srv.ip)], cli))
        print(r.stdout, end="")
        if r.returncode:
            print(r.stderr, file=sys.stderr)
        counts = parse(fetch(node.metrics))
        key = 'tsor_connections_total{path="%s"}'
        per_path = [f"{p} {int(counts[key % p])}" for p in ("local", "tcp", "fallback")]
        print("tsord counters (quark tsor status):", ", ".join(per_path))
        return r.returncode
    finally:
        bed.close()


if __name__ == "__main__":
    sys.exit(main())
