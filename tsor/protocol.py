"""tsord's unix-socket protocol: JSON records on a SOCK_SEQPACKET socket, fds by SCM_RIGHTS. Three
kinds of peer speak it: a sandbox's supervisor and tsord (tsor/sandbox.py's SandboxNet, which runs
in the supervisor, and daemon.py), two supervisors of one node over a direct channel tsord set up
(tsor/peers.py: `incoming` records only), and quark-cni and tsord (cni/plugin.py, below). tsord
talks to other nodes' tsords over TCP with a protocol of its own (transport/tcp.py, rdma_link.py).

SEQPACKET keeps each message and its fds one record, so nothing depends on how a stream was cut.
A request is {"op": NAME, "id": N, ...fields}; its reply is {"re": N, ...}. Both sides send
requests: the sandbox asks to connect and announces listeners; tsord offers incoming connections.

    sandbox -> tsord  hello     {sandbox, pid, addrs, direct, offload} -> {ok, node, direct} + generation fd | {error}
                      listen    {token, addr, port, v6only}     -> {ok} | {error}
                      unlisten  {token}                         -> {ok}
                      connect   {dst: [ip, port], src_port}     -> {path: local|tcp|rdma, src, [direct]} + fd
                                                                   [+ channel fd] | {path: fallback}
                      tally     {connections, incoming, native}  (no reply: counts of connections tsord did not see)
                      carried   {local, remote, cookie}         -> {carried}  (sockmap path: is this end in the map?)
    tsord -> sandbox  incoming  {token, peer, local, path, greet} + fd -> {ok}
                      peer      {sandbox, addrs} + channel fd   -> {ok}

`direct` (tsor/peers.py): a sandbox that says it can is given, with a local-path answer, a route
({token, generation, sandbox}) and a channel end to the listening sandbox, whose supervisor got the
other end in a `peer` message; later connects to that address go over the channel as `incoming`
records (the same record tsord sends) while tsord's route generation, shared at hello, is unchanged.

A connect to a Service ClusterIP:port is answered like one to the endpoint tsord picked for it, but
the reply never names that endpoint: the sandbox records the address the application dialled as the
socket's peer (intercept.py), so getpeername() answers the ClusterIP:port, as under kube-proxy.

quark-cni (cni/plugin.py) opens a connection of its own for one request, instead of a hello:

    quark-cni -> tsord  podadd   {sandbox, ifname, netns, ips, name, namespace, uid} -> {ok} | {error}
                        poddel   {sandbox, ifname}                  -> {ok, existed}
                        podcheck {sandbox, ifname, netns, ips}      -> {ok} | {error}
                        podgc    {keep: ["sandbox/ifname", ...]}    -> {ok, removed}
                        ping     {}                                 -> {ok, node}

`decode` checks every field; a malformed message raises ProtocolError for that message only.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tsor.addr import Endpoint, valid_ip
from tsor.errors import ProtocolError

log = logging.getLogger("tsor.protocol")
MAX_MSG = 64 * 1024
MAX_FDS = 4
PATHS = ("local", "tcp", "rdma", "fallback")
MAX_IDS = 4096
Id = str   # a name (sandbox id, "sandbox/ifname"): printable, no more than 1024 characters


@dataclass(frozen=True)
class Hello:
    sandbox: str
    pid: int
    addrs: list[str]
    direct: bool = False  # takes routes and channels to other sandboxes' listeners (tsor/peers.py)
    # the kernel answers TCP_NODELAY/TCP_CORK on its local-path ends (tsor/sockopt_offload.py): it
    # must be given only AF_UNIX ends made by a process in quark's cgroup
    offload: bool = False


@dataclass(frozen=True)
class Listen:
    token: int           # the listening socket's inode: unique while it is open
    addr: str
    port: int
    v6only: bool = False


@dataclass(frozen=True)
class Unlisten:
    token: int


@dataclass(frozen=True)
class Connect:
    dst: Endpoint
    src_port: int


@dataclass(frozen=True)
class Incoming:
    token: int
    peer: Endpoint
    local: Endpoint
    path: str
    greet: bool = False  # write b"\x01" on the socket before queueing it (tcp path, see transport/tcp.py)


@dataclass(frozen=True)
class Peer:
    sandbox: str         # the client sandbox the channel sent with this message serves
    addrs: list[str]     # ... and its addresses, as tsord verified them: the only peers it may claim


@dataclass(frozen=True)
class Tally:
    connections: int     # local-path connections this sandbox made over channels since its last tally
    incoming: int        # ... and took from channels
    native: int = 0      # ... and connects it let go native on a cached fallback answer (tsor/peers.py)


@dataclass(frozen=True)
class Carried:
    local: Endpoint      # a TCP end of the sandbox's (IPv4, or IPv4-mapped), as getsockname says it
    remote: Endpoint
    cookie: int          # its SO_COOKIE: the socket itself, not another one on the same four-tuple


@dataclass(frozen=True)
class PodAdd:
    sandbox: str         # CNI_CONTAINERID: the pod sandbox
    ifname: str          # CNI_IFNAME
    netns: str           # CNI_NETNS: the path of the pod's network namespace
    ips: list[str]       # the pod's addresses, from the previous plugin's result
    name: str = ""       # K8S_POD_NAME, K8S_POD_NAMESPACE, K8S_POD_UID from CNI_ARGS, when kubelet passed them
    namespace: str = ""
    uid: str = ""


@dataclass(frozen=True)
class PodDel:
    sandbox: str
    ifname: str


@dataclass(frozen=True)
class PodCheck:
    sandbox: str
    ifname: str
    netns: str
    ips: list[str]


@dataclass(frozen=True)
class PodGc:
    keep: list[Id]       # "sandbox/ifname" of every attachment the runtime still has


@dataclass(frozen=True)
class Ping:
    pass


POD_REQUESTS = (PodAdd, PodDel, PodCheck, PodGc, Ping)
MESSAGES = {cls.__name__.lower(): cls for cls in (Hello, Listen, Unlisten, Connect, Incoming, Peer, Tally,
                                                  Carried, *POD_REQUESTS)}


def _endpoint(v: Any, field: str) -> Endpoint:
    if (not isinstance(v, list) or len(v) != 2 or not valid_ip(v[0]) or not isinstance(v[1], int)
            or isinstance(v[1], bool) or not 0 <= v[1] <= 65535):
        raise ProtocolError(f"{field}: expected [ip, port], got {v!r}")
    return (v[0], v[1])


def _check(cls: type, field: dataclasses.Field, v: Any) -> Any:
    t = field.type
    if t == "Endpoint":
        return _endpoint(v, field.name)
    if t == "int":
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 64:
            raise ProtocolError(f"{field.name}: expected a non-negative integer, got {v!r}")
        if field.name in ("port", "src_port") and v > 65535:
            raise ProtocolError(f"{field.name}: port out of range: {v}")
        return v
    if t == "bool":
        if not isinstance(v, bool):
            raise ProtocolError(f"{field.name}: expected true or false, got {v!r}")
        return v
    if t == "str":
        if not isinstance(v, str) or len(v) > 1024:
            raise ProtocolError(f"{field.name}: expected a string, got {v!r}")
        if field.name == "addr" and not valid_ip(v):
            raise ProtocolError(f"addr: not an IP address: {v!r}")
        if field.name == "path" and v not in PATHS:
            raise ProtocolError(f"path: expected one of {PATHS}, got {v!r}")
        return v
    if t == "list[Id]":
        if (not isinstance(v, list) or len(v) > MAX_IDS
                or not all(isinstance(x, str) and 0 < len(x) <= 1024 and x.isprintable() for x in v)):
            raise ProtocolError(f"{field.name}: expected a list of names, got {v!r}"[:300])
        return list(v)
    if t == "list[str]":
        if not isinstance(v, list) or len(v) > 64 or not all(valid_ip(a) for a in v):
            raise ProtocolError(f"{field.name}: expected a list of IP addresses, got {v!r}")
        return list(v)
    raise AssertionError(f"no check for {cls.__name__}.{field.name}: {t}")


def decode(raw: bytes) -> tuple[int, object] | tuple[int, dict]:
    """A request -> (id, message dataclass); a reply -> (id, dict). ProtocolError if malformed."""
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # deep nesting: RecursionError
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not an object")
    if "re" in msg:
        if not isinstance(msg["re"], int):
            raise ProtocolError("re: expected an integer")
        return msg["re"], msg
    op, mid = msg.get("op"), msg.get("id")
    if not isinstance(mid, int) or isinstance(mid, bool):
        raise ProtocolError(f"id: expected an integer, got {mid!r}")
    cls = MESSAGES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"op: unknown operation {op!r}")
    kwargs = {}
    try:
        for f in dataclasses.fields(cls):
            if f.name in msg:
                kwargs[f.name] = _check(cls, f, msg[f.name])
            elif f.default is dataclasses.MISSING:
                raise ProtocolError(f"{op}: missing field {f.name!r}")
    except ProtocolError as e:
        e.mid = mid   # the request is known: its sender gets the error as the reply
        raise
    return mid, cls(**kwargs)


def encode(mid: int, message: object) -> bytes:
    body = {"op": type(message).__name__.lower(), "id": mid}
    for f in dataclasses.fields(message):
        v = getattr(message, f.name)
        body[f.name] = list(v) if isinstance(v, tuple) else v
    return json.dumps(body).encode()


def reply(mid: int, **fields: Any) -> bytes:
    return json.dumps({"re": mid, **{k: list(v) if isinstance(v, tuple) else v
                                     for k, v in fields.items()}}).encode()


def send(sock: socket.socket, data: bytes, fds: list[int] = ()) -> None:
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One record; b"" at EOF. fds beyond MAX_FDS are closed by the kernel (MSG_CTRUNC)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MSG, MAX_FDS)
    if flags & socket.MSG_TRUNC:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("message too long")
    return data, fds


class Closed(Exception):
    """The other end closed the connection (the text is empty), or reading it failed (the text says why)."""


def received(sock: socket.socket, sender: str) -> Iterator[tuple[int, object, list[int]]]:
    """The decoded records a non-blocking socket holds now, as (id, message, fds). A malformed one
    is logged as from `sender`, its fds closed, and skipped. Raises Closed at end of file or when
    reading fails."""
    while True:
        try:
            data, fds = recv(sock)
        except BlockingIOError:
            return
        except (OSError, ProtocolError) as e:
            raise Closed(str(e)) from e
        if not data:
            for fd in fds:
                os.close(fd)
            raise Closed("")
        try:
            mid, msg = decode(data)
        except ProtocolError as e:
            log.warning("malformed message from %s: %s", sender, e)
            for fd in fds:
                os.close(fd)
            continue
        yield mid, msg, fds
