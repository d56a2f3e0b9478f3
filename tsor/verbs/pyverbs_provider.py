"""The verbs interface over a real RDMA device, through rdma-core's Python bindings (pyverbs).

Two pyverbs layouts exist: Debian 12's python3-pyverbs (rdma-core 44) has flat constants in
`pyverbs.enums` (e.g. `enums.IBV_QPS_RTS`); PyPI's pyverbs (rdma-core 5x) has one class per C enum
in `pyverbs.libibverbs_enums` (e.g. `ibv_qp_state.IBV_QPS_RTS`). `constants()` reads either.

The parts that decide something (constants, the attributes and masks of each QP transition, GID
text, immediate data byte order) are plain functions, testable without a device or even without
pyverbs; the classes below only hand their results to pyverbs.
"""
from __future__ import annotations

import ctypes
import errno
import importlib
import os
import socket
import threading
from dataclasses import dataclass

from tsor.verbs import (
    Access,
    CompletionChannel,
    CompletionQueue,
    Device,
    MemoryRegion,
    NoDevice,
    PortInfo,
    ProtectionDomain,
    QpInfo,
    QpState,
    QueuePair,
    RecvWr,
    SendWr,
    VerbsError,
    Wc,
    WcOpcode,
    WcStatus,
    WrOpcode,
)

