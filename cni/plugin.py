"""quark-cni: a CNI plugin chained after the ones that give a pod its interface and addresses
(bridge + host-local, or any other), which registers the pod with the node's tsord and passes the
previous plugin's result through unchanged.

    ADD     register {sandbox id, netns path, the pod's IPs from prevResult, pod name/namespace/uid
            from CNI_ARGS} with tsord, which checks the addresses with the kernel (tsor/pods.py);
            print prevResult
    DEL     deregister; succeeds when repeated and when tsord is not running
    CHECK   the registration is there and still names the same namespace and addresses
    STATUS  (1.1.0) tsord answers
    GC      (1.1.0) tsord forgets every pod not among `cni.dev/valid-attachments`
    VERSION the versions below

Errors are the spec's JSON on stdout with its well-known codes (1 incompatible version, 4 invalid
environment, 6 decoding, 7 invalid config, 11 try again later, 50 not available), 100 for a
registration tsord refused; details go to stderr as well. With `"failOpen": true` in its config a
tsord that does not answer is not an error: the pod is set up without TSoR (its connections are
plain TCP) and STATUS reports ready.

Config keys of its own: `failOpen` (bool, default false), `tsorSocket` (absolute path, default
/run/quark/tsord.sock).
"""
from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from typing import Any

from tsor import DEFAULT_SOCKET, protocol
from tsor.errors import ProtocolError

SUPPORTED = ("0.4.0", "1.0.0", "1.1.0")
NEWEST = SUPPORTED[-1]
# the CNI spec's well-known error codes, and one of our own
INCOMPATIBLE_VERSION, INVALID_ENV, DECODING, INVALID_CONFIG, TRY_AGAIN, NOT_AVAILABLE = 1, 4, 6, 7, 11, 50
REFUSED = 100
TIMEOUT = 5.0          # tsord answers a registration in milliseconds; beyond this it is not serving
K8S_ARGS = {"K8S_POD_NAME": "name", "K8S_POD_NAMESPACE": "namespace", "K8S_POD_UID": "uid"}


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code, self.msg, self.details = code, msg, details


