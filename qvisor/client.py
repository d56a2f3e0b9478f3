"""The CLI's side of the supervisor's control socket."""
from __future__ import annotations

import socket

from qlib.errors import SupervisorGone, from_kind
from qvisor import channel, paths
from qvisor.state import SOCK_NAME


class Connection:
    def __init__(self, state_dir: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with paths.socket_address(f"{state_dir}/{SOCK_NAME}") as address:
                self.sock.connect(address)
        except (FileNotFoundError, ConnectionRefusedError):
            self.sock.close()
            raise SupervisorGone("the container's supervisor is not running") from None
        self.reader = channel.LineReader(self.sock)

    def call(self, msg: dict, fds: list[int] | tuple[int, ...] = ()) -> tuple[dict, list[int]]:
        """Send one request and return the reply; an {"error", "kind"} reply raises the QuarkError
        of that kind."""
        try:
            channel.send(self.sock, msg, fds)
            reply, rfds = self.reader.read()
        except (channel.ChannelClosed, ConnectionError):
            # the supervisor exits right after its container does; callers treat this like no supervisor
            raise SupervisorGone("the container's supervisor closed the connection") from None
        if "error" in reply:
            raise from_kind(reply.get("kind"), reply["error"])
        return reply, rfds

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
