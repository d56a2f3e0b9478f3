"""The errors quark reports to its users: each carries what the user must know to fix it.

Each error also has a `kind`, one word for what went wrong. The kind crosses process boundaries
with the message (the supervisor's control-socket replies, the CLI's JSON log), so a caller such
as the containerd shim acts on the kind and never on the wording of a message.
"""
from __future__ import annotations

__all__ = ["AlreadyExists", "BpfError", "ConfigError", "ContainerExists", "ContainerNotFound", "InvalidArgument",
           "InvalidState", "NotFound", "QuarkError", "SetupError", "SupervisorGone", "Unsupported", "from_kind"]


class QuarkError(Exception):
    """Base of every error quark reports; the CLI prints it and exits 1."""
    kind = "unknown"


class NotFound(QuarkError):
    """A container or process that does not exist, or no longer does."""
    kind = "not_found"


class AlreadyExists(QuarkError):
    kind = "already_exists"


class InvalidArgument(QuarkError):
    """A malformed request: a bad flag value, config.json or process.json."""
    kind = "invalid_argument"


class InvalidState(QuarkError):
    """The operation is not allowed in the container's current status (e.g. start twice)."""
    kind = "invalid_state"


class Unsupported(QuarkError):
    """A valid OCI option quark does not implement on this host."""
    kind = "unsupported"


class ConfigError(InvalidArgument):
    """A config file is malformed or invalid (a bundle's config.json, tsord's config or route file):
    names the file and the field."""

    def __init__(self, path: str, field: str, message: str) -> None:
        self.path = path
        self.field = field
        self.message = message
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")


class ContainerNotFound(NotFound):
    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        super().__init__(f"container {container_id!r} does not exist")


class ContainerExists(AlreadyExists):
    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        super().__init__(f"container {container_id!r} already exists")


class SupervisorGone(InvalidState):
    """The container's supervisor is not there to answer (it exits right after its container)."""


class SetupError(QuarkError):
    """A step of sandbox creation failed; carries the step that failed."""


class BpfError(SetupError, OSError):
    """A compiled BPF object that could not be loaded (missing, stale, refused by the kernel): names the
    object file and the program or map, with the verifier's or libbpf's reason. An OSError too, as
    the bpf(2) calls' errors are: callers that fall back when the kernel cannot (no BPF, a helper
    missing) treat both alike."""


_BY_KIND = {cls.kind: cls for cls in (QuarkError, NotFound, AlreadyExists, InvalidArgument, InvalidState,
                                      Unsupported)}


def from_kind(kind: object, message: str) -> QuarkError:
    """The error another quark process reported as {"error": message, "kind": kind}."""
    return _BY_KIND.get(kind if isinstance(kind, str) else "", QuarkError)(message)
