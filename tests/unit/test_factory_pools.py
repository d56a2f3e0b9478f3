"""The seeds' zygote fills pymalloc's free blocks before it forks (qvisor/factory/seeds.py
_fill_free_blocks): what a supervisor allocates then lands side by side in fresh pools, not one
object per page it shares with the zygote (each such page is a private 4 KiB copy for life)."""
from __future__ import annotations

import json
import subprocess
import sys

# A heap as a long-running process leaves it: full pools with one free block here and there.
_PROBE = """
import json, sys
from qvisor.factory import seeds
keep = [bytes(31) for _ in range(40000)]          # 64-byte blocks, 256 to a 16 KiB pool
for i in range(0, len(keep), 200):
    keep[i] = None                                # one free block every 200: ~one per pool
if sys.argv[1] == "fill":
    seeds.fill_free_blocks()
new = [bytes(31) for _ in range(150)]             # what a supervisor allocates after the fork
print(json.dumps(len({id(b) // 4096 for b in new})))
"""


def _pages_touched(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_objects_allocated_after_the_fill_lie_side_by_side():
    assert _pages_touched("fill") <= 6            # 150 x 64 B: three pages of a fresh pool, and its edges


def test_without_the_fill_they_land_one_per_shared_page():
    assert _pages_touched("none") >= 100          # what the fill is for: the probe sees the difference


def test_free_blocks_are_read_per_block_size():
    sizes = subprocess.run([sys.executable, "-c", "import json; from qvisor.factory import seeds; "
                            "print(json.dumps(seeds.free_blocks()))"],
                           check=True, capture_output=True, text=True)
    free = json.loads(sizes.stdout)
    assert {"32", "64", "512"} <= set(free) and all(v >= 0 for v in free.values())
