"""The client side of containerd's CRI stream server (the URLs Exec, Attach and PortForward answer).

kubelet's stream server speaks SPDY and WebSocket; this uses WebSocket (websocket-client), the
channel protocol `v4.channel.k8s.io`: every binary frame starts with one channel byte. For exec and
attach 0 is stdin, 1 stdout, 2 stderr, 3 the final status (JSON), 4 terminal resize; for port-forward
each port has a data channel (2*i) and an error channel (2*i+1), and the first frame the server
sends on each starts with the port number (2 bytes, little endian).
"""
from __future__ import annotations

import json
import time

import websocket

PROTOCOL = "v4.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR, RESIZE = range(5)


class Stream:
    """One WebSocket stream session; `read_until_close` gathers bytes per channel."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        ws_url = "ws://" + url.split("://", 1)[1] if url.startswith("http") else url
        self.ws = websocket.create_connection(ws_url, subprotocols=[PROTOCOL], timeout=timeout)
        self.out: dict[int, bytes] = {}

    def send(self, channel: int, data: bytes) -> None:
        self.ws.send_binary(bytes([channel]) + data)

    def recv(self) -> tuple[int, bytes] | None:
        """One frame as (channel, payload); None once the server closed the stream."""
        try:
            opcode, data = self.ws.recv_data()
        except websocket.WebSocketConnectionClosedException:
            return None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return None
        if not data:
            return (-1, b"")
        return data[0], data[1:]

    def read_until(self, channel: int, wanted: bytes, timeout: float = 30.0) -> bytes:
        """Frames until channel's bytes hold wanted (or the stream ends); answers that channel's bytes."""
        deadline = time.monotonic() + timeout
        while wanted not in self.out.get(channel, b"") and time.monotonic() < deadline:
            frame = self.recv()
            if frame is None:
                break
            ch, data = frame
            self.out[ch] = self.out.get(ch, b"") + data
        return self.out.get(channel, b"")

    def read_until_close(self, timeout: float = 60.0) -> dict[int, bytes]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frame = self.recv()
            if frame is None:
                break
            ch, data = frame
            self.out[ch] = self.out.get(ch, b"") + data
        return self.out

    def status(self) -> dict:
        """The exec/attach status from the error channel ({} when none came)."""
        raw = self.out.get(ERROR, b"")
        return json.loads(raw) if raw.strip() else {}

    def close(self) -> None:
        self.ws.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
