"""The base every quark package shares: errors (errors.py), the supervisor's event loop
(eventloop.py), the Linux calls Python's os module lacks (linux.py) and their syscall numbers
(syscalls.py), bpf(2) (bpf.py), compiled BPF objects loaded through libbpf (libbpf.py), /proc parsers
(procfs.py), the cgroup version probe (cgroupfs.py) and scheduling attributes (sched.py). It imports
none of qvisor, qkernel, tsor, shim or cni; qvisor, qkernel, tsor and shim import it (cni only
through tsor)."""
