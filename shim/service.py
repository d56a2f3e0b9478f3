"""containerd.task.v2.Task: the RPCs containerd sends a shim, served by driving the `quark` CLI.

One shim serves every container of a pod sandbox (or a single container), or with `shim: {scope:
node}` every quark container of its containerd and namespace (shim/serve.py says when it goes).
Container processes are children of quark's supervisor, not of the shim, so exits come from one
wait on the supervisor per process, watched from a thread; a Wait call holds no thread (see wait),
and a Kill for an exec'd process goes through the supervisor (see kill). Events keep containerd's
order: an exit that races a start is held back until TaskStart is queued.

The process records, their lookups and the exit bookkeeping are in shim/processes.py
(ProcessTable, which TaskService extends); this module holds the RPC handlers.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from google.protobuf import empty_pb2
from google.protobuf.message import Message

from shim import metrics, mount, oom, paths
from shim.pb import events_task_pb2 as ev
from shim.pb import shim_pb2 as pb
from shim.pb import types_task_pb2 as types
from shim.processes import Container, Process, ProcessTable, remove_file, wait_response
from shim.runtime import Exit, Quark, now, read_pid
from shim.stdio import ProcessIO
from shim.ttrpc import Code, Method, RpcError, Server

log = logging.getLogger("quark.shim.service")

SERVICE = "containerd.task.v2.Task"
FORCED_DELETE_EXIT_WAIT_S = 10.0
START_FAILURE_EXIT_WAIT_S = 5.0   # the init's exit after a failed start: its output drain and the wait


class TaskService(ProcessTable):
    def __init__(self, quark: Quark, publish: Callable[[Message], None], namespace: str,
                 on_shutdown: Callable[[], None],
                 on_containers: Callable[[list[str]], None] | None = None) -> None:
        self.quark = quark
        self.publish = publish
        self.namespace = namespace
        self.on_shutdown = on_shutdown
        self.on_containers = on_containers   # told the bundles served, oldest first, after a change
        self.containers: dict[str, Container] = {}
        self._creating: set[str] = set()
        self.lock = threading.RLock()  # guards containers, process status and event order
        self.last_call = time.monotonic()   # when a call last came (see idle_seconds)

    def register(self, server: Server) -> None:
        for name, (req_type, handler) in {
            "State": (pb.StateRequest, self.state), "Create": (pb.CreateTaskRequest, self.create),
            "Start": (pb.StartRequest, self.start), "Delete": (pb.DeleteRequest, self.delete),
            "Pids": (pb.PidsRequest, self.pids), "Pause": (pb.PauseRequest, self.pause),
            "Resume": (pb.ResumeRequest, self.resume), "Checkpoint": (pb.CheckpointTaskRequest, self.checkpoint),
            "Kill": (pb.KillRequest, self.kill), "Exec": (pb.ExecProcessRequest, self.exec),
            "ResizePty": (pb.ResizePtyRequest, self.resize_pty), "CloseIO": (pb.CloseIORequest, self.close_io),
            "Update": (pb.UpdateTaskRequest, self.update), "Wait": (pb.WaitRequest, self.wait),
            "Stats": (pb.StatsRequest, self.stats), "Connect": (pb.ConnectRequest, self.connect),
            "Shutdown": (pb.ShutdownRequest, self.shutdown),
        }.items():
            server.register(SERVICE, name, Method(req_type, lambda req, _md, h=handler: self._called(h, req),
                                                  deferred=handler == self.wait))

    def _called(self, handler: Callable, req: Message):
        self.last_call = time.monotonic()
        return handler(req)

    def idle_seconds(self) -> float | None:
        """How long this shim has served no container and answered no call; None while it serves
        one (or one is being created)."""
        with self.lock:
            if self.containers or self._creating:
                return None
            return time.monotonic() - self.last_call

    def _containers_changed(self) -> None:
        if self.on_containers is not None:
            with self.lock:
                bundles = [c.bundle for c in self.containers.values()]
            self.on_containers(bundles)

    # lifecycle

    def create(self, req: pb.CreateTaskRequest) -> pb.CreateTaskResponse:
        if not req.id or not req.bundle:
            raise RpcError(Code.INVALID_ARGUMENT, "create needs an id and a bundle")
        if req.checkpoint:
            raise RpcError(Code.UNIMPLEMENTED, "restoring from a checkpoint is not implemented")
        with self.lock:
            if req.id in self.containers or req.id in self._creating:
                raise RpcError(Code.ALREADY_EXISTS, f"container {req.id!r} already exists")
            self._creating.add(req.id)
        rootfs = os.path.join(req.bundle, "rootfs")
        io = None
        mounted = created = False
        try:
            if req.rootfs:
                mount.mount_rootfs(list(req.rootfs), rootfs)
                mounted = True
            io = ProcessIO(req.stdin, req.stdout, req.stderr, req.terminal, req.id, self.namespace)
            pid_file = os.path.join(req.bundle, paths.INIT_PID)
            try:
                self.quark.create(req.id, req.bundle, pid_file, io.fds, io.console_path)
            finally:
                io.close_after_spawn()
            created = True
            if req.terminal:
                io.receive_console()
            pid = read_pid(pid_file)
        except BaseException:
            if created:
                self.quark.delete(req.id, force=True)
            if io is not None:
                io.close()
            if mounted:
                mount.unmount_all(rootfs)
            with self.lock:
                self._creating.discard(req.id)
            raise
        init = Process(req.id, "", req.stdin, req.stdout, req.stderr, req.terminal, pid=pid, io=io)
        c = Container(req.id, req.bundle, init, rootfs_mounted=mounted)
        with self.lock:
            self._creating.discard(req.id)
            self.containers[req.id] = c
            self.publish(ev.TaskCreate(
                container_id=req.id, bundle=req.bundle, rootfs=list(req.rootfs), pid=pid,
                io=ev.TaskIO(stdin=req.stdin, stdout=req.stdout, stderr=req.stderr, terminal=req.terminal),
                checkpoint=req.checkpoint))
        self._watch(c, init)
        c.oom = oom.watch(pid, lambda: self.publish(ev.TaskOOM(container_id=req.id)), c.oom_stop)
        self._containers_changed()
        return pb.CreateTaskResponse(pid=pid)

    def start(self, req: pb.StartRequest) -> pb.StartResponse:
        c, p = self._process(req.id, req.exec_id)
        with self.lock:
            if p.status != types.CREATED or p.starting or p.exit is not None:
                raise RpcError(Code.FAILED_PRECONDITION,
                               f"process {p.name!r} cannot start: it is {types.Status.Name(p.status).lower()}")
            p.starting = True
        if p.exec_id:
            return self._start_exec(c, p)
        try:
            self.quark.start(c.id)
        except BaseException:
            with self.lock:
                p.starting = False
            self._flush_pending_exit(c, p)
            # a failed start ends the init (as runc's does); containerd's CRI then kills (answered
            # "not running") and deletes the task, and its client refuses to delete one still
            # "created": answer once the exit is recorded, so the task is stopped by then
            p.exited.wait(START_FAILURE_EXIT_WAIT_S)
            raise
        with self.lock:
            p.status = types.RUNNING
            self.publish(ev.TaskStart(container_id=c.id, pid=p.pid))
            p.starting = False
        self._flush_pending_exit(c, p)
        return pb.StartResponse(pid=p.pid)

    def _start_exec(self, c: Container, p: Process) -> pb.StartResponse:
        fd, spec_path = tempfile.mkstemp(prefix=f"exec-{p.exec_id}-", suffix=".json", dir=c.bundle)
        with os.fdopen(fd, "wb") as f:
            f.write(p.spec)
        pid_file = spec_path[:-len(".json")] + ".pid"
        log_path = spec_path[:-len(".json")] + ".log.json"
        io = None
        try:
            io = ProcessIO(p.stdin, p.stdout, p.stderr, p.terminal, c.id, self.namespace)
            try:
                self.quark.exec(c.id, spec_path, pid_file, io.fds, io.console_path, log_path)
            finally:
                io.close_after_spawn()
            if p.terminal:
                io.receive_console()
            pid = read_pid(pid_file)
        except BaseException:
            if io is not None:
                io.close()
            with self.lock:
                p.starting = False
            raise
        finally:
            for path in (spec_path, pid_file, log_path):
                remove_file(path)
        with self.lock:
            p.io, p.pid, p.status = io, pid, types.RUNNING
            self.publish(ev.TaskExecStarted(container_id=c.id, exec_id=p.exec_id, pid=pid))
            p.starting = False
        self._watch(c, p)
        return pb.StartResponse(pid=pid)

    def delete(self, req: pb.DeleteRequest) -> pb.DeleteResponse:
        c, p = self._process(req.id, req.exec_id)
        with self.lock:
            if p.status in (types.RUNNING, types.PAUSED, types.PAUSING) or p.starting:
                raise RpcError(Code.FAILED_PRECONDITION, f"cannot delete running process {p.name!r}")
        if p.exec_id:
            with self.lock:
                c.execs.pop(p.exec_id, None)
            if p.io is not None:
                p.io.close()
            return self._delete_response(p)
        never_started = p.exit is None
        try:
            self.quark.delete(c.id, force=never_started)
        except RpcError as e:
            if e.code != Code.NOT_FOUND:
                raise
        remove_file(os.path.join(c.bundle, paths.INIT_PID))  # tells `shim delete` quark has nothing left
        if never_started and not p.exited.wait(FORCED_DELETE_EXIT_WAIT_S):
            self._record_exit(c, p, Exit(p.pid, 128 + 9, now()))
        if c.oom is not None:
            c.oom.close()   # no OOM event after the delete
        c.oom_stop.set()
        if p.io is not None:
            p.io.close()
        for e in list(c.execs.values()):
            if e.io is not None:
                e.io.close()
        if c.rootfs_mounted:
            mount.unmount_all(os.path.join(c.bundle, "rootfs"))
        resp = self._delete_response(p)
        with self.lock:
            self.containers.pop(c.id, None)
            self.publish(ev.TaskDelete(container_id=c.id, pid=resp.pid, exit_status=resp.exit_status,
                                       exited_at=resp.exited_at))
        self._containers_changed()
        return resp

    @staticmethod
    def _delete_response(p: Process) -> pb.DeleteResponse:
        resp = pb.DeleteResponse(pid=p.pid)
        if p.exit is not None:
            resp.exit_status = p.exit.status
            resp.exited_at.CopyFrom(p.exit.exited_at)
        return resp

    def wait(self, req: pb.WaitRequest) -> Future:
        """Answered when the process exits; no thread waits for it meanwhile (a deferred method)."""
        _c, p = self._process(req.id, req.exec_id)
        answer: Future = Future()
        with self.lock:
            if p.exit is None:
                p.waiters.add(answer)
                # the server cancels a Wait whose connection closed: it is forgotten here too
                answer.add_done_callback(lambda f: self._forget_waiter(p, f))
                return answer
            exit_ = p.exit
        answer.set_result(wait_response(exit_))
        return answer

    def _forget_waiter(self, p: Process, answer: Future) -> None:
        with self.lock:
            p.waiters.discard(answer)

    def state(self, req: pb.StateRequest) -> pb.StateResponse:
        c, p = self._process(req.id, req.exec_id)
        with self.lock:
            resp = pb.StateResponse(id=p.name, bundle=c.bundle, pid=p.pid, status=p.status, stdin=p.stdin,
                                    stdout=p.stdout, stderr=p.stderr, terminal=p.terminal, exec_id=p.exec_id)
            if p.exit is not None:
                resp.exit_status = p.exit.status
                resp.exited_at.CopyFrom(p.exit.exited_at)
        return resp

    # signals and control

    def kill(self, req: pb.KillRequest) -> empty_pb2.Empty:
        c, p = self._process(req.id, req.exec_id)
        if p.exec_id:
            with self.lock:
                if p.exit is not None:
                    raise RpcError(Code.NOT_FOUND, f"process {p.name!r} already finished")
                if p.pid == 0:
                    raise RpcError(Code.FAILED_PRECONDITION, f"process {p.name!r} not started")
            # by quark's supervisor, which holds the process until it reaps it: the pid alone may
            # be another process's by now (its exit reaches us up to OUTPUT_DRAIN_S later)
            self.quark.kill_exec(c.id, p.pid, req.signal)
            return empty_pb2.Empty()
        if p.exit is not None and not req.all:
            raise RpcError(Code.NOT_FOUND, f"process {p.name!r} already finished")
        self.quark.kill(c.id, req.signal, req.all)
        return empty_pb2.Empty()

    def pause(self, req: pb.PauseRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        self.quark.pause(c.id)
        with self.lock:
            if c.init.exit is None:
                c.init.status = types.PAUSED
            self.publish(ev.TaskPaused(container_id=c.id))
        return empty_pb2.Empty()

    def resume(self, req: pb.ResumeRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        self.quark.resume(c.id)
        with self.lock:
            if c.init.exit is None:
                c.init.status = types.RUNNING
            self.publish(ev.TaskResumed(container_id=c.id))
        return empty_pb2.Empty()

    def pids(self, req: pb.PidsRequest) -> pb.PidsResponse:
        c = self._container(req.id)
        return pb.PidsResponse(processes=[types.ProcessInfo(pid=pid) for pid in self.quark.ps(c.id)])

    def exec(self, req: pb.ExecProcessRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        if not req.exec_id:
            raise RpcError(Code.INVALID_ARGUMENT, "exec needs an exec id")
        with self.lock:
            if c.init.exit is not None:
                raise RpcError(Code.FAILED_PRECONDITION, f"container {c.id!r} has stopped")
            if req.exec_id in c.execs:
                raise RpcError(Code.ALREADY_EXISTS, f"process {req.exec_id!r} already exists")
            c.execs[req.exec_id] = Process(c.id, req.exec_id, req.stdin, req.stdout, req.stderr,
                                           req.terminal, spec=req.spec.value)
            self.publish(ev.TaskExecAdded(container_id=c.id, exec_id=req.exec_id))
        return empty_pb2.Empty()

    def resize_pty(self, req: pb.ResizePtyRequest) -> empty_pb2.Empty:
        _c, p = self._process(req.id, req.exec_id)
        if p.io is not None:
            p.io.resize(req.width, req.height)
        return empty_pb2.Empty()

    def close_io(self, req: pb.CloseIORequest) -> empty_pb2.Empty:
        _c, p = self._process(req.id, req.exec_id)
        if req.stdin and p.io is not None:
            p.io.close_stdin()
        return empty_pb2.Empty()

    def update(self, req: pb.UpdateTaskRequest) -> empty_pb2.Empty:
        c = self._container(req.id)
        if not req.resources.value:
            raise RpcError(Code.INVALID_ARGUMENT, "update needs resources")
        self.quark.update(c.id, req.resources.value)
        return empty_pb2.Empty()

    def stats(self, req: pb.StatsRequest) -> pb.StatsResponse:
        c = self._container(req.id)
        return pb.StatsResponse(stats=metrics.to_any(self.quark.stats(c.id)))

    def checkpoint(self, req: pb.CheckpointTaskRequest) -> empty_pb2.Empty:
        raise RpcError(Code.UNIMPLEMENTED, "checkpoint is not implemented until quark has snapshots")

    # the shim itself

    def connect(self, req: pb.ConnectRequest) -> pb.ConnectResponse:
        with self.lock:
            c = self.containers.get(req.id)
            task_pid = c.init.pid if c else 0
        return pb.ConnectResponse(shim_pid=os.getpid(), task_pid=task_pid)

    def shutdown(self, req: pb.ShutdownRequest) -> empty_pb2.Empty:
        with self.lock:
            if self.containers and not req.now:
                return empty_pb2.Empty()
        self.on_shutdown()
        return empty_pb2.Empty()