# (C enum type, constant) for everything this provider passes to or reads from libibverbs
_NEEDED = {
    "ibv_qp_state": ("IBV_QPS_RESET", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_QPS_ERR"),
    "ibv_qp_type": ("IBV_QPT_RC",),
    "ibv_access_flags": ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_READ"),
    "ibv_wr_opcode": ("IBV_WR_RDMA_WRITE", "IBV_WR_RDMA_WRITE_WITH_IMM", "IBV_WR_SEND"),
    "ibv_send_flags": ("IBV_SEND_SIGNALED",),
    "ibv_port_state": ("IBV_PORT_ACTIVE",),
    "ibv_wc_opcode": ("IBV_WC_SEND", "IBV_WC_RDMA_WRITE", "IBV_WC_RECV", "IBV_WC_RECV_RDMA_WITH_IMM"),
    "ibv_qp_attr_mask": ("IBV_QP_STATE", "IBV_QP_PKEY_INDEX", "IBV_QP_PORT", "IBV_QP_ACCESS_FLAGS", "IBV_QP_AV",
                         "IBV_QP_PATH_MTU", "IBV_QP_DEST_QPN", "IBV_QP_RQ_PSN", "IBV_QP_MAX_DEST_RD_ATOMIC",
                         "IBV_QP_MIN_RNR_TIMER", "IBV_QP_SQ_PSN", "IBV_QP_TIMEOUT", "IBV_QP_RETRY_CNT",
                         "IBV_QP_RNR_RETRY", "IBV_QP_MAX_QP_RD_ATOMIC"),
}
ENUM_MODULES = ("pyverbs.libibverbs_enums", "pyverbs.enums")
RNR_RETRY_INFINITE = 7   # the ring transport never lets an RNR happen; if one did, hardware waits, not fails
MIN_RNR_TIMER = 12       # 0.64 ms
TIMEOUT = 14             # 4.096 us * 2^14 = 67 ms per retry
RETRY_CNT = 7


def constants() -> dict[str, int]:
    """Every constant in _NEEDED by name, from whichever pyverbs layout is installed."""
    problems = []
    for modname in ENUM_MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            problems.append(str(e))
            continue
        try:
            return {name: _lookup(mod, ctype, name) for ctype, names in _NEEDED.items() for name in names}
        except AttributeError as e:
            problems.append(f"{modname}: {e}")
    raise NoDevice(f"pyverbs is not usable: {'; '.join(problems)}")


def _lookup(mod: object, ctype: str, name: str) -> int:
    scope = getattr(mod, ctype, None)   # rdma-core 5x: one class per C enum
    value = getattr(scope, name, None) if scope is not None else None
    if value is None:
        value = getattr(mod, name, None)   # rdma-core 44: flat module constants
    if value is None:
        raise AttributeError(f"no {ctype}.{name}")
    return int(value)


@dataclass(frozen=True)
class Transition:
    """One ibv_modify_qp: the QPAttr fields to set, the attribute mask, and for RTR the address
    vector (ah: AHAttr fields; gid: the remote GID, in which case a GRH is used, as RoCE needs)."""
    fields: dict[str, int]
    mask: int
    ah: dict[str, int] | None = None
    gid: bytes | None = None


def access_flags(c: dict[str, int], access: Access) -> int:
    out = 0
    for flag, name in ((Access.LOCAL_WRITE, "IBV_ACCESS_LOCAL_WRITE"), (Access.REMOTE_WRITE, "IBV_ACCESS_REMOTE_WRITE"),
                       (Access.REMOTE_READ, "IBV_ACCESS_REMOTE_READ")):
        if access & flag:
            out |= c[name]
    return out


def _mask(c: dict[str, int], *names: str) -> int:
    out = 0
    for n in names:
        out |= c["IBV_QP_" + n]
    return out


def init_transition(c: dict[str, int], access: Access, port: int) -> Transition:
    return Transition({"qp_state": c["IBV_QPS_INIT"], "pkey_index": 0, "port_num": port,
                       "qp_access_flags": access_flags(c, access)},
                      _mask(c, "STATE", "PKEY_INDEX", "PORT", "ACCESS_FLAGS"))


def rtr_transition(c: dict[str, int], remote: QpInfo, port: int, path_mtu: int, sgid_index: int) -> Transition:
    """path_mtu: the ibv_mtu value (the port's active MTU). A remote GID of zeros means an
    InfiniBand fabric routed by LID alone; anything else gets a GRH (RoCE)."""
    global_route = any(remote.gid)
    ah = {"port_num": port, "dlid": remote.lid, "is_global": int(global_route), "sl": 0}
    if global_route:
        ah["sgid_index"] = sgid_index
        ah["hop_limit"] = 64
    return Transition({"qp_state": c["IBV_QPS_RTR"], "path_mtu": path_mtu, "dest_qp_num": remote.qpn,
                       "rq_psn": remote.psn & 0xFFFFFF, "max_dest_rd_atomic": 1, "min_rnr_timer": MIN_RNR_TIMER},
                      _mask(c, "STATE", "AV", "PATH_MTU", "DEST_QPN", "RQ_PSN", "MAX_DEST_RD_ATOMIC",
                            "MIN_RNR_TIMER"),
                      ah, remote.gid if global_route else None)


def rts_transition(c: dict[str, int], psn: int) -> Transition:
    return Transition({"qp_state": c["IBV_QPS_RTS"], "sq_psn": psn & 0xFFFFFF, "timeout": TIMEOUT,
                       "retry_cnt": RETRY_CNT, "rnr_retry": RNR_RETRY_INFINITE, "max_rd_atomic": 1},
                      _mask(c, "STATE", "SQ_PSN", "TIMEOUT", "RETRY_CNT", "RNR_RETRY", "MAX_QP_RD_ATOMIC"))


def error_transition(c: dict[str, int]) -> Transition:
    return Transition({"qp_state": c["IBV_QPS_ERR"]}, _mask(c, "STATE"))


def qp_attr(t: Transition):
    """The pyverbs QPAttr of a transition (needs pyverbs, not a device)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr
    attr = QPAttr()
    for k, v in t.fields.items():
        setattr(attr, k, v)
    if t.ah is not None:
        ah = dict(t.ah)
        gr = None
        if t.gid is not None:
            gr = GlobalRoute(dgid=GID(val=gid_text(t.gid)), sgid_index=ah.pop("sgid_index"),
                             hop_limit=ah.pop("hop_limit"))
        attr.ah_attr = AHAttr(gr=gr, **ah)
    return attr


def gid_text(gid: bytes) -> str:
    """The form pyverbs' GID takes and gives: eight groups of four hex digits."""
    if len(gid) != 16:
        raise ValueError(f"a GID has 16 bytes, not {len(gid)}")
    h = gid.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def imm_to_wire(imm: int) -> int:
    """ibv_send_wr.imm_data is big-endian (__be32); pyverbs passes the field through as it is."""
    return socket.htonl(imm & 0xFFFFFFFF)


def imm_from_wire(raw: int) -> int:
    return socket.ntohl(raw & 0xFFFFFFFF)


# ---- the device classes: thin, and exercised only where a device exists -------------------------
def _errors() -> tuple[type[Exception], ...]:
    from pyverbs.pyverbs_error import PyverbsError
    return (PyverbsError,)


def _device_module():
    """pyverbs.device and the names of the host's RDMA devices; NoDevice when there are none."""
    try:
        d = importlib.import_module("pyverbs.device")
    except ImportError as e:
        raise NoDevice(f"pyverbs is not installed: {e}") from None
    try:
        devices = [dev.name.decode() for dev in d.get_device_list()]
    except _errors():   # PyverbsRDMAError when the kernel has no verbs support at all
        devices = []
    if not devices:
        raise NoDevice("the kernel lists none in /sys/class/infiniband")
    return d, devices


SYSFS = "/sys/class/infiniband"
ROCE_V2 = "RoCE v2"


def default_gid_index(gids: list[tuple[int, str, str]]) -> int:
    """The GID a port's QPs should use by default, from its table of (index, GID text, type as sysfs
    names it). RoCE v2 routes over UDP/IP, and its IPv4-mapped entry (::ffff:a.b.c.d) is the one that
    reaches any peer on an IPv4 fabric (what rdma_cm picks for an IPv4 address). Index 0 is usually
    the link-local entry, and on many NICs the RoCE v1 one: the first RoCE v2 IPv4 entry, else the
    first RoCE v2 entry, else the first non-zero one (InfiniBand), else 0."""
    used = [(i, gid_bytes(g), t) for i, g, t in gids if any(gid_bytes(g))]
    for want in (lambda b, t: t == ROCE_V2 and b[:12] == bytes(10) + b"\xff\xff",
                 lambda b, t: t == ROCE_V2,
                 lambda b, t: True):
        for i, b, t in used:
            if want(b, t):
                return i
    return 0


def gid_table(name: str, port: int) -> list[tuple[int, str, str]]:
    """A port's populated GID entries (index, GID text, type) as sysfs lists them."""
    base = f"{SYSFS}/{name}/ports/{port}"
    out = []
    try:
        indexes = sorted(int(i) for i in os.listdir(f"{base}/gids"))
    except OSError:
        return out
    for i in indexes[:MAX_GIDS]:
        try:
            with open(f"{base}/gids/{i}") as f:
                gid = f.read().strip()
        except OSError:
            continue
        try:
            with open(f"{base}/gid_attrs/types/{i}") as f:
                kind = f.read().strip()
        except OSError:   # EINVAL: an unpopulated entry (or an IB port: no types)
            kind = ""
        out.append((i, gid, kind))
    return out


def open_device(name: str | None = None, port: int | None = None, gid_index: int | None = None) -> PyverbsDevice:
    """The named RDMA device (default: the first), on `port` (default: its first ACTIVE port, else 1)
    with `gid_index` (default: default_gid_index of that port's table); NoDevice where there is none."""
    c = constants()
    d, devices = _device_module()
    if name is not None and name not in devices:
        raise NoDevice(f"{name} is not one of {', '.join(devices)}")
    ctx = d.Context(name=name or devices[0])
    try:
        if port is None:
            ports = range(1, ctx.query_device().phys_port_cnt + 1)
            port = next((p for p in ports if ctx.query_port(p).state == c["IBV_PORT_ACTIVE"]), 1)
        if gid_index is None:
            gid_index = default_gid_index(gid_table(name or devices[0], port))
    except _errors() as e:
        ctx.close()
        raise NoDevice(f"{name or devices[0]}: {e}") from None
    return PyverbsDevice(ctx, c, port, gid_index)


# ---- the host's devices, for `quark tsor check` (libibverbs' values: ibv_port_state, ibv_mtu) --------
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "InfiniBand", 1: "InfiniBand", 2: "Ethernet"}   # 0 (unspecified): IB, as ibv_devinfo says
MAX_GIDS = 16   # GID table entries looked at per port (RoCE fills a few; IB tables run to 128 zeros)


