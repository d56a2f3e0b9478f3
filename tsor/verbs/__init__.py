"""The verbs interface TSoR's rdma transport is written against: exactly the subset it uses.

`pyverbs` (tsor/verbs/pyverbs_provider.py, a real device through rdma-core) implements it; so does
the host tests' double, softverbs (tests/support/softverbs.py: one-sided RDMA writes carried over a
TCP or unix stream, for machines without RDMA). The enums carry libibverbs'
own values, so a provider over the C library passes them through unchanged.

Semantics follow libibverbs for an RC queue pair: a QP goes RESET -> INIT -> RTR -> RTS and lands in
ERR on any fault, after which every outstanding and newly posted work request completes with
WR_FLUSH_ERR; an RDMA write with immediate consumes one posted receive WR at the responder (none
posted: the requester's WR fails with RNR_RETRY_EXC_ERR); completions are polled from a CQ, and a
CQ armed with req_notify() makes its completion channel's fd readable once.
"""
from __future__ import annotations

import enum
import errno
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


class VerbsError(OSError):
    """A verb was refused (ibv_* returned an errno): bad state, bad key, queue full."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(err, f"{what}: {os.strerror(err)}")


class NoDevice(VerbsError):
    """No usable RDMA device: the caller falls back to another transport."""

    def __init__(self, detail: str) -> None:
        OSError.__init__(self, errno.ENODEV, f"no RDMA device ({detail})")

    def __str__(self) -> str:
        return self.strerror


class QpState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERR = 6


class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4


class WrOpcode(enum.IntEnum):
    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2


class WcOpcode(enum.IntEnum):
    SEND = 0
    RDMA_WRITE = 1
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WcStatus(enum.IntEnum):
    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    GENERAL_ERR = 21          # any status this interface does not name


@dataclass(frozen=True)
class Sge:
    addr: int
    length: int
    lkey: int


@dataclass
class SendWr:
    wr_id: int
    opcode: WrOpcode
    sg: list[Sge]
    remote_addr: int = 0
    rkey: int = 0
    imm_data: int = 0        # host order, 32 bits
    signaled: bool = True


@dataclass
class RecvWr:
    wr_id: int
    sg: list[Sge] = field(default_factory=list)


@dataclass(frozen=True)
class Wc:
    wr_id: int
    status: WcStatus
    opcode: WcOpcode
    byte_len: int = 0
    imm_data: int = 0
    qp_num: int = 0


@dataclass(frozen=True)
class PortInfo:
    active: bool
    lid: int
    gid: bytes          # 16 bytes
    mtu: int
    max_msg_size: int


@dataclass(frozen=True)
class QpInfo:
    """What the other end needs to connect an RC QP to this one."""
    qpn: int
    psn: int
    gid: bytes
    lid: int


class MemoryRegion(ABC):
    addr: int
    length: int
    lkey: int
    rkey: int
    view: memoryview    # the registered bytes, for the owner's own reads and writes

    @abstractmethod
    def close(self) -> None: ...


class CompletionQueue(ABC):
    @abstractmethod
    def poll(self, n: int) -> list[Wc]:
        """Up to n completions, oldest first; [] when empty."""

    @abstractmethod
    def req_notify(self) -> None:
        """Arm: the next completion added makes the channel's fd readable."""

    @abstractmethod
    def close(self) -> None: ...


class CompletionChannel(ABC):
    @abstractmethod
    def fileno(self) -> int:
        """Readable once an armed CQ got a completion; poll/select/epoll it."""

    @abstractmethod
    def get_events(self) -> int:
        """Consume and acknowledge the pending events (never blocks); how many there were."""

    @abstractmethod
    def close(self) -> None: ...


class QueuePair(ABC):
    qp_num: int

    @property
    @abstractmethod
    def state(self) -> QpState: ...

    @abstractmethod
    def to_init(self, access: Access) -> None: ...

    @abstractmethod
    def to_rtr(self, remote: QpInfo) -> None:
        """Connect to the remote QP; remote.psn is the first PSN it will send."""

    @abstractmethod
    def to_rts(self, psn: int) -> None: ...

    @abstractmethod
    def to_error(self) -> None: ...

    @abstractmethod
    def post_send(self, wr: SendWr) -> None: ...

    @abstractmethod
    def post_recv(self, wr: RecvWr) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class ProtectionDomain(ABC):
    @abstractmethod
    def reg_mr(self, buf: bytearray | memoryview, access: Access) -> MemoryRegion:
        """Register a writable Python buffer (it stays pinned: a bytearray cannot be resized)."""

    @abstractmethod
    def create_qp(self, send_cq: CompletionQueue, recv_cq: CompletionQueue, max_send_wr: int,
                  max_recv_wr: int) -> QueuePair: ...

    @abstractmethod
    def close(self) -> None: ...


class Device(ABC):
    """An opened device (ibv_context) and its one port."""
    name: str
    provider: str
    # its memory regions are ordinary pages (a software device), not pinned by an adapter: a
    # finished connection's ring pages may be given back (transport/rdma.py)
    plain_memory: bool = False

    @abstractmethod
    def port(self) -> PortInfo: ...

    @abstractmethod
    def alloc_pd(self) -> ProtectionDomain: ...

    @abstractmethod
    def create_comp_channel(self) -> CompletionChannel: ...

    @abstractmethod
    def create_cq(self, depth: int, channel: CompletionChannel | None) -> CompletionQueue: ...

    @abstractmethod
    def close(self) -> None: ...
