"""The /proc view's files made from given host texts and cgroup figures (qvisor/procview.py), and the
FUSE server's wire protocol (qvisor/fuse.py) driven over a SOCK_SEQPACKET pair, which keeps the
record boundaries /dev/fuse has (one read, one request; one write, one reply)."""
from __future__ import annotations

import errno
import os
import socket
import struct

import pytest

from qvisor import fuse, procview

MiB = 1 << 20

HOST_MEMINFO = """\
MemTotal:       24683852 kB
MemFree:        23851340 kB
MemAvailable:   24312452 kB
Buffers:           54188 kB
Cached:           620004 kB
SwapCached:            0 kB
Active:           317568 kB
Inactive:         402396 kB
Active(anon):      72228 kB
Inactive(anon):        0 kB
Active(file):     245340 kB
Inactive(file):   402396 kB
Unevictable:           0 kB
Mlocked:               0 kB
SwapTotal:       1048572 kB
SwapFree:        1048572 kB
Dirty:                48 kB
Writeback:             0 kB
AnonPages:         45876 kB
Mapped:            93652 kB
Shmem:              9596 kB
KReclaimable:      58732 kB
Slab:             110100 kB
SReclaimable:      58732 kB
SUnreclaim:        51368 kB
KernelStack:        3568 kB
PageTables:         1424 kB
CommitLimit:    13390496 kB
Committed_AS:     331748 kB
VmallocTotal:   34359738367 kB
AnonHugePages:         0 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
DirectMap4k:      176128 kB
DirectMap2M:    25014272 kB
"""

# a v1 memory.stat (use_hierarchy: the total_ keys), bytes
V1_STAT = {"cache": 30 * MiB, "rss": 50 * MiB, "shmem": 2 * MiB, "mapped_file": 4 * MiB, "total_cache": 40 * MiB,
           "total_rss": 55 * MiB, "total_shmem": 3 * MiB, "total_mapped_file": 5 * MiB, "total_dirty": MiB,
           "total_active_anon": 20 * MiB, "total_inactive_anon": 35 * MiB, "total_active_file": 10 * MiB,
           "total_inactive_file": 30 * MiB, "hierarchical_memory_limit": 1 << 63}
V2_STAT = {"anon": 50 * MiB, "file": 30 * MiB, "shmem": MiB, "slab_reclaimable": 6 * MiB,
           "slab_unreclaimable": 2 * MiB, "kernel_stack": MiB, "file_mapped": 3 * MiB}


def meminfo(limit, usage, stat, swap_limit=None, swap_usage=None):
    return procview.memory(procview.parse_meminfo(HOST_MEMINFO), limit, usage, stat, swap_limit, swap_usage)


def free_used(kb):
    """busybox free's "used": sysinfo's totalram - freeram - bufferram - meminfo's Cached - SReclaimable."""
    return kb["MemTotal"] - kb["MemFree"] - kb["Buffers"] - kb["Cached"] - kb["SReclaimable"]


# ---- memory --------------------------------------------------------------------------------------

def test_meminfo_is_the_cgroups_limit_and_usage():
    kb = meminfo(256 * MiB, 100 * MiB, V1_STAT)
    assert kb["MemTotal"] == 262144
    assert kb["MemFree"] == 262144 - 102400
    assert kb["Cached"] == 40960 and kb["Buffers"] == 0 and kb["Shmem"] == 3072 and kb["Mapped"] == 5120
    assert kb["MemAvailable"] == kb["MemFree"] + kb["Cached"]
    assert kb["Active(anon)"] == 20480 and kb["Inactive(file)"] == 30720 and kb["Dirty"] == 1024
    assert free_used(kb) == 102400 - 40960   # the cgroup's usage less its page cache
    assert all(v <= kb["MemTotal"] for k, v in kb.items() if k not in ("SwapTotal", "SwapFree", "Hugepagesize"))


def test_meminfo_from_v2_stat_keys():
    kb = meminfo(512 * MiB, 100 * MiB, V2_STAT)
    assert (kb["MemTotal"], kb["Cached"], kb["SReclaimable"], kb["SUnreclaim"]) == (524288, 30720, 6144, 2048)
    assert kb["Slab"] == 8192 and kb["AnonPages"] == 51200 and kb["KernelStack"] == 1024
    assert kb["MemAvailable"] == kb["MemFree"] + 30720 + 6144
    assert free_used(kb) == 102400 - 30720 - 6144