@dataclass(frozen=True)
class PortReport:
    port: int
    state: str          # ACTIVE, DOWN, ...
    lid: int
    mtu: int            # the active MTU, bytes
    link_layer: str     # InfiniBand or Ethernet (RoCE)
    gids: tuple[tuple[int, str, str], ...]   # (index, GID text, type: "RoCE v2", "IB/RoCE v1", "") of the non-zero entries
    default_gid: int    # the index the transport takes unless tsor.yaml's rdma.gid_index says otherwise


@dataclass(frozen=True)
class DeviceReport:
    name: str
    kind: str           # "hardware", "software RoCE (rxe)" or "software iWARP (siw)"
    ports: tuple[PortReport, ...]


def port_report(num: int, attr, gids: list[tuple[int, str, str]]) -> PortReport:
    """A port's report from its ibv_port_attr (pyverbs' PortAttr) and GID table entries."""
    return PortReport(num, PORT_STATES.get(attr.state, f"state {attr.state}"), attr.lid,
                      128 << attr.active_mtu if 1 <= attr.active_mtu <= 5 else 0,
                      LINK_LAYERS.get(attr.link_layer, f"link layer {attr.link_layer}"),
                      tuple(g for g in gids if any(gid_bytes(g[1]))), default_gid_index(gids))


