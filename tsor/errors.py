"""TSoR's errors: what a user must know to fix a config, or why a sandbox's request failed."""
from __future__ import annotations

from qvisor.errors import QuarkError


class ConfigError(QuarkError):
    """A tsord config or route file is wrong: names the file and the field."""

    def __init__(self, path: str, field: str, problem: str) -> None:
        self.path, self.field = path, field
        super().__init__(f"{path}: {field}: {problem}" if field else f"{path}: {problem}")


class ProtocolError(Exception):
    """A malformed message from a peer: that request fails, the daemon keeps serving."""


class NotAllowed(Exception):
    """A sandbox asked for something it may not have (another sandbox's address, say)."""
