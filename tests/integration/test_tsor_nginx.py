"""TSoR with real nginx (issue 13): Debian 12's nginx with its default nginx.conf, unmodified
(sendfile on, tcp_nopush on, worker_processes auto), in a quark container, and wrk in another
quark container in another pod on the same node. Every response's status and body are checked
(a wrk Lua script), wrk's error counts must be zero, and tsord must have counted the connections
on the local path. The same again with tsord's `local_path: sockmap`, where nothing is trapped and
the proof is the server pod's eth0: the responses' bytes never cross it."""
from __future__ import annotations

import re
import shutil

import pytest

from tests.integration.conftest import needs_root
from tests.support.nginx import INDEX
from tests.support.testbed import eth0_bytes, local_connections, python_succeeds, sockmap_skip_reason

WRK_SECONDS = 2
CONNECTIONS = 4
# wrk's threads each run this; the summary adds up every thread's counts (wrk's setup/done hooks)
CHECK_LUA = """
local f = assert(io.open("/out/expected.html", "rb"))
local expected = f:read("*a")
f:close()
checked, bad = 0, 0
function response(status, headers, body)
  checked = checked + 1
  if status ~= 200 or body ~= expected then bad = bad + 1 end
end
local threads = {}
function setup(thread) table.insert(threads, thread) end
function done(summary, latency, requests)
  local c, b = 0, 0
  for _, t in ipairs(threads) do c = c + t:get("checked"); b = b + t:get("bad") end
  io.write(string.format("checked %d bad %d\\n", c, b))
end
"""


def wait_http(pod, timeout: float = 30) -> None:
    """Until nginx answers on port 80 (a plain TCP connection from the node, not through TSoR)."""
    code = (f"import socket; s = socket.create_connection(('{pod.ip}', 80), timeout=1);"
            "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); assert s.recv(12).startswith(b'HTTP/1.1 200')")
    assert python_succeeds(pod.node.netns, code, timeout, interval=0.2), \
        f"nginx did not answer on {pod.ip}:80 within {timeout}s"


@pytest.fixture(scope="module", params=["socketpair", "sockmap"])
def bed(request):
    needs_root()
    local_path = request.param
    if local_path == "sockmap" and sockmap_skip_reason():
        pytest.skip(sockmap_skip_reason())
    import qkernel.request
    if not hasattr(qkernel.request, "InstallFd"):
        pytest.skip("QKernel's TSoR wiring (fd installation, sys_socket handlers) is not in this tree yet")
    if shutil.which("wrk") is None:
        pytest.skip("needs wrk (the Debian package; `make install` apt-installs it)")
    from tests.support.nginx import (
        INDEX,
        NginxUnavailable,
        ensure_nginx,
        prepare_bundle,
    )
    try:
        ngx = ensure_nginx()
    except NginxUnavailable as e:
        pytest.skip(f"needs Debian's nginx package (downloaded, not installed): {e}")
    from tests.support.testbed import Testbed
    b = Testbed(prefix="qtng", octet=218)
    try:
        node = b.node("a")
        node.start_tsord(local_path=local_path)
        srv, cli = node.pod("ngx"), node.pod("wrk")
        bundle = b.bundle("nginx", ["nginx"], srv)
        prepare_bundle(bundle, ngx)
        b.start("quark", "nginx", bundle)
        wait_http(srv)
        with open(b.out("expected.html"), "wb") as f:
            f.write(INDEX)
        with open(b.out("check.lua"), "w") as f:
            f.write(CHECK_LUA)
        b.srv, b.cli, b.node_a, b.local_path = srv, cli, node, local_path
        yield b
    finally:
        b.close()
        if local_path == "sockmap":   # tsord leaves its programs attached for the connections they carry
            from tsor import sockmap
            from tsor.sockopt_offload import cgroup2_root
            sockmap.remove_attached(cgroup2_root())


def run_wrk(bed, name: str, extra: str) -> tuple[str, int]:
    """wrk from a quark container in the client pod: its output and the requests it completed."""
    cmd = (f"wrk -t1 -c{CONNECTIONS} -d{WRK_SECONDS}s {extra} -s /out/check.lua "
           f"http://{bed.srv.ip}/ > /out/{name}.txt 2>&1")
    r = bed.run("quark", name, bed.bundle(name, ["sh", "-c", cmd], bed.cli), timeout=60)
    with open(bed.out(f"{name}.txt")) as f:
        text = f.read()
    assert r.returncode == 0, f"wrk failed: {text} {r.stderr[-2000:]}"
    assert "Non-2xx or 3xx responses" not in text, text     # wrk prints these lines only when not zero
    assert "Socket errors" not in text, text
    m = re.search(r"checked (\d+) bad (\d+)", text)
    assert m, text
    checked, bad = int(m[1]), int(m[2])
    requests = int(re.search(r"(\d+) requests in", text)[1])
    assert bad == 0, f"{bad} of {checked} responses were not 200 with the 1 KiB index: {text}"
    assert checked >= requests > 0, text
    return text, requests


@pytest.mark.timeout(180)
def test_keepalive_requests_over_the_local_path(bed):
    before, crossed = local_connections(bed.node_a), eth0_bytes(bed.srv.netns_path)
    text, requests = run_wrk(bed, "wrk-ka", "")
    after, crossed = local_connections(bed.node_a), eth0_bytes(bed.srv.netns_path) - crossed
    assert requests > 2 * CONNECTIONS, f"keep-alive: several requests per connection expected: {text}"
    if bed.local_path == "sockmap":
        # nothing trapped, no connection handed out; the kernel's connections, whose requests and
        # 1 KiB responses went socket to socket: through the stack each request would put over
        # 1 KiB on eth0; here only handshakes and closes cross it (nginx closes a connection after
        # keepalive_requests, 1000, and wrk opens another), a few hundred bytes per 1000 requests
        assert after == before
        assert crossed < 8 * requests, f"{crossed} bytes crossed eth0 for {requests} requests: {text}"
    else:
        # each of wrk's connections was made through tsord's local path (and none more were needed)
        assert after - before >= CONNECTIONS, f"local-path connections {before} -> {after}: {text}"
    print(text)


@pytest.mark.timeout(180)
def test_connection_per_request_over_the_local_path(bed):
    before, crossed = local_connections(bed.node_a), eth0_bytes(bed.srv.netns_path)
    text, requests = run_wrk(bed, "wrk-close", "-H 'Connection: close'")
    after, crossed = local_connections(bed.node_a), eth0_bytes(bed.srv.netns_path) - crossed
    if bed.local_path == "sockmap":
        # a handshake and a close per request cross eth0 (a few hundred bytes), not the 1 KiB
        # response, nor the request
        assert after == before
        assert crossed < requests * len(INDEX), f"{crossed} bytes crossed eth0 for {requests} requests: {text}"
    else:
        # one connection per request, every one on the local path
        assert after - before >= requests, f"{requests} requests, local-path connections {before} -> {after}: {text}"
    print(text)
