"""TSoR's rdma path across two nodes on one machine: two network namespaces joined by a veth, a
tsord in each, quark pods on both. Three times: over softverbs (`transport: softverbs`, any host), and
over a real verbs device (`transport: rdma`; both nodes' queue pairs on the host's first device, which
loops them back: `make test-rdma` runs them in the soft-RoCE lane, tests/vm/README.md) with the
compiled pump (transport/rdma_pump.c, tsord's default) and with the Python one (`rdma: {pump:
python}`). The TCP semantics program, streams of 1 byte to 64 MiB, iperf3 and redis, and a peer tsord
killed mid-stream."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.integration.test_tsor import CHECKS, wait_file
from tests.integration.test_tsor_two_nodes import client_semantics, counters, two_nodes
from tests.support.rdma import device_or_skip

STREAM = ("import hashlib, socket, sys\n"
          "ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
          "s = socket.create_connection((ip, port)); block = bytes(range(256)) * 256; h = hashlib.sha256(); left = n\n"
          "while left:\n"
          " b = block[:min(left, len(block))]; s.sendall(b); h.update(b); left -= len(b)\n"
          "s.shutdown(socket.SHUT_WR); print(h.hexdigest(), s.recv(100).decode())\n")
SINK = ("import hashlib, socket\n"
        "l = socket.create_server(('0.0.0.0', 7300)); open('/out/sink-ready', 'w').close()\n"
        "while True:\n"
        " c = l.accept()[0]; h = hashlib.sha256()\n"
        " try:\n"
        "  while d := c.recv(1 << 20): h.update(d)\n"
        "  c.sendall(h.hexdigest().encode())\n"
        " except OSError: pass\n"
        " c.close()\n")


@pytest.fixture(scope="module", params=["softverbs", pytest.param("rdma", marks=pytest.mark.rdma_device),
                                        pytest.param("rdma-python-pump", marks=pytest.mark.rdma_device)])
def two(request):
    transport, _, pump = request.param.partition("-")
    if transport == "rdma":
        device_or_skip().close()
    pump = "python" if pump else "compiled"
    for bed in two_nodes("qtr", 216, transport=transport, rdma={"pump": pump} if transport == "rdma" else None):
        bed.transport, bed.pump = transport, pump if transport == "rdma" else "python"
        yield bed


@pytest.fixture(scope="module")
def semantics(two):
    return client_semantics(two)


@pytest.mark.parametrize("check", [c for c in CHECKS if c != "loopback_stays_in_the_pod"])
def test_tcp_semantics_over_the_rdma_path(semantics, check):
    res = semantics[check]
    assert res["ok"], res["detail"]


def test_quark_to_quark_took_the_rdma_path(two, semantics):
    a, b = counters(two.a), counters(two.b)
    assert a['tsor_connections_total{path="rdma"}'] >= 12
    assert a['tsor_connections_total{path="tcp"}'] == 0
    assert b['tsor_incoming_total{path="rdma"}'] == a['tsor_connections_total{path="rdma"}']
    provider = "pyverbs" if two.transport == "rdma" else "softverbs"   # a real device, or the stand-in
    assert [k for k in a if k.startswith("tsor_rdma_links{") and f'provider="{provider}"' in k
            and f'pump="{two.pump}"' in k], a


@pytest.fixture(scope="module")
def sink(two):
    pod = two.b.pod("sink")
    two.start("quark", "sink", two.bundle("sink", ["python3", "-c", SINK], pod))
    wait_file(two.out("sink-ready"))
    yield pod
    two.stop("quark", "sink")


@pytest.mark.parametrize("size", [1, 65537, 64 << 20])
def test_streams_arrive_intact(two, sink, size):
    pod = two.a.pod(f"st{size}")
    cmd = f"python3 -c '{STREAM}' {sink.ip} 7300 {size} > /out/st{size}.txt"
    r = two.run("quark", f"st{size}", two.bundle(f"st{size}", ["sh", "-c", cmd], pod), timeout=120)
    assert r.returncode == 0, r.stderr
    with open(two.out(f"st{size}.txt")) as f:
        sent, received = f.read().split()
    assert sent == received


def test_iperf3_and_redis_over_the_rdma_path(two):
    pod_s, pod_c = two.b.pod("ips"), two.a.pod("ipc")
    two.start("quark", "iperf-s", two.bundle("iperf-s", ["iperf3", "-s", "-p", "5201"], pod_s))
    two.start("quark", "redis", two.bundle("redis", ["redis-server", "--port", "6379", "--save", "",
                                                     "--appendonly", "no", "--protected-mode", "no"], pod_s))
    pod_s.wait_listening(5201, 6379)
    before = counters(two.a)['tsor_connections_total{path="rdma"}']
    cmd = (f"iperf3 -c {pod_s.ip} -p 5201 -t 2 -J > /out/iperf.json && "
           f"redis-cli -h {pod_s.ip} set k tsor > /out/redis.txt && "
           f"redis-cli -h {pod_s.ip} get k >> /out/redis.txt")
    r = two.run("quark", "iperf-c", two.bundle("iperf-c", ["sh", "-c", cmd], pod_c), timeout=60)
    assert r.returncode == 0, r.stderr
    with open(two.out("iperf.json")) as f:
        res = json.load(f)
    assert "error" not in res, res.get("error")
    assert res["end"]["sum_received"]["bytes"] > 0
    print(f"iperf3 over {two.transport}: {res['end']['sum_received']['bits_per_second'] / 1e9:.2f} Gb/s")
    with open(two.out("redis.txt")) as f:
        assert f.read().split() == ["OK", "tsor"]
    assert counters(two.a)['tsor_connections_total{path="rdma"}'] >= before + 4
    two.stop("quark", "iperf-s")
    two.stop("quark", "redis")


def test_peer_tsord_killed_mid_stream(two, sink):
    """The stream's connection fails when node b's tsord dies (softverbs: the cable was its
    connection; rdma: its queue pair goes, and the link's lifeline with it); once it is back, new
    connections take a new rdma link."""
    pod = two.a.pod("kill")
    two.start("quark", "kill", two.bundle("kill", ["sh", "-c",
              f"python3 -c '{STREAM}' {sink.ip} 7300 {1 << 40} > /out/kill.txt 2> /out/kill.err"], pod))
    time.sleep(2)
    two.b.tsord.send_signal(signal.SIGKILL)
    two.b.tsord.wait(10)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with open(two.out("kill.err")) as f:
            if "Error" in f.read():
                break
        time.sleep(0.2)
    with open(two.out("kill.err")) as f:
        err = f.read()
    assert "ConnectionResetError" in err or "BrokenPipeError" in err, err
    two.stop("quark", "kill")
    two.b.start_tsord(transport=two.transport)
    time.sleep(11)   # node a retries a failed peer after RETRY_AFTER (10 s); meanwhile it takes tcp
    pod2 = two.a.pod("kill2")
    before = counters(two.a)['tsor_connections_total{path="rdma"}']
    cmd = f"python3 -c '{STREAM}' {sink.ip} 7300 1000000 > /out/kill2.txt"
    r = two.run("quark", "kill2", two.bundle("kill2", ["sh", "-c", cmd], pod2), timeout=60)
    assert r.returncode == 0, r.stderr
    with open(two.out("kill2.txt")) as f:
        sent, received = f.read().split()
    assert sent == received
    assert counters(two.a)['tsor_connections_total{path="rdma"}'] == before + 1
