"""The shim's processes and their exits: the Process and Container records TaskService keeps, their
lookups, and the exit bookkeeping (one thread per process waits on quark's supervisor, an exit that
races a start is held back, Wait calls are answered, TaskExit is published in order). The RPC
handlers that drive them are in shim/service.py.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from google.protobuf.message import Message

from shim.oom import OomWatch
from shim.pb import events_task_pb2 as ev
from shim.pb import shim_pb2 as pb
from shim.pb import types_task_pb2 as types
from shim.runtime import Exit, Quark, now
from shim.stdio import ProcessIO
from shim.ttrpc import Code, RpcError

log = logging.getLogger("quark.shim.service")

OUTPUT_DRAIN_S = 2.0


@dataclass
class Process:
    container_id: str
    exec_id: str  # "" for the container's init
    stdin: str
    stdout: str
    stderr: str
    terminal: bool
    spec: bytes = b""  # an exec'd process's OCI process JSON
    pid: int = 0
    status: int = types.CREATED
    exit: Exit | None = None
    io: ProcessIO | None = None
    starting: bool = False
    pending_exit: Exit | None = None
    exited: threading.Event = field(default_factory=threading.Event)
    waiters: set[Future] = field(default_factory=set)  # Wait calls answered when it exits

    @property
    def name(self) -> str:
        """The process id containerd uses in events: the container id for the init."""
        return self.exec_id or self.container_id


@dataclass
class Container:
    id: str
    bundle: str
    init: Process
    rootfs_mounted: bool = False
    execs: dict[str, Process] = field(default_factory=dict)
    oom_stop: threading.Event = field(default_factory=threading.Event)
    oom: OomWatch | None = None   # (flushed before the init's TaskExit, closed before TaskDelete)


class ProcessTable:
    """The containers of this shim and their processes' exits; TaskService (shim/service.py) sets
    these attributes and adds the RPCs."""

    quark: Quark
    publish: Callable[[Message], None]
    containers: dict[str, Container]
    lock: threading.RLock   # guards containers, process status and event order

    # lookups

    def _container(self, cid: str) -> Container:
        with self.lock:
            c = self.containers.get(cid)
        if c is None:
            raise RpcError(Code.NOT_FOUND, f"container {cid!r} not found")
        return c

    def _process(self, cid: str, exec_id: str) -> tuple[Container, Process]:
        c = self._container(cid)
        if not exec_id:
            return c, c.init
        with self.lock:
            p = c.execs.get(exec_id)
        if p is None:
            raise RpcError(Code.NOT_FOUND, f"process {exec_id!r} of container {cid!r} not found")
        return c, p

    # exits

    def _watch(self, c: Container, p: Process) -> None:
        threading.Thread(target=self._wait_exit, args=(c, p), daemon=True, name=f"wait-{p.name}").start()

    def _wait_exit(self, c: Container, p: Process) -> None:
        try:
            exit_ = self.quark.wait(c.id, p.pid if p.exec_id else None)
        except RpcError as e:
            # quark can no longer tell how it ended (its state is gone): report it as killed
            log.error("quark wait for %s/%s failed: %s", c.id, p.name, e)
            exit_ = Exit(p.pid, 128 + 9, now())
        if p.io is not None:
            p.io.wait_output(OUTPUT_DRAIN_S)
        with self.lock:
            if p.starting:
                p.pending_exit = exit_
                return
        self._record_exit(c, p, exit_)

    def _flush_pending_exit(self, c: Container, p: Process) -> None:
        with self.lock:
            exit_, p.pending_exit = p.pending_exit, None
        if exit_ is not None:
            self._record_exit(c, p, exit_)

    def _record_exit(self, c: Container, p: Process, exit_: Exit) -> None:
        with self.lock:
            if p.exit is not None:
                return
            p.exit = exit_
            p.status = types.STOPPED
            if p.io is not None:
                p.io.close_stdin()
            if p is c.init and c.oom is not None:
                c.oom.flush()   # the kills that ended it come before its exit, as containerd expects
            self.publish(ev.TaskExit(container_id=c.id, id=p.name, pid=exit_.pid or p.pid,
                                     exit_status=exit_.status, exited_at=exit_.exited_at))
            p.exited.set()
            waiters, p.waiters = p.waiters, set()
        for answer in waiters:   # outside the lock: answering writes to containerd's connection
            if answer.set_running_or_notify_cancel():
                answer.set_result(wait_response(exit_))


def wait_response(exit_: Exit) -> pb.WaitResponse:
    return pb.WaitResponse(exit_status=exit_.status, exited_at=exit_.exited_at)


def remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