@pytest.mark.parametrize("limit, usage, stat", [
    (256 * MiB, 300 * MiB, V1_STAT),                   # usage above the limit (v2 can overshoot)
    (64 * MiB, 60 * MiB, {"total_cache": 500 * MiB}),   # page cache reported above the usage
    (64 * MiB, 10 * MiB, {"file": 9 * MiB, "slab_reclaimable": 9 * MiB}),
    (None, 0, {}),                                      # no memory controller
])
def test_free_never_sees_negative_used(limit, usage, stat):
    kb = meminfo(limit, usage, stat)
    assert 0 <= kb["MemFree"] <= kb["MemTotal"]
    assert free_used(kb) >= 0
    assert kb["MemAvailable"] <= kb["MemTotal"]


def test_no_limit_is_the_hosts_ram_and_the_cgroups_usage():
    kb = meminfo(None, 100 * MiB, {})
    assert kb["MemTotal"] == 24683852 and kb["MemFree"] == 24683852 - 102400
    assert kb["Cached"] == 0   # the host's page cache is not the container's


def test_hierarchical_limit_of_a_parent_counts():
    kb = meminfo(None, 10 * MiB, {"hierarchical_memory_limit": 128 * MiB})
    assert kb["MemTotal"] == 131072


def test_a_limit_above_the_host_is_the_hosts_ram():
    assert meminfo(1 << 40, 0, {})["MemTotal"] == 24683852


def test_other_lines_never_exceed_memtotal():
    kb = meminfo(256 * MiB, 0, {})
    assert kb["CommitLimit"] == kb["VmallocTotal"] == kb["DirectMap2M"] == 262144
    assert kb["Hugepagesize"] == 2048


def test_render_keeps_the_hosts_layout():
    kb = meminfo(256 * MiB, 100 * MiB, V1_STAT)
    text = procview.render_meminfo(HOST_MEMINFO, kb)
    host_lines, lines = HOST_MEMINFO.splitlines(), text.splitlines()
    assert len(lines) == len(host_lines)
    assert lines[0] == "MemTotal:         262144 kB"
    assert [len(a) for a in lines[:28]] == [len(a) for a in host_lines[:28]]
    assert "HugePages_Total:       0" in lines
    assert procview.parse_meminfo(text)["MemFree"] == kb["MemFree"]


def test_swap_from_the_cgroup_within_the_hosts():
    kb = meminfo(256 * MiB, 0, {}, swap_limit=64 * MiB, swap_usage=16 * MiB)
    assert (kb["SwapTotal"], kb["SwapFree"]) == (65536, 49152)
    kb = meminfo(256 * MiB, 0, {}, swap_limit=None, swap_usage=0)   # unlimited: the host's swap
    assert (kb["SwapTotal"], kb["SwapFree"]) == (1048572, 1048572)
    kb = meminfo(256 * MiB, 0, {}, swap_limit=8 << 30, swap_usage=0)   # more than the host has
    assert kb["SwapTotal"] == 1048572
    kb = meminfo(256 * MiB, 0, {}, swap_limit=0, swap_usage=0)   # memory+swap == memory: none
    assert (kb["SwapTotal"], kb["SwapFree"]) == (0, 0)


def test_unaccounted_swap_is_the_hosts():
    kb = meminfo(256 * MiB, 0, {}, swap_limit=None, swap_usage=None)
    assert (kb["SwapTotal"], kb["SwapFree"]) == (1048572, 1048572)


def test_swaps_agrees_with_meminfo():
    header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"
    host = header + "\n/swapfile                               file\t\t1048572\t\t0\t\t-2\n"
    kb = meminfo(256 * MiB, 0, {}, swap_limit=64 * MiB, swap_usage=16 * MiB)
    lines = procview.render_swaps(host, kb).splitlines()
    assert lines[0] == header and len(lines) == 2
    name, kind, size, used, prio = lines[1].split()
    assert (name, kind, int(size), int(used), prio) == ("none", "virtual", 65536, 16384, "0")
    assert procview.render_swaps(host, meminfo(256 * MiB, 0, {}, swap_limit=0, swap_usage=0)) == header + "\n"


