"""The state store: one directory per container under --root, holding state.json.

The directory is created with mkdir, which is atomic: of two concurrent creates of one id exactly
one wins. state.json is replaced with rename, so readers never see half a file. Status is derived
when read — a container whose init died (even with its supervisor) reads as stopped.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field

from qlib import procfs
from qlib.errors import ContainerExists, ContainerNotFound, QuarkError
from qlib.version import OCI_SPEC

OCI_VERSION = OCI_SPEC
_VALID_ID = re.compile(r"^[\w+\-.]+$")

SOCK_NAME = "sv.sock"  # the supervisor's control socket, in the container's state directory
HIBERNATION_RECORD = "hibernation.json"   # while the container is hibernated (qvisor/supervisor/snapshot.py)
HIBERNATED_ANNOTATION = "io.quark.hibernated"   # `state` and `list` show hibernation so (status: paused)
CREATING, CREATED, RUNNING, PAUSED, STOPPED = "creating", "created", "running", "paused", "stopped"


@dataclass
class ContainerState:
    id: str
    bundle: str
    status: str = CREATING
    pid: int = 0
    pid_start_time: int = 0         # tells our init from a later process that reused its pid
    supervisor_pid: int = 0
    created: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    cgroup_path: str = ""
    rootfs: str = ""
    exit_status: int | None = None
    exited_at: str = ""
    platform: str = "seccomp"
    caller_reaps: bool = False      # the caller's subreaper reaps the container's processes (supervisor/reaper.py)
    version: str = ""               # the quark that created it (qlib/version.py): after a node upgrade, which run the old one

    def oci(self) -> dict:
        """The OCI runtime-spec state object, as `quark state` prints it."""
        return {"ociVersion": OCI_VERSION, "id": self.id, "status": self.status,
                "pid": self.pid if self.status in (CREATED, RUNNING, PAUSED) else 0,
                "bundle": self.bundle, "rootfs": self.rootfs, "created": self.created,
                "annotations": self.annotations}


def now_rfc3339() -> str:
    t = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t // 10**9)) + f".{t % 10**9:09d}Z"


def validate_id(container_id: str) -> None:
    if not container_id or not _VALID_ID.match(container_id) or container_id in (".", ".."):
        raise QuarkError(f"invalid container id {container_id!r}: use letters, digits, '_', '+', '-', '.'")


class StateStore:
    def __init__(self, root: str) -> None:
        self.root = root

    def dir(self, container_id: str) -> str:
        return os.path.join(self.root, container_id)

    def path(self, container_id: str, name: str) -> str:
        return os.path.join(self.root, container_id, name)

    def reserve(self, container_id: str) -> str:
        """Claim the id; raises ContainerExists if another create has it."""
        validate_id(container_id)
        os.makedirs(self.root, mode=0o711, exist_ok=True)
        d = self.dir(container_id)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            raise ContainerExists(container_id) from None
        return d

    def save(self, st: ContainerState) -> None:
        tmp = self.path(st.id, ".state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(st), f)
        os.rename(tmp, self.path(st.id, "state.json"))

    def load_raw(self, container_id: str) -> ContainerState:
        validate_id(container_id)
        try:
            with open(self.path(container_id, "state.json")) as f:
                data = json.load(f)
        except FileNotFoundError:
            if os.path.isdir(self.dir(container_id)):
                # reserved but never saved: a create in progress (or one that crashed)
                return ContainerState(id=container_id, bundle="", status=CREATING)
            raise ContainerNotFound(container_id) from None
        names = {f.name for f in dataclasses.fields(ContainerState)}
        return ContainerState(**{k: v for k, v in data.items() if k in names})

    def load(self, container_id: str) -> ContainerState:
        """The state with status derived from the live system."""
        st = self.load_raw(container_id)
        st.status = derive_status(st)
        if st.status == PAUSED:
            record = self.hibernation(container_id)
            if record is not None:
                st.annotations = dict(st.annotations) | {HIBERNATED_ANNOTATION: record.get("since", "true")}
        return st

    def hibernation(self, container_id: str) -> dict | None:
        """The hibernation record of a hibernated container (None: not hibernated)."""
        try:
            with open(self.path(container_id, HIBERNATION_RECORD)) as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def list(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if os.path.isdir(self.dir(n)))
        except FileNotFoundError:
            return []

    def remove(self, container_id: str) -> None:
        shutil.rmtree(self.dir(container_id), ignore_errors=True)


def init_alive(st: ContainerState) -> bool:
    return st.pid > 0 and procfs.start_time(st.pid) == st.pid_start_time


def derive_status(st: ContainerState) -> str:
    if st.status in (CREATING, STOPPED):
        return st.status
    if not init_alive(st):
        return STOPPED
    if st.status == RUNNING and st.cgroup_path:
        from qvisor import cgroups
        try:
            if cgroups.open_cgroup(st.cgroup_path).frozen():
                return PAUSED
        except OSError:
            pass
    return st.status