class TsordUnreachable(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    """The plugin's entry point (console script `quark-cni`): CNI_* from the environment, the
    network config on stdin, the result or error JSON on stdout."""
    raw = sys.stdin.buffer.read()
    version = _version_asked(raw)   # errors answer in the config's version where it has one we speak
    try:
        version, out = run(dict(os.environ), raw)
    except CniError as e:
        print(json.dumps({"cniVersion": version, "code": e.code, "msg": e.msg,
                          **({"details": e.details} if e.details else {})}))
        print(f"quark-cni: {e.msg}{': ' + e.details if e.details else ''}", file=sys.stderr)
        return 1
    if out is not None:
        print(json.dumps(out))
    return 0


def run(env: dict[str, str], stdin: bytes) -> tuple[str, Any]:
    """(the cniVersion to answer in, what to print or None)."""
    command = env.get("CNI_COMMAND", "")
    if command == "VERSION":
        asked = _version_asked(stdin)
        return asked, {"cniVersion": asked, "supportedVersions": list(SUPPORTED)}
    if not command:
        raise CniError(INVALID_ENV, "CNI_COMMAND is not set")
    conf = _config(stdin)
    version = conf["cniVersion"]
    handler = {"ADD": _add, "DEL": _del, "CHECK": _check, "STATUS": _status, "GC": _gc}.get(command)
    if handler is None:
        raise CniError(INVALID_ENV, f"CNI_COMMAND: unknown command {command!r}")
    if command in ("STATUS", "GC") and version != "1.1.0":
        raise CniError(INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0, the config says {version}")
    return version, handler(env, conf)


# ---- the commands ----------------------------------------------------------------------------------
def _add(env: dict[str, str], conf: dict) -> dict:
    cid, netns, ifname = _need(env, "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME")
    prev = _prev_result(conf)
    msg = protocol.PodAdd(cid, ifname, netns, pod_ips(prev, netns, ifname), **_k8s_args(env))
    try:
        _ask(conf, msg)
    except TsordUnreachable as e:
        if not conf["failOpen"]:
            raise CniError(TRY_AGAIN, "tsord is not answering", str(e)) from None
        print(f"quark-cni: tsord is not answering ({e}): pod {cid} set up without TSoR (failOpen)",
              file=sys.stderr)
    return {**prev, "cniVersion": conf["cniVersion"]}


def _del(env: dict[str, str], conf: dict) -> None:
    cid, ifname = _need(env, "CNI_CONTAINERID", "CNI_IFNAME")
    try:
        _ask(conf, protocol.PodDel(cid, ifname))
    except TsordUnreachable:
        pass   # nothing to undo where nothing answers; a restarted tsord drops pods whose netns is gone
    return None


def _check(env: dict[str, str], conf: dict) -> None:
    cid, netns, ifname = _need(env, "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME")
    prev = _prev_result(conf)
    try:
        _ask(conf, protocol.PodCheck(cid, ifname, netns, pod_ips(prev, netns, ifname)))
    except TsordUnreachable as e:
        if not conf["failOpen"]:
            raise CniError(TRY_AGAIN, "tsord is not answering", str(e)) from None
    return None


def _status(env: dict[str, str], conf: dict) -> None:
    try:
        _ask(conf, protocol.Ping())
    except TsordUnreachable as e:
        if not conf["failOpen"]:
            raise CniError(NOT_AVAILABLE, "tsord is not answering", str(e)) from None
    return None


def _gc(env: dict[str, str], conf: dict) -> None:
    valid = conf.get("cni.dev/valid-attachments", [])
    if (not isinstance(valid, list)
            or not all(isinstance(a, dict) and isinstance(a.get("containerID"), str)
                       and isinstance(a.get("ifname"), str) for a in valid)):
        raise CniError(INVALID_CONFIG, "cni.dev/valid-attachments: expected a list of {containerID, ifname}")
    try:
        _ask(conf, protocol.PodGc([f"{a['containerID']}/{a['ifname']}" for a in valid]))
    except TsordUnreachable:
        pass
    return None


# ---- input ---------------------------------------------------------------------------------------
def _version_asked(stdin: bytes) -> str:
    try:
        v = json.loads(stdin).get("cniVersion") if stdin.strip() else None
    except (ValueError, AttributeError):
        v = None
    return v if v in SUPPORTED else NEWEST


def _config(stdin: bytes) -> dict:
    try:
        conf = json.loads(stdin)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CniError(DECODING, "the network configuration on stdin is not JSON", str(e)) from None
    if not isinstance(conf, dict):
        raise CniError(DECODING, "the network configuration on stdin is not a JSON object")
    version = conf.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_CONFIG, "cniVersion: missing")
    if version not in SUPPORTED:
        raise CniError(INCOMPATIBLE_VERSION, f"cniVersion {version} is not supported",
                       f"supported: {', '.join(SUPPORTED)}")
    for key in ("name", "type"):
        if not isinstance(conf.get(key), str) or not conf[key]:
            raise CniError(INVALID_CONFIG, f"{key}: expected a string, got {conf.get(key)!r}")
    fail_open = conf.setdefault("failOpen", False)
    if not isinstance(fail_open, bool):
        raise CniError(INVALID_CONFIG, f"failOpen: expected true or false, got {fail_open!r}")
    sock = conf.setdefault("tsorSocket", DEFAULT_SOCKET)
    if not isinstance(sock, str) or not os.path.isabs(sock):
        raise CniError(INVALID_CONFIG, f"tsorSocket: expected an absolute path, got {sock!r}")
    return conf


def _need(env: dict[str, str], *names: str) -> list[str]:
    missing = [n for n in names if not env.get(n)]
    if missing:
        raise CniError(INVALID_ENV, f"{', '.join(missing)} not set")
    return [env[n] for n in names]


def _prev_result(conf: dict) -> dict:
    prev = conf.get("prevResult")
    if not isinstance(prev, dict) or not isinstance(prev.get("ips", []), list):
        raise CniError(INVALID_CONFIG, "prevResult: missing; quark-cni must be chained after a plugin that "
                                       "assigns the pod's addresses (e.g. bridge with host-local)")
    return prev


def _k8s_args(env: dict[str, str]) -> dict[str, str]:
    """Pod name, namespace and uid from CNI_ARGS (K=V;K=V, as kubelet's runtime passes them)."""
    out: dict[str, str] = {}
    for item in filter(None, env.get("CNI_ARGS", "").split(";")):
        key, sep, value = item.partition("=")
        if not sep:
            raise CniError(INVALID_ENV, f"CNI_ARGS: expected KEY=VALUE pairs separated by ';', got {item!r}")
        if key in K8S_ARGS:
            out[K8S_ARGS[key]] = value
    return out


def pod_ips(prev: dict, netns: str, ifname: str) -> list[str]:
    """The addresses prevResult gives the pod's own interface: those whose `interface` index names
    an interface in the sandbox (or named CNI_IFNAME); all of them when the result says no more."""
    interfaces = prev.get("interfaces") if isinstance(prev.get("interfaces"), list) else []
    out = []
    for entry in prev.get("ips", []):
        if not isinstance(entry, dict) or not isinstance(entry.get("address"), str):
            raise CniError(INVALID_CONFIG, f"prevResult.ips: expected {{address: CIDR}}, got {entry!r}")
        idx = entry.get("interface")
        if isinstance(idx, int) and 0 <= idx < len(interfaces) and isinstance(interfaces[idx], dict):
            iface = interfaces[idx]
            if not iface.get("sandbox") and iface.get("name") != ifname:
                continue   # the host side (the bridge, the veth's host end)
        try:
            out.append(str(ipaddress.ip_interface(entry["address"]).ip))
        except ValueError:
            raise CniError(INVALID_CONFIG, f"prevResult.ips: not an address: {entry['address']!r}") from None
    return out


# ---- tsord ---------------------------------------------------------------------------------------
def _ask(conf: dict, msg: object) -> dict:
    """One request on a connection of its own; TsordUnreachable if tsord does not answer, CniError
    with REFUSED if it refuses."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
            s.settimeout(TIMEOUT)
            s.connect(conf["tsorSocket"])
            s.send(protocol.encode(1, msg))
            data, fds = protocol.recv(s)
            for fd in fds:
                os.close(fd)
    except (OSError, ProtocolError) as e:
        raise TsordUnreachable(f"{conf['tsorSocket']}: {e}") from None
    if not data:
        raise TsordUnreachable(f"{conf['tsorSocket']}: closed without an answer")
    try:
        _, reply = protocol.decode(data)
    except ProtocolError as e:
        raise TsordUnreachable(f"{conf['tsorSocket']}: {e}") from None
    if not isinstance(reply, dict) or "error" in reply:
        err = reply.get("error") if isinstance(reply, dict) else reply
        raise CniError(REFUSED, "tsord refused the pod", str(err))
    return reply


if __name__ == "__main__":
    sys.exit(main())