def device_kind(name: str) -> str:
    """Whether an RDMA device is an adapter or the kernel's software stand-in for one. rxe (soft-RoCE)
    and siw (soft-iWARP) have no bus device behind them and name the netdev they run over in
    `parent`; siw's node type is an RNIC (iWARP), rxe's a CA."""
    base = f"{SYSFS}/{name}"
    if os.path.exists(f"{base}/device") or not os.path.exists(f"{base}/parent"):
        return "hardware"
    try:
        with open(f"{base}/node_type") as f:
            iwarp = "RNIC" in f.read()
    except OSError:
        iwarp = False
    return "software iWARP (siw)" if iwarp else "software RoCE (rxe)"


def describe_devices() -> list[DeviceReport]:
    """Every RDMA device of the host and each of its ports; NoDevice when pyverbs is missing or the
    kernel lists no device."""
    d, devices = _device_module()
    out = []
    for name in devices:
        ctx = d.Context(name=name)
        try:
            ports = [port_report(num, ctx.query_port(num), gid_table(name, num))
                     for num in range(1, ctx.query_device().phys_port_cnt + 1)]
        finally:
            ctx.close()
        out.append(DeviceReport(name, device_kind(name), tuple(ports)))
    return out


class _MR(MemoryRegion):
    def __init__(self, pd: _PD, buf: bytearray | memoryview, access: Access) -> None:
        from pyverbs.mr import MR
        view = memoryview(buf)
        if view.readonly or not view.c_contiguous or not len(view):
            raise VerbsError(errno.EINVAL, "reg_mr: buffer must be writable, contiguous and not empty")
        self.view = view.cast("B")
        self.length = len(self.view)
        self._pin = (ctypes.c_char * self.length).from_buffer(self.view)
        self.addr = ctypes.addressof(self._pin)
        self._mr = MR(pd.pd, self.length, access_flags(pd.dev.c, access), address=self.addr)
        self.lkey, self.rkey = self._mr.lkey, self._mr.rkey

    def close(self) -> None:
        self._mr.close()
        self._pin = None
        self.view.release()


# what /proc/self/fd shows for a completion channel's fd (the kernel's uverbs event file)
EVENT_FD_LINK = "anon_inode:[infinibandevent]"
# held while a channel is made or closed: its fd is found as the one that appeared meanwhile
_event_fd_lock = threading.Lock()


def _event_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == EVENT_FD_LINK:
                out.add(int(name))
        except OSError:   # the listing's own fd, or one closed meanwhile
            continue
    return out