# ---- CPUs --------------------------------------------------------------------------------------

HOST_STAT = """\
cpu  400 10 200 9000 40 0 4 0 0 0
cpu0 100 1 50 2000 10 0 1 0 0 0
cpu1 110 2 60 2500 11 0 1 0 0 0
cpu2 90 3 40 2200 9 0 1 0 0 0
cpu3 100 4 50 2300 10 0 1 0 0 0
intr 12345 0 0
ctxt 999
btime 1700000000
processes 4242
procs_running 3
procs_blocked 0
softirq 100 0 0
"""


def cpuinfo_block(n: int) -> str:
    return f"processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Test CPU\napicid\t\t: {2 * n}\n"


HOST_CPUINFO = "\n".join(cpuinfo_block(n) for n in range(4)) + "\n"


@pytest.mark.parametrize("cpuset, quota, expect", [
    (None, None, [0, 1, 2, 3]),
    ([2, 3], None, [2, 3]),
    ([1, 2, 3], (150000, 100000), [1, 2]),   # 1.5 CPUs: shown as 2, as LXCFS rounds up
    (None, (50000, 100000), [0]),            # half a CPU is still one
    (None, (800000, 100000), [0, 1, 2, 3]),  # a quota above the cpuset changes nothing
    ([3, 7], None, [3]),                     # a cpuset CPU that is offline is not shown
    ([7], None, [0, 1, 2, 3]),               # never none
])
def test_visible_cpus(cpuset, quota, expect):
    assert procview.visible_cpus(procview.stat_cpus(HOST_STAT), cpuset, quota) == expect


def test_stat_shows_the_chosen_cpus_renumbered_and_their_total():
    lines = procview.render_stat(HOST_STAT, [1, 3]).splitlines()
    assert lines[0].split() == ["cpu", "210", "6", "110", "4800", "21", "0", "2", "0", "0", "0"]
    assert lines[1] == "cpu0 110 2 60 2500 11 0 1 0 0 0"
    assert lines[2] == "cpu1 100 4 50 2300 10 0 1 0 0 0"
    assert lines[3:] == HOST_STAT.splitlines()[5:]
    assert procview.stat_cpus("\n".join(lines)) == [0, 1]   # what glibc's fallback would count


def test_cpuinfo_shows_the_chosen_blocks_renumbered():
    text = procview.render_cpuinfo(HOST_CPUINFO, [1, 3])
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert len(blocks) == 2
    assert blocks[0].splitlines()[0] == "processor\t: 0" and "apicid\t\t: 2" in blocks[0]
    assert blocks[1].splitlines()[0] == "processor\t: 1" and "apicid\t\t: 6" in blocks[1]
    assert text.endswith("\n")


def test_cpuinfo_of_an_unknown_layout_is_left_alone():
    s390 = "vendor_id       : IBM/S390\n# processors    : 4\nprocessor 0: version = FF\nprocessor 1: version = FF\n"
    assert procview.render_cpuinfo(s390, [0]) == s390


def test_cpu_online():
    assert procview.render_cpu_online(1) == "0\n"
    assert procview.render_cpu_online(3) == "0-2\n"


# ---- uptime and load -----------------------------------------------------------------------------

def test_uptime_counts_from_the_containers_start():
    up, idle = procview.uptime(1000.5, 990.0, 2, 3.0)
    assert (up, idle) == (10.5, 18.0)
    assert procview.render_uptime(up, idle) == "10.50 18.00\n"
    assert procview.uptime(5.0, 10.0, 1, None) == (0.0, 0.0)   # never negative
    assert procview.uptime(100.0, 0.0, 1, 500.0)[1] == 0.0


