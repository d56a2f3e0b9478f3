"""The errors quark reports to its users: each carries what the user must know to fix it."""
from __future__ import annotations


class QuarkError(Exception):
    """Base of every error quark reports; the CLI prints it and exits 1."""


class ConfigError(QuarkError):
    """config.json is malformed or invalid; names the file and the field."""

    def __init__(self, path: str, field: str, message: str) -> None:
        self.path = path
        self.field = field
        self.message = message
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")


class ContainerNotFound(QuarkError):
    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        super().__init__(f"container {container_id!r} does not exist")


class ContainerExists(QuarkError):
    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        super().__init__(f"container {container_id!r} already exists")


class InvalidState(QuarkError):
    """The operation is not allowed in the container's current status (e.g. start twice)."""


class Unsupported(QuarkError):
    """A valid OCI option quark does not implement on this host."""


class SetupError(QuarkError):
    """A step of sandbox creation failed; carries the step that failed."""