class _Channel(CompletionChannel):
    """rdma-core 44's pyverbs keeps the channel's fd to itself, and its get_cq_event waits in
    ibv_get_cq_event *holding the GIL*: a thread parked there stops every other thread of tsord. So
    the fd is found (the one [infinibandevent] fd that appeared while the channel was made), made
    non-blocking and handed to the caller's event loop; get_cq_event is called only once it is
    readable, and returns at once (EAGAIN ends the batch) when the events are consumed."""

    def __init__(self, dev: PyverbsDevice) -> None:
        from pyverbs.cq import CompChannel
        with _event_fd_lock:
            before = _event_fds()
            self.cc = CompChannel(dev.ctx)
            new = _event_fds() - before
        if len(new) != 1:
            self.cc.close()
            raise VerbsError(errno.EBADF, f"create_comp_channel: {len(new)} new {EVENT_FD_LINK} fds, not one")
        self.fd = new.pop()
        os.set_blocking(self.fd, False)
        self.cq: _CQ | None = None

    def watch(self, cq: _CQ) -> None:
        if self.cq is not None:
            raise VerbsError(errno.EBUSY, "create_cq: this provider gives each completion channel one CQ")
        self.cq = cq

    def fileno(self) -> int:
        return self.fd

    def get_events(self) -> int:
        if self.cq is None or self.fd < 0:
            return 0
        n = 0
        while True:
            try:
                self.cc.get_cq_event(self.cq.cq)
            except _errors():   # EAGAIN: none left (the fd is non-blocking)
                break
            n += 1
        if n:
            self.cq.cq.ack_events(n)
        return n

    def close(self) -> None:
        if self.fd < 0:
            return
        with _event_fd_lock:   # pyverbs closes the fd: no channel being made may see its number go
            self.fd = -1
            self.cc.close()


class _CQ(CompletionQueue):
    def __init__(self, dev: PyverbsDevice, depth: int, channel: _Channel | None) -> None:
        from pyverbs.cq import CQ
        self.dev = dev
        self.cq = CQ(dev.ctx, depth, None, channel.cc if channel else None, 0)
        if channel is not None:
            channel.watch(self)

    def poll(self, n: int) -> list[Wc]:
        c = self.dev.c
        _, wcs = self.cq.poll(n)
        out = []
        for wc in wcs:
            try:
                status = WcStatus(wc.status)
            except ValueError:
                status = WcStatus.GENERAL_ERR
            opcode = {c["IBV_WC_SEND"]: WcOpcode.SEND, c["IBV_WC_RDMA_WRITE"]: WcOpcode.RDMA_WRITE,
                      c["IBV_WC_RECV"]: WcOpcode.RECV,
                      c["IBV_WC_RECV_RDMA_WITH_IMM"]: WcOpcode.RECV_RDMA_WITH_IMM}.get(wc.opcode, WcOpcode.SEND)
            out.append(Wc(wc.wr_id, status, opcode, wc.byte_len, imm_from_wire(wc.imm_data), wc.qp_num))
        return out

    def req_notify(self) -> None:
        self.cq.req_notify()

    def close(self) -> None:
        self.cq.close()


