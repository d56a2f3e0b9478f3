"""quark-cni's side of the CNI contract without a network namespace: its VERSION answer, the error
JSON and codes for bad input, what happens when tsord is down (with and without failOpen), and the
requests that need no kernel check (DEL, STATUS, GC) against a real tsord in-process."""
from __future__ import annotations

import io
import json
import os

import pytest

from cni import plugin
from cni.plugin import CniError
from tsor.config import Config
from tsor.daemon import Daemon
from tsor.pods import Pod

PREV = {"cniVersion": "1.0.0",
        "interfaces": [{"name": "qcni0", "mac": "aa:bb:cc:00:00:01"},
                       {"name": "veth1", "mac": "aa:bb:cc:00:00:02"},
                       {"name": "eth0", "mac": "aa:bb:cc:00:00:03", "sandbox": "/var/run/netns/p1"}],
        "ips": [{"address": "10.213.0.5/24", "gateway": "10.213.0.1", "interface": 2},
                {"address": "fd00:213::5/64", "interface": 2},
                {"address": "10.213.0.1/24", "interface": 0}],
        "dns": {}}


def conf(version="1.0.0", **extra) -> dict:
    return {"cniVersion": version, "name": "quarknet", "type": "quark-cni", **extra}


def env(command: str, **extra) -> dict[str, str]:
    return {"CNI_COMMAND": command, "CNI_CONTAINERID": "sb1", "CNI_NETNS": "/var/run/netns/p1",
            "CNI_IFNAME": "eth0", "CNI_PATH": "/nonexistent", **extra}


def run_main(monkeypatch, capsys, environ: dict, stdin: bytes) -> tuple[int, dict | None]:
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    rc = plugin.main()
    out = capsys.readouterr().out.strip()
    return rc, json.loads(out) if out else None


@pytest.fixture
def tsord(tmp_path):
    d = Daemon(Config(node="n1", socket=str(tmp_path / "tsord.sock"), state_dir=str(tmp_path / "state")))
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_version_lists_what_it_speaks(monkeypatch, capsys):
    rc, out = run_main(monkeypatch, capsys, {"CNI_COMMAND": "VERSION"}, b'{"cniVersion": "1.0.0"}')
    assert rc == 0
    assert out == {"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0", "1.1.0"]}


@pytest.mark.parametrize("environ, stdin, code, words", [
    ({}, json.dumps(conf()).encode(), 4, "CNI_COMMAND"),
    (env("ADD"), b"{not json", 6, "not JSON"),
    (env("ADD"), b"[1, 2]", 6, "not a JSON object"),
    (env("ADD"), json.dumps(conf(version="0.2.0")).encode(), 1, "cniVersion 0.2.0"),
    (env("ADD"), json.dumps({"cniVersion": "1.0.0", "type": "quark-cni"}).encode(), 7, "name"),
    (env("ADD"), json.dumps(conf(failOpen="yes")).encode(), 7, "failOpen"),
    (env("ADD"), json.dumps(conf(tsorSocket="relative.sock")).encode(), 7, "tsorSocket"),
    (env("ADD"), json.dumps(conf()).encode(), 7, "prevResult"),
    (env("ADD", CNI_NETNS=""), json.dumps(conf(prevResult=PREV)).encode(), 4, "CNI_NETNS"),
    (env("ADD", CNI_ARGS="IgnoreUnknown"), json.dumps(conf(prevResult=PREV)).encode(), 4, "CNI_ARGS"),
    (env("BOGUS"), json.dumps(conf()).encode(), 4, "BOGUS"),
    (env("STATUS"), json.dumps(conf(version="1.0.0")).encode(), 1, "1.1.0"),
    (env("GC"), json.dumps(conf(version="1.1.0", **{"cni.dev/valid-attachments": [{"id": 1}]})).encode(), 7,
     "valid-attachments"),
])
def test_bad_input_is_the_specs_error_json(monkeypatch, capsys, environ, stdin, code, words):
    rc, out = run_main(monkeypatch, capsys, environ, stdin)
    assert rc != 0
    assert out["code"] == code and words in out["msg"] + out.get("details", ""), out
    assert set(out) <= {"cniVersion", "code", "msg", "details"}


def test_errors_answer_in_the_configs_version(monkeypatch, capsys):
    rc, out = run_main(monkeypatch, capsys, env("ADD"), json.dumps(conf(version="0.4.0")).encode())
    assert rc == 1 and out["cniVersion"] == "0.4.0" and out["code"] == 7


