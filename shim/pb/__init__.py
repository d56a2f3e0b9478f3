"""Protobuf messages of containerd's shim API, ttrpc and cgroup metrics (generated; see generate.py)."""