class _QP(QueuePair):
    def __init__(self, pd: _PD, send_cq: _CQ, recv_cq: _CQ, max_send_wr: int, max_recv_wr: int) -> None:
        from pyverbs.qp import QP, QPCap, QPInitAttr
        self.pd, self.c = pd, pd.dev.c
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=4, max_recv_sge=4)
        # sq_sig_all=0: pyverbs' default (1) makes every write complete, where the transport asks
        # for a completion only on the writes it signals (SendWr.signaled)
        self.qp = QP(pd.pd, QPInitAttr(qp_type=self.c["IBV_QPT_RC"], scq=send_cq.cq, rcq=recv_cq.cq, cap=cap,
                                       sq_sig_all=0))
        self.qp_num = self.qp.qp_num

    @property
    def state(self) -> QpState:
        return QpState(self.qp.qp_state)

    def _modify(self, t: Transition) -> None:
        try:
            self.qp.modify(qp_attr(t), t.mask)
        except _errors() as e:
            raise VerbsError(getattr(e, "error_code", 0) or errno.EINVAL, f"modify_qp: {e}") from None

    def to_init(self, access: Access) -> None:
        self._modify(init_transition(self.c, access, self.pd.dev.port_num))

    def to_rtr(self, remote: QpInfo) -> None:
        dev = self.pd.dev
        self._modify(rtr_transition(self.c, remote, dev.port_num, dev.query_port().active_mtu, dev.gid_index))

    def to_rts(self, psn: int) -> None:
        self._modify(rts_transition(self.c, psn))

    def to_error(self) -> None:
        self._modify(error_transition(self.c))

    def post_send(self, wr: SendWr) -> None:
        from pyverbs.wr import SGE, SendWR
        opcode = {WrOpcode.RDMA_WRITE: "IBV_WR_RDMA_WRITE", WrOpcode.RDMA_WRITE_WITH_IMM: "IBV_WR_RDMA_WRITE_WITH_IMM",
                  WrOpcode.SEND: "IBV_WR_SEND"}[wr.opcode]
        sges = [SGE(s.addr, s.length, s.lkey) for s in wr.sg] or [SGE(self.pd.scratch.addr, 0, self.pd.scratch.lkey)]
        swr = SendWR(wr_id=wr.wr_id, opcode=self.c[opcode], num_sge=len(sges), sg=sges,
                     imm_data=imm_to_wire(wr.imm_data), send_flags=self.c["IBV_SEND_SIGNALED"] if wr.signaled else 0)
        if wr.opcode != WrOpcode.SEND:
            swr.set_wr_rdma(wr.rkey, wr.remote_addr)
        try:
            self.qp.post_send(swr)
        except _errors() as e:
            raise VerbsError(getattr(e, "error_code", 0) or errno.ENOMEM, f"post_send: {e}") from None

    def post_recv(self, wr: RecvWr) -> None:
        from pyverbs.wr import SGE, RecvWR
        # pyverbs wants at least one SGE; a write with immediate never touches it
        sges = [SGE(s.addr, s.length, s.lkey) for s in wr.sg] or [SGE(self.pd.scratch.addr, 0, self.pd.scratch.lkey)]
        try:
            self.qp.post_recv(RecvWR(wr_id=wr.wr_id, num_sge=len(sges), sg=sges))
        except _errors() as e:
            raise VerbsError(getattr(e, "error_code", 0) or errno.ENOMEM, f"post_recv: {e}") from None

    def close(self) -> None:
        self.qp.close()


class _PD(ProtectionDomain):
    def __init__(self, dev: PyverbsDevice) -> None:
        from pyverbs.pd import PD
        self.dev = dev
        self.pd = PD(dev.ctx)
        self.scratch = _MR(self, bytearray(64), Access.LOCAL_WRITE)

    def reg_mr(self, buf: bytearray | memoryview, access: Access) -> MemoryRegion:
        return _MR(self, buf, access)

    def create_qp(self, send_cq: CompletionQueue, recv_cq: CompletionQueue, max_send_wr: int,
                  max_recv_wr: int) -> QueuePair:
        return _QP(self, send_cq, recv_cq, max_send_wr, max_recv_wr)

    def close(self) -> None:
        self.scratch.close()
        self.pd.close()


class PyverbsDevice(Device):
    provider = "pyverbs"

    def __init__(self, ctx, c: dict[str, int], port: int, gid_index: int) -> None:
        self.ctx, self.c, self.port_num, self.gid_index = ctx, c, port, gid_index
        self.name = ctx.name if isinstance(ctx.name, str) else ctx.name.decode()

    def query_port(self):
        return self.ctx.query_port(self.port_num)

    def port(self) -> PortInfo:
        attr = self.query_port()
        gid = gid_bytes(self.ctx.query_gid(self.port_num, self.gid_index).gid)
        return PortInfo(active=attr.state == self.c["IBV_PORT_ACTIVE"], lid=attr.lid, gid=gid,
                        mtu=128 << attr.active_mtu, max_msg_size=attr.max_msg_sz)

    def alloc_pd(self) -> ProtectionDomain:
        return _PD(self)

    def create_comp_channel(self) -> CompletionChannel:
        return _Channel(self)

    def create_cq(self, depth: int, channel: CompletionChannel | None) -> CompletionQueue:
        return _CQ(self, depth, channel)

    def close(self) -> None:
        self.ctx.close()
