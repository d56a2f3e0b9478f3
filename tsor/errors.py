"""TSoR's errors: what a user must know to fix a config, or why a sandbox's request failed."""
from __future__ import annotations

# tsord's config and route files report through the one ConfigError (path, field, message) every
# quark package uses; the messages are the same "path: field: problem" as before.
from qlib.errors import ConfigError

__all__ = ["ConfigError", "NotAllowed", "ProtocolError"]


class ProtocolError(Exception):
    """A malformed message from a peer: that request fails, the daemon keeps serving."""


class NotAllowed(Exception):
    """A sandbox asked for something it may not have (another sandbox's address, say)."""