def test_pod_ips_are_those_of_the_sandbox_interface():
    assert plugin.pod_ips(PREV, "/var/run/netns/p1", "eth0") == ["10.213.0.5", "fd00:213::5"]
    assert plugin.pod_ips({"ips": [{"address": "10.0.0.9/8"}]}, "/n", "eth0") == ["10.0.0.9"]
    with pytest.raises(CniError) as e:
        plugin.pod_ips({"ips": [{"address": "nonsense"}]}, "/n", "eth0")
    assert e.value.code == 7


def test_kubernetes_identity_comes_from_cni_args():
    got = plugin._k8s_args({"CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-7;"
                                        "K8S_POD_INFRA_CONTAINER_ID=sb1;K8S_POD_UID=1234-abcd"})
    assert got == {"namespace": "shop", "name": "cart-7", "uid": "1234-abcd"}


def test_tsord_down(monkeypatch, capsys, tmp_path):
    gone = str(tmp_path / "no-tsord.sock")
    add = json.dumps(conf(tsorSocket=gone, prevResult=PREV)).encode()
    rc, out = run_main(monkeypatch, capsys, env("ADD"), add)
    assert rc == 1 and out["code"] == 11, out               # try again later: nothing was set up for TSoR
    open_add = json.dumps(conf(tsorSocket=gone, failOpen=True, prevResult=PREV)).encode()
    rc, out = run_main(monkeypatch, capsys, env("ADD"), open_add)
    assert rc == 0 and out == {**PREV, "cniVersion": "1.0.0"}   # the pod goes on with plain TCP
    rc, out = run_main(monkeypatch, capsys, env("DEL"), json.dumps(conf(tsorSocket=gone)).encode())
    assert (rc, out) == (0, None)                           # DEL succeeds with nothing to undo
    status = conf(version="1.1.0", tsorSocket=gone)
    rc, out = run_main(monkeypatch, capsys, env("STATUS"), json.dumps(status).encode())
    assert rc == 1 and out["code"] == 50
    rc, out = run_main(monkeypatch, capsys, env("STATUS"), json.dumps({**status, "failOpen": True}).encode())
    assert (rc, out) == (0, None)
    rc, out = run_main(monkeypatch, capsys, env("CHECK"), add)
    assert rc == 1 and out["code"] == 11


def test_status_del_and_gc_against_tsord(monkeypatch, capsys, tsord):
    sock = tsord.cfg.socket
    status = json.dumps(conf(version="1.1.0", tsorSocket=sock)).encode()
    rc, out = run_main(monkeypatch, capsys, env("STATUS"), status)
    assert (rc, out) == (0, None)
    for key in ("a", "b", "c"):   # as tsord would hold them after ADDs (the kernel check is tested as root)
        tsord.pods.add(Pod(key, "eth0", f"/var/run/netns/{key}", hash(key), (f"10.9.0.{len(key) + ord(key)}",)))
    rc, out = run_main(monkeypatch, capsys, env("DEL", CNI_CONTAINERID="a"), json.dumps(conf(tsorSocket=sock)).encode())
    assert (rc, out) == (0, None) and tsord.pods.get("a/eth0") is None
    rc, out = run_main(monkeypatch, capsys, env("DEL", CNI_CONTAINERID="a"), json.dumps(conf(tsorSocket=sock)).encode())
    assert (rc, out) == (0, None)   # repeated: still success
    keep = [{"containerID": "b", "ifname": "eth0"}]
    gc = conf(version="1.1.0", tsorSocket=sock, **{"cni.dev/valid-attachments": keep})
    rc, out = run_main(monkeypatch, capsys, env("GC"), json.dumps(gc).encode())
    assert (rc, out) == (0, None)
    assert tsord.pods.get("b/eth0") is not None and tsord.pods.get("c/eth0") is None


def test_tsord_refuses_an_add_that_names_no_namespace(monkeypatch, capsys, tsord):
    add = json.dumps(conf(tsorSocket=tsord.cfg.socket, prevResult=PREV)).encode()
    rc, out = run_main(monkeypatch, capsys, env("ADD", CNI_NETNS="/nonexistent/netns"), add)
    assert rc == 1 and out["code"] == 100 and "no such file" in out["details"], out
    assert len(tsord.pods) == 0