def test_load_average_follows_the_kernels_ewma():
    load = procview.LoadAvg()
    for _ in range(12):   # one minute of one runnable task
        load.sample(1)
    one, five, fifteen = (a / procview.FIXED_1 for a in load.avenrun)
    assert 0.6 < one < 0.66 and 0.15 < five < 0.2 and 0.05 < fifteen < 0.08   # 1 - exp(-t/T)
    for _ in range(2000):
        load.sample(2)
    assert procview.render_loadavg(load.avenrun, 1, 5, 42) == "2.00 2.00 2.00 1/5 42\n"
    for _ in range(2000):
        load.sample(0)
    assert procview.render_loadavg(load.avenrun, 0, 1, 1) == "0.00 0.00 0.00 0/1 1\n"


def test_calc_load_matches_the_kernel_step():
    # kernel/sched/loadavg.c: calc_load(0, EXP_1, 1 * FIXED_1) == 164 ((2048 - 1884) * 2048 + 2047) / 2048
    assert procview.calc_load(0, 1884, procview.FIXED_1) == 164
    assert procview.calc_load(2048, 1884, 0) == 1884


# ---- the FUSE wire protocol ------------------------------------------------------------------------

class Wire:
    """The kernel's end of a FUSE connection, as a SOCK_SEQPACKET peer of the server's fd."""

    def __init__(self, files):
        self.kernel, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server_sock = server
        server.setblocking(False)
        self.server = fuse.Server(server.fileno(), files)
        self.unique = 0

    def request(self, opcode, node=1, body=b"", reply=True):
        self.unique += 1
        self.kernel.send(struct.pack("=IIQQIIIHH", 40 + len(body), opcode, self.unique, node, 0, 0, 1, 0, 0) + body)
        assert self.server.on_readable()
        if not reply:
            self.kernel.setblocking(False)
            with pytest.raises(BlockingIOError):
                self.kernel.recv(65536)
            self.kernel.setblocking(True)
            return None
        data = self.kernel.recv(1 << 20)
        length, error, unique = struct.unpack_from("=IiQ", data)
        assert (length, unique) == (len(data), self.unique)
        return -error if error else data[16:]

    def close(self):
        self.kernel.close()
        self.server_sock.close()


@pytest.fixture
def wire():
    calls = {"n": 0}

    def counter():
        calls["n"] += 1
        return f"call {calls['n']}\n".encode()
    w = Wire({"meminfo": lambda: b"MemTotal: 1 kB\n" * 1000, "count": counter})
    w.calls = calls
    yield w
    w.close()


def init(w, minor=45):
    out = w.request(fuse.INIT, body=struct.pack("=IIII", 7, minor, 131072, 0) + b"\0" * 48)
    return struct.unpack_from("=IIII", out), len(out)


def test_init_negotiates_the_lower_minor(wire):
    (major, minor, readahead, flags), size = init(wire)
    assert (major, minor, readahead, flags, size) == (7, fuse.MINOR, 131072, 0, 64)
    (major, minor, _, _), size = init(wire, 22)   # an old kernel: the reply it knows, 24 bytes
    assert (major, minor, size) == (7, 22, 24)
    assert wire.request(fuse.INIT, body=struct.pack("=IIII", 6, 40, 0, 0)) == errno.EPROTO


def test_lookup_getattr_and_unknown_names(wire):
    init(wire)
    out = wire.request(fuse.LOOKUP, 1, b"meminfo\0")
    node, _, entry_valid, attr_valid = struct.unpack_from("=QQQQ", out)
    assert (node, entry_valid, attr_valid) == (2, fuse.TTL, 0)
    assert len(out) == 40 + 88
    assert wire.request(fuse.LOOKUP, 1, b"nope\0") == errno.ENOENT
    attr = wire.request(fuse.GETATTR, 2, b"\0" * 16)
    assert len(attr) == 16 + 88
    ino, size = struct.unpack_from("=QQ", attr, 16)
    mode = struct.unpack_from("=I", attr, 16 + 60)[0]
    assert (ino, size, mode) == (2, 15000, 0o100444)   # the size of the text (see test_read below)
    root = wire.request(fuse.GETATTR, 1, b"\0" * 16)
    assert struct.unpack_from("=I", root, 16 + 60)[0] == 0o40555
    assert wire.request(fuse.GETATTR, 99, b"\0" * 16) == errno.ENOENT


