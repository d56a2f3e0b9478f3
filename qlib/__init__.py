"""The base every quark package shares (errors, event loop, /proc parsers, cgroup probe, syscall
numbers). It imports none of qvisor, qkernel, tsor, shim or cni: they all import it."""
