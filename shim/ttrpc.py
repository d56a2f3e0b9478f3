"""ttrpc, containerd's small RPC protocol over a unix socket: framing, a threaded server, a client.

A frame is a 10-byte header `>IIBB` (payload length, stream id, type, flags) and a protobuf
payload: a `ttrpc.Request` (type 1) or `ttrpc.Response` (type 2). Requests on one connection
are served concurrently (a Wait is answered when its process exits while other calls go on),
by a bounded number of threads (see Server); each response carries the stream id of its request.
"""
from __future__ import annotations

import enum
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from shim.pb import ttrpc_pb2

log = logging.getLogger("quark.shim.ttrpc")

HEADER = struct.Struct(">IIBB")
MESSAGE_LENGTH_MAX = 4 << 20
# containerd holds one connection to a shim (two across its restart): the bound only stops a flood.
# Each connection costs one reader thread; 64 leaves room for a few dozen clients stuck half-way
# through a frame (tests/security/test_fuzz_shim.py) while the real client is still served.
MAX_CONNECTIONS = 64
# threads answering requests at once, for all connections: containerd seldom has more than a few
# calls in flight per container, and a call that takes long (create, exec) runs the quark CLI
MAX_WORKERS = 32
# deferred calls (one Wait per process containerd watches) waiting at once: they cost no thread
MAX_PARKED = 4096
SEND_TIMEOUT_S = 10   # a client that reads no answers for this long is disconnected
TYPE_REQUEST = 1
TYPE_RESPONSE = 2


class Code(enum.IntEnum):
    """gRPC status codes, which containerd maps to its errdefs."""
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class RpcError(Exception):
    """An error answered to the caller with a status code (containerd maps NotFound etc.)."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class FrameError(Exception):
    """The peer sent something that is not ttrpc: the connection is closed."""


@dataclass
class Method:
    """One served method: how to decode its request and the handler that answers it. A deferred
    method's handler returns a Future of its answer (Wait: done when the process exits), and no
    thread waits for it meanwhile."""
    request_type: type[Message]
    handler: Callable[[Message, dict[str, str]], Message | Future]
    deferred: bool = False


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise FrameError(f"connection closed inside a frame ({len(buf)} of {n} bytes)")
            return None
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes] | None:
    """One frame as (stream id, type, flags, payload); None on a clean end of stream."""
    header = _recv_exact(sock, HEADER.size)
    if header is None:
        return None
    length, stream_id, msg_type, flags = HEADER.unpack(header)
    if length > MESSAGE_LENGTH_MAX:
        raise FrameError(f"frame of {length} bytes on stream {stream_id} exceeds {MESSAGE_LENGTH_MAX}")
    payload = _recv_exact(sock, length) if length else b""
    if payload is None:
        raise FrameError(f"connection closed before the {length}-byte payload of stream {stream_id}")
    return stream_id, msg_type, flags, payload


def frame(stream_id: int, msg_type: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), stream_id, msg_type, 0) + payload


class _Connection:
    """One client's connection: the lock that keeps each answer frame whole, and its parked calls."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._parked: set[Future] = set()
        self._closed = False

    def send(self, stream_id: int, response: ttrpc_pb2.Response) -> None:
        data = frame(stream_id, TYPE_RESPONSE, response.SerializeToString())
        with self._write_lock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                # a client that reads no answers (SEND_TIMEOUT_S) must not hold a worker, and a
                # half-written frame leaves the stream unreadable: end the connection
                level = logging.WARNING if isinstance(e, BlockingIOError) else logging.DEBUG
                log.log(level, "closing ttrpc connection: could not answer stream %d: %s", stream_id, e)
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def park(self, answer: Future) -> None:
        with self._lock:
            if not self._closed:
                self._parked.add(answer)
                return
        answer.cancel()

    def unpark(self, answer: Future) -> None:
        with self._lock:
            self._parked.discard(answer)

    def close(self) -> None:
        """The client is gone: its parked calls are cancelled (their handlers forget them)."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, set()
        for answer in parked:
            answer.cancel()
        self.sock.close()


class Server:
    """Serves registered methods on a listening unix socket: a thread per connection (at most
    max_connections, MAX_CONNECTIONS unless told) and at most MAX_WORKERS threads answering
    requests, for all connections together. A request that finds every worker busy waits unread in its connection's socket, so a
    flood is queued by the kernel, not by threads. A deferred method (Wait) holds no thread while
    it waits; MAX_PARKED of them may wait at once, and more are refused with RESOURCE_EXHAUSTED."""

    def __init__(self, listener: socket.socket, max_connections: int = MAX_CONNECTIONS) -> None:
        self.listener = listener
        self.methods: dict[tuple[str, str], Method] = {}
        self._closing = False
        self.max_connections = max_connections
        self._connections = threading.BoundedSemaphore(max_connections)
        self._workers = threading.BoundedSemaphore(MAX_WORKERS)
        self._parked = threading.BoundedSemaphore(MAX_PARKED)

    def register(self, service: str, name: str, method: Method) -> None:
        self.methods[(service, name)] = method

    def serve_forever(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._closing:
                    return
                raise
            if not self._connections.acquire(blocking=False):
                log.warning("refusing a ttrpc connection: %d are open already", self.max_connections)
                conn.close()
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
            threading.Thread(target=self._serve_conn, args=(_Connection(conn),), daemon=True,
                             name="ttrpc-conn").start()

    def close(self) -> None:
        self._closing = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def _serve_conn(self, conn: _Connection) -> None:
        try:
            while True:
                got = read_frame(conn.sock)
                if got is None:
                    return
                stream_id, msg_type, _flags, payload = got
                if msg_type != TYPE_REQUEST:
                    raise FrameError(f"frame type {msg_type} on stream {stream_id} is not a request")
                if stream_id % 2 == 0:
                    raise FrameError(f"request on even stream id {stream_id}")
                request = ttrpc_pb2.Request()
                try:
                    request.ParseFromString(payload)
                except DecodeError as e:
                    raise FrameError(f"undecodable request on stream {stream_id}: {e}") from None
                method = self.methods.get((request.service, request.method))
                parked = method is not None and method.deferred
                if parked and not self._parked.acquire(blocking=False):
                    conn.send(stream_id, _status(Code.RESOURCE_EXHAUSTED,
                                                 f"{MAX_PARKED} deferred calls are waiting already"))
                    continue
                self._workers.acquire()   # all busy: this connection is not read meanwhile
                threading.Thread(target=self._answer, args=(conn, stream_id, request, method, parked),
                                 daemon=True, name=f"ttrpc-{request.method}").start()
        except FrameError as e:
            log.warning("closing ttrpc connection: %s", e)
        except OSError as e:
            log.debug("ttrpc connection ended: %s", e)
        finally:
            conn.close()
            self._connections.release()

    def _answer(self, conn: _Connection, stream_id: int, request: ttrpc_pb2.Request,
                method: Method | None, parked: bool) -> None:
        try:
            result = self._call(request, method)
        except Exception as e:  # noqa: BLE001 - answered as a status by _response
            result = e
        finally:
            self._workers.release()
        if isinstance(result, Future):
            conn.park(result)
            result.add_done_callback(lambda f: self._answer_parked(conn, stream_id, request, f, parked))
            return
        conn.send(stream_id, _response(request, result))
        if parked:
            self._parked.release()

    def _answer_parked(self, conn: _Connection, stream_id: int, request: ttrpc_pb2.Request,
                       answer: Future, parked: bool) -> None:
        conn.unpark(answer)
        if parked:
            self._parked.release()
        if answer.cancelled():   # its connection closed
            return
        exc = answer.exception()
        conn.send(stream_id, _response(request, exc if exc is not None else answer.result()))

    def _call(self, request: ttrpc_pb2.Request, method: Method | None) -> Message | Future:
        if method is None:
            raise RpcError(Code.UNIMPLEMENTED, f"{request.service}/{request.method} is not implemented")
        message = method.request_type()
        try:
            message.ParseFromString(request.payload)
        except DecodeError as e:
            raise RpcError(Code.INVALID_ARGUMENT, f"cannot decode {message.DESCRIPTOR.full_name}: {e}") from None
        metadata = {kv.key: kv.value for kv in request.metadata}
        return method.handler(message, metadata)


def _status(code: Code, message: str) -> ttrpc_pb2.Response:
    response = ttrpc_pb2.Response()
    response.status.code = int(code)
    response.status.message = message
    return response


def _response(request: ttrpc_pb2.Request, result: Message | BaseException) -> ttrpc_pb2.Response:
    """A handler's answer, or its error as a status."""
    if isinstance(result, RpcError):
        return _status(result.code, result.message)
    if isinstance(result, BaseException):  # a handler bug must answer the caller, not kill the shim
        log.error("%s/%s failed", request.service, request.method, exc_info=result)
        return _status(Code.INTERNAL, f"{type(result).__name__}: {result}")
    return ttrpc_pb2.Response(payload=result.SerializeToString())