def open_fh(w, node, flags=os.O_RDONLY):
    out = w.request(fuse.OPEN, node, struct.pack("=II", flags, 0))
    if isinstance(out, int):
        return out
    fh, open_flags, _ = struct.unpack("=QIi", out)
    assert open_flags == fuse.FOPEN_DIRECT_IO
    return fh


def read(w, fh, offset, size):
    return w.request(fuse.READ, 2, struct.pack("=QQIIQII", fh, offset, size, 0, 0, 0, 0))


def test_read_pages_through_one_text_and_afresh_from_offset_0(wire):
    init(wire)
    fh = open_fh(wire, 3)
    first = read(wire, fh, 0, 4096)
    assert first == b"call 1\n"
    assert read(wire, fh, 3, 4096) == b"l 1\n"          # the same text: no new call
    assert read(wire, fh, 0, 4096) == b"call 2\n"       # read again from the start: new figures
    other = open_fh(wire, 3)
    assert other != fh and read(wire, other, 0, 4096) == b"call 3\n"
    assert wire.request(fuse.RELEASE, 3, struct.pack("=QIIQ", fh, 0, 0, 0)) == b""
    assert read(wire, fh, 0, 10) == errno.EBADF


def test_open_after_getattr_serves_the_text_whose_size_was_told(wire):
    init(wire)
    attr = wire.request(fuse.GETATTR, 3, b"\0" * 16)
    assert struct.unpack_from("=Q", attr, 24)[0] == len(b"call 1\n")
    fh = open_fh(wire, 3)
    assert read(wire, fh, 0, 4096) == b"call 1\n"       # not a second call: it matches the size
    assert read(wire, fh, 0, 4096) == b"call 2\n"


def test_large_file_in_pieces(wire):
    init(wire)
    fh = open_fh(wire, 2)
    got = b"".join(read(wire, fh, off, 4096) for off in range(0, 16384, 4096))
    assert got == b"MemTotal: 1 kB\n" * 1000


def test_writers_and_directories_are_refused(wire):
    init(wire)
    assert open_fh(wire, 2, os.O_WRONLY) == errno.EACCES
    assert open_fh(wire, 2, os.O_RDONLY | os.O_TRUNC) == errno.EACCES
    assert open_fh(wire, 1) == errno.EISDIR


def test_readdir_lists_the_files(wire):
    init(wire)
    assert struct.unpack("=QIi", wire.request(fuse.OPENDIR, 1, b"\0" * 8))[0] == 0
    out = wire.request(fuse.READDIR, 1, struct.pack("=QQIIQII", 0, 0, 4096, 0, 0, 0, 0))
    names, pos = [], 0
    while pos < len(out):
        ino, off, namelen, kind = struct.unpack_from("=QQII", out, pos)
        assert off == len(names) + 1 and kind in (4, 8) and ino in (1, 2, 3)   # d_type: DT_DIR, DT_REG
        names.append(out[pos + 24:pos + 24 + namelen].decode())
        pos += (24 + namelen + 7) // 8 * 8
    assert names == [".", "..", "meminfo", "count"]
    rest = wire.request(fuse.READDIR, 1, struct.pack("=QQIIQII", 0, 3, 4096, 0, 0, 0, 0))
    assert b"count" in rest and b"meminfo" not in rest
    assert wire.request(fuse.RELEASEDIR, 1, b"\0" * 24) == b""


def test_no_reply_to_forget_and_interrupt_enosys_for_the_rest(wire):
    init(wire)
    wire.request(fuse.FORGET, 2, struct.pack("=Q", 1), reply=False)
    wire.request(fuse.BATCH_FORGET, 0, struct.pack("=IIQQ", 1, 0, 2, 1), reply=False)
    wire.request(fuse.INTERRUPT, 0, struct.pack("=Q", 1), reply=False)
    for opcode in (fuse.FLUSH, fuse.GETXATTR, fuse.LISTXATTR, 4, 9, 16, 35, 52):   # and SETATTR, MKDIR, ...
        assert wire.request(opcode, 2, b"\0" * 64) == errno.ENOSYS
    assert len(wire.request(fuse.STATFS, 1)) == 80


def test_server_stops_when_the_connection_is_gone(wire):
    init(wire)
    wire.kernel.close()
    assert not wire.server.on_readable()
