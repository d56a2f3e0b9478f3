"""tsord's side of the remote path (tsor/remote_path.py) against real kernel maps of the programs'
layouts, made small here: which pod networks the remote map gets from the links up, what is done
when it or the verdict map is full (native, counted, logged once), and the pump's listener in the
pump map. The programs that read these maps run in tests/integration/test_tsor_remote_path.py."""
from __future__ import annotations

import logging
import os
import socket
import struct
from types import SimpleNamespace

import pytest

from qlib import bpf
from tsor import remote_path, service_lb

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creating BPF maps: bpf(2))")
HASH, ARRAY, LRU_HASH, LPM_TRIE, SOCKMAP = 1, 2, 9, 11, 15
NO_PREALLOC = 1
PUMP = ("127.0.0.1", 7471)


@pytest.fixture
def maps():
    made = {service_lb.REMOTE_MAP: bpf.map_create(LPM_TRIE, 8, 8, 2, NO_PREALLOC),
            service_lb.CONFIG_MAP: bpf.map_create(ARRAY, 4, 8, 1),
            service_lb.VERDICTS_MAP: bpf.map_create(HASH, 16, 8, 2),
            service_lb.MISSES_MAP: bpf.map_create(LRU_HASH, 16, 4, 16),
            service_lb.PUMP_MAP: bpf.map_create(SOCKMAP, 4, 8, 1)}
    try:
        yield made
    finally:
        for fd in made.values():
            os.close(fd)


def path(maps, links=dict, generation=lambda: 1, pod_of=lambda cookie: "10.1.0.5", decide=lambda s, d: True):
    listener = socket.create_server(("127.0.0.1", 0))
    rp = remote_path.RemotePath(SimpleNamespace(maps=maps), PUMP, links, generation, lambda: object(), pod_of,
                                decide, listener=listener)
    rp._stop.set()   # the test turns the wheel itself
    rp._thread.join()
    return rp


def remote(maps) -> dict[bytes, bytes]:
    return {k: bpf.map_lookup(maps[service_lb.REMOTE_MAP], k, 8) for k in bpf.map_keys(maps[service_lb.REMOTE_MAP], 8)}


@needs_root
def test_the_remote_map_holds_the_linked_nodes_networks_and_a_full_one_leaves_the_rest_native(maps, caplog):
    links = {"b": (("10.2.0.0/24", "fd00:2::/64"), 3)}
    rp = path(maps, lambda: links)
    try:
        rp.sync()
        assert remote(maps) == {remote_path.remote_key("10.2.0.0/24"): remote_path.remote_value(PUMP, 3)}
        assert rp.left_native == set()
        links["c"] = (("10.3.0.0/24", "10.4.0.0/24"), 4)   # three IPv4 networks: the map holds two
        with caplog.at_level(logging.WARNING, logger="tsor.remote_path"):
            rp.sync()
            rp.sync()
        assert len(remote(maps)) == 2 and len(rp.left_native) == 1
        assert len([r for r in caplog.records if "remote map is full" in r.getMessage()]) == 1   # once
        del links["b"]                                       # a link went: its networks leave at once
        rp.sync()
        assert set(remote(maps)) == {remote_path.remote_key("10.3.0.0/24"), remote_path.remote_key("10.4.0.0/24")}
        assert rp.left_native == set()
    finally:
        rp.close()
    assert remote(maps) == {}   # tsord exits: connects to other nodes are native


@needs_root
def test_the_pumps_listener_is_in_the_pump_map_while_it_listens(maps):
    rp = path(maps)
    key = struct.pack("=I", 0)
    assert bpf.map_lookup(maps[service_lb.PUMP_MAP], key, 8) is not None
    rp.close()
    assert bpf.map_lookup(maps[service_lb.PUMP_MAP], key, 8) is None


@needs_root
def test_a_full_verdict_map_gives_up_older_generations_then_leaves_connects_native(maps, caplog):
    gen = [1]
    rp = path(maps, generation=lambda: gen[0])
    misses, verdicts = maps[service_lb.MISSES_MAP], maps[service_lb.VERDICTS_MAP]

    def miss(port: int) -> bytes:
        key = struct.pack("=QIHH", 7, struct.unpack("=I", socket.inet_aton("10.2.0.9"))[0], socket.htons(port), 0)
        bpf.map_update(misses, key, struct.pack("=I", 1))
        return key
    try:
        keys = [miss(80), miss(81)]
        assert rp.answer_misses() == 2
        assert {bpf.map_lookup(verdicts, k, 8) for k in keys} == {struct.pack("=II", 1, 1)}
        gen[0] = 2                                       # routes changed: the old verdicts no longer count
        k3 = miss(82)
        assert rp.answer_misses() == 1
        assert bpf.map_lookup(verdicts, k3, 8) == struct.pack("=II", 2, 1)   # room made from generation 1's
        miss(83)
        assert rp.answer_misses() == 1
        with caplog.at_level(logging.WARNING, logger="tsor.remote_path"):
            miss(84)
            miss(85)
            assert rp.answer_misses() == 2                # both of this generation: no room, native
        assert len(bpf.map_keys(verdicts, 16)) == 2
        assert len([r for r in caplog.records if "verdict map is full" in r.getMessage()]) == 1
    finally:
        rp.close()


@needs_root
def test_a_new_route_generation_gets_the_verdicts_in_use_decided_again(maps):
    gen, allow = [1], [True]
    decided = []

    def decide(src, dst):
        decided.append((src, dst))
        return allow[0]
    rp = path(maps, generation=lambda: gen[0], pod_of={7: "10.1.0.5"}.get, decide=decide)
    verdicts = maps[service_lb.VERDICTS_MAP]
    try:
        rp.sync()
        ip4 = struct.unpack("=I", socket.inet_aton("10.2.0.9"))[0]
        ours, gone = (struct.pack("=QIHH", cookie, ip4, socket.htons(80), 0) for cookie in (7, 8))
        for key in (ours, gone):
            bpf.map_update(maps[service_lb.MISSES_MAP], key, struct.pack("=I", 1))
        rp.answer_misses()
        assert bpf.map_lookup(verdicts, ours, 8) == struct.pack("=II", 1, 1)
        gen[0], allow[0] = 2, False     # a policy changed: the verdict in use is decided again, now
        decided.clear()
        rp.sync()
        assert decided == [("10.1.0.5", ("10.2.0.9", 80))]
        assert bpf.map_lookup(verdicts, ours, 8) == struct.pack("=II", 2, 0)
        assert bpf.map_lookup(verdicts, gone, 8) is None    # its pod left: dropped, not decided
        assert bpf.map_lookup(maps[service_lb.CONFIG_MAP], struct.pack("=I", 0), 8) == struct.pack("=II", 2, 1)
    finally:
        rp.close()
