"""The memory side of hibernation: page a frozen container's processes out, record the pages a
woken container touches (its working set), and bring that set back in one batch before the next
wake. Plain Python over /proc and qlib.linux.process_madvise; the supervisor drives it
(qvisor/supervisor/snapshot.py).

Why per process and not only the cgroup's reclaim: process_madvise(MADV_PAGEOUT) pages out exactly
the pages of the container's processes (anonymous ones to swap, clean file pages they alone map
dropped), on cgroup v1 and v2 alike. The cgroup's own reclaim (v2 memory.reclaim, v1
memory.force_empty) then takes what no process maps: the container's clean page cache.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

from qlib import linux as L

PAGE = os.sysconf("SC_PAGE_SIZE")
# the kernel's own pages in every process: madvise refuses them (VM_PFNMAP / special mappings)
_SPECIAL = ("[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]", "[uprobes]")
_PRESENT_RUN = re.compile(rb"[\x80-\xff]+")   # runs of pagemap entries whose bit 63 (present) is set

Ranges = list[tuple[int, int]]   # (address, length)


@dataclass
class Vma:
    start: int
    end: int
    perms: str
    name: str
    resident_or_swapped: bool = True   # from smaps: a VMA with neither holds nothing to look at


def vmas(pid: int) -> list[Vma]:
    """The mappings of `pid`, with whether each holds any page (resident or in swap)."""
    out: list[Vma] = []
    cur: Vma | None = None
    with open(f"/proc/{pid}/smaps", "rb") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if not head.endswith(b":"):
                parts = line.split(None, 5)
                lo, hi = parts[0].split(b"-")
                name = parts[5].strip().decode(errors="replace") if len(parts) > 5 else ""
                cur = Vma(int(lo, 16), int(hi, 16), parts[1].decode(), name, False)
                out.append(cur)
            elif head in (b"Rss:", b"Swap:") and cur is not None and int(line.split()[1]) > 0:
                cur.resident_or_swapped = True
    return out


def _advise(pidfd: int, ranges: Ranges, advice: int) -> int:
    """Advise every range, skipping those the kernel refuses (a mapping that went away, a locked
    or special one); returns the bytes advised."""
    done = 0
    for i in range(0, len(ranges), L.IOV_MAX):
        batch = ranges[i:i + L.IOV_MAX]
        try:
            n = L.process_madvise(pidfd, batch, advice)
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.EPERM):
                raise
            n = 0
        if n == sum(length for _, length in batch):
            done += n
            continue
        # short: one range was refused; advise the rest one by one (rare: a handful of ranges)
        for addr, length in batch:
            try:
                done += L.process_madvise(pidfd, [(addr, length)], advice)
            except OSError as e:
                if e.errno == errno.ESRCH:
                    raise
    return done


def _pidfd(pid: int) -> int | None:
    try:
        return L.pidfd_open(pid)
    except OSError as e:
        if e.errno == errno.ESRCH:
            return None
        raise


def page_out(pids: list[int]) -> int:
    """MADV_PAGEOUT over every mapping of each process (which should be frozen); returns the bytes
    advised. Pages go to swap (anonymous) or are dropped (clean file pages only they map); without
    swap, anonymous pages stay."""
    total = 0
    for pid in pids:
        fd = _pidfd(pid)
        if fd is None:
            continue
        try:
            ranges = [(v.start, v.end - v.start) for v in vmas(pid)
                      if v.resident_or_swapped and v.name not in _SPECIAL]
            total += _advise(fd, ranges, L.MADV_PAGEOUT)
        except (FileNotFoundError, ProcessLookupError):
            pass   # it exited meanwhile
        finally:
            os.close(fd)
    return total


def resident_ranges(pid: int) -> Ranges:
    """The pages of `pid`'s writable private mappings that are in memory now (pagemap's present
    bit), as coalesced ranges. Read after a wake, at the next hibernation, it is what the
    container touched while it served: its working set."""
    found: Ranges = []
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for v in vmas(pid):
            if not v.resident_or_swapped or v.name in _SPECIAL or v.perms[1] != "w" or v.perms[3] != "p":
                continue
            pm.seek(v.start // PAGE * 8)
            data = pm.read((v.end - v.start) // PAGE * 8)
            high = data[7::8]   # the top byte of each little-endian entry: bit 63 is "present"
            for m in _PRESENT_RUN.finditer(high):
                found.append((v.start + m.start() * PAGE, (m.end() - m.start()) * PAGE))
    return found


def working_set(pids: list[int]) -> dict[int, Ranges]:
    ws: dict[int, Ranges] = {}
    for pid in pids:
        try:
            ws[pid] = resident_ranges(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return ws


def prefetch(ws: dict[int, Ranges]) -> int:
    """Start reading each process's recorded working set back from swap in one batch
    (MADV_WILLNEED: swap-in read-ahead into the swap cache; the first touch of a page then costs a
    minor fault, not a read). Returns the bytes advised."""
    total = 0
    for pid, ranges in ws.items():
        fd = _pidfd(pid)
        if fd is None:
            continue
        try:
            total += _advise(fd, ranges, L.MADV_WILLNEED)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return total


def pages(ws: dict[int, Ranges]) -> int:
    return sum(length for ranges in ws.values() for _, length in ranges) // PAGE


def swap_bytes() -> tuple[int, int]:
    """(total, free) swap of the host, in bytes."""
    total = free = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("SwapTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith("SwapFree:"):
                free = int(line.split()[1]) * 1024
    return total, free