class Client:
    """A blocking ttrpc client: one call at a time per client (enough for events and tests)."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self._next_stream = 1
        self._lock = threading.Lock()

    def call(self, service: str, method: str, request: Message, response_type: type[Message],
             metadata: dict[str, str] | None = None, timeout_nano: int = 0) -> Message:
        req = ttrpc_pb2.Request(service=service, method=method, payload=request.SerializeToString(),
                                timeout_nano=timeout_nano)
        for k, v in (metadata or {}).items():
            req.metadata.add(key=k, value=v)
        with self._lock:
            stream_id = self._next_stream
            self._next_stream += 2
            self.sock.sendall(frame(stream_id, TYPE_REQUEST, req.SerializeToString()))
            while True:
                got = read_frame(self.sock)
                if got is None:
                    raise ConnectionError("ttrpc server closed the connection")
                sid, msg_type, _flags, payload = got
                if msg_type == TYPE_RESPONSE and sid == stream_id:
                    break
        resp = ttrpc_pb2.Response()
        resp.ParseFromString(payload)
        if resp.status.code != Code.OK:
            raise RpcError(Code(resp.status.code), resp.status.message)
        out = response_type()
        out.ParseFromString(resp.payload)
        return out

    def close(self) -> None:
        self.sock.close()


def socket_path(address: str) -> str:
    """`unix:///run/x.sock` or a bare path -> the path."""
    return address[len("unix://"):] if address.startswith("unix://") else address


def listen(path: str) -> socket.socket:
    """A listening unix socket at path, only for root (the shim's API is root's)."""
    os.makedirs(os.path.dirname(path), mode=0o711, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    return sock
