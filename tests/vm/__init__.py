"""The cgroup v2 lane: a qemu guest on Debian 12's 6.1 kernel (see lane.py, tests/vm/README.md)."""
