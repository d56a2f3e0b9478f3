"""Publishing task events to containerd over ttrpc ($TTRPC_ADDRESS), in order, surviving restarts.

One thread drains a queue, so events reach containerd in the order the shim queued them. An
event containerd cannot take (it is restarting) is retried with backoff for a while, holding
the events behind it: an exit that happened while containerd was down is still delivered,
after the events that preceded it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from google.protobuf import any_pb2, empty_pb2, timestamp_pb2
from google.protobuf.message import Message

from shim import ttrpc
from shim.pb import events_ttrpc_pb2

log = logging.getLogger("quark.shim.events")

SERVICE = "containerd.services.events.ttrpc.v1.Events"
NAMESPACE_METADATA = "containerd-namespace-ttrpc"
RETRY_FOR_S = 120.0

# event message name -> topic, as containerd's runtime names them
TOPICS = {
    "TaskCreate": "/tasks/create",
    "TaskStart": "/tasks/start",
    "TaskExit": "/tasks/exit",
    "TaskDelete": "/tasks/delete",
    "TaskExecAdded": "/tasks/exec-added",
    "TaskExecStarted": "/tasks/exec-started",
    "TaskPaused": "/tasks/paused",
    "TaskResumed": "/tasks/resumed",
    "TaskOOM": "/tasks/oom",
    "TaskCheckpointed": "/tasks/checkpointed",
}


def to_any(message: Message) -> any_pb2.Any:
    """containerd's typeurl names events by their bare full name, without a type.googleapis.com/ prefix."""
    return any_pb2.Any(type_url=message.DESCRIPTOR.full_name, value=message.SerializeToString())


class Publisher:
    def __init__(self, address: str, namespace: str) -> None:
        self.address = ttrpc.socket_path(address)
        self.namespace = namespace
        self._queue: queue.Queue[events_ttrpc_pb2.ForwardRequest | None] = queue.Queue()
        self._client: ttrpc.Client | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="events")
        self._thread.start()

    def publish(self, event: Message) -> None:
        topic = TOPICS[event.DESCRIPTOR.name]
        ts = timestamp_pb2.Timestamp()
        ts.GetCurrentTime()
        self._queue.put(events_ttrpc_pb2.ForwardRequest(envelope=events_ttrpc_pb2.Envelope(
            timestamp=ts, namespace=self.namespace, topic=topic, event=to_any(event))))

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued (up to timeout), then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            self._forward(req)

    def _forward(self, req: events_ttrpc_pb2.ForwardRequest) -> None:
        deadline = time.monotonic() + RETRY_FOR_S
        delay = 0.05
        while True:
            try:
                if self._client is None:
                    self._client = ttrpc.Client(self.address, timeout=5.0)
                self._client.call(SERVICE, "Forward", req, empty_pb2.Empty,
                                  metadata={NAMESPACE_METADATA: self.namespace})
                return
            except (OSError, ConnectionError, ttrpc.RpcError, ttrpc.FrameError) as e:
                if self._client is not None:
                    self._client.close()
                    self._client = None
                if time.monotonic() > deadline:
                    log.error("dropping event %s after %.0fs of retries: %s",
                              req.envelope.topic, RETRY_FOR_S, e)
                    return
                log.debug("event %s not delivered yet: %s", req.envelope.topic, e)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
