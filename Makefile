# quark — set-up, demo, tests, benchmarks. Every target installs what it needs (idempotent).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# System packages the runtime and its tests use. Debian's python3-seccomp (libseccomp bindings)
# and python3-pyverbs import into the venv because it is made with --system-site-packages.
APT_PACKAGES := runc containerd containernetworking-plugins busybox-static iperf3 \
	redis-server redis-tools python3-venv python3-dev python3-seccomp python3-pyverbs \
	iproute2 gcc libc6-dev procps util-linux wrk libibverbs-dev clang libbpf-dev libbpf1 \
	patchelf mmdebstrap

.PHONY: install apt kubectl container-clients payload image node-root venv links bytecode fastpath rdma-pump bpf frontend trampoline demo test test-unit test-rdma test-rdma-pair test-cgroup2 vm-deps bench proto clean
install: apt kubectl container-clients venv links fastpath rdma-pump bpf

apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:" $$missing; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

# docker and podman for their lanes (tests/integration/test_docker.py, test_podman.py): Debian's
# docker.io and podman, installed with service starts denied (a policy-rc.d, made only for the
# install when the machine has none), so no host dockerd starts and the host's firewall stays as it
# is; the tests start a private dockerd with --iptables=false (tests/support/managers.py)
CONTAINER_CLIENTS := docker.io podman
container-clients:
	@missing=$$(for p in $(CONTAINER_CLIENTS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:" $$missing; \
		made=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
			chmod 755 /usr/sbin/policy-rc.d; made=1; fi; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
		rc=$$?; if [ -n "$$made" ]; then rm -f /usr/sbin/policy-rc.d; fi; exit $$rc; \
	fi

# kubectl, for tests/unit/test_deploy.py's `kubectl kustomize deploy/`: Debian's kubernetes-client,
# unless the machine has a kubectl already (another package's /usr/bin/kubectl would conflict)
kubectl:
	@command -v kubectl >/dev/null || $(MAKE) --no-print-directory apt APT_PACKAGES=kubernetes-client

venv: $(VENV)/.installed

# Fresh nodes' roots for tests/integration/test_node_install.py: Debian 12 and 13 with containerd,
# runc, the CNI plugins and iproute2, no Python (mmdebstrap from Debian's archive; tarballs under
# /var/cache/quark-node, made once: tests/support/fresh_node.py)
node-root: apt venv
	@$(PY) -m tests.support.fresh_node --build >/dev/null
	@$(PY) -c 'from deploy import image; image.base_tarball()'

# The node image of deploy/daemonset.yaml (deploy/image.py): Debian 12 minbase (mmdebstrap, made
# once) and the payload at /opt/quark, as an OCI archive build/quark-node-VERSION.oci.tar that
# `ctr images import`, `podman load`, `docker load` and `skopeo copy oci-archive:...` read. The same
# tree gives the same archive; IMAGE_VERSION=V stamps another version (the tag)
IMAGE_VERSION := $(shell sed -n 's/^VERSION = "\(.*\)"$$/\1/p' qlib/version.py)
image: apt venv fastpath bpf
	$(PY) deploy/payload.py --version $(IMAGE_VERSION) build/image-payload
	$(PY) -m deploy.image --payload build/image-payload --version $(IMAGE_VERSION)

# The node payload deploy/install.py copies to /opt/quark (deploy/payload.py): quark with its own
# Python and libraries, for nodes with no Python and no package manager run on them; PAYLOAD=DIR
# builds it elsewhere (the image builds it at /opt/quark itself)
PAYLOAD := build/payload
payload: venv fastpath bpf
	$(PY) deploy/payload.py $(PAYLOAD)

# QKernel's compiled fast path (qkernel/fastpath.c, loaded with ctypes): without it every trapped
# call goes through Python (same answers, slower); a stale one is not loaded
fastpath: qkernel/_fastpath.so
qkernel/_fastpath.so: qkernel/fastpath.c
	gcc -O2 -Wall -Wextra -shared -fPIC -o $@ $< -lpthread

# TSoR's compiled rdma pump (tsor/transport/rdma_pump.c, loaded with ctypes; libibverbs from rdma-core):
# rdma links' bytes never cross Python; without it (or stale) they go through transport/rdma.py's pump
rdma-pump: tsor/transport/_rdma_pump.so
tsor/transport/_rdma_pump.so: tsor/transport/rdma_pump.c
	gcc -O2 -Wall -Wextra -shared -fPIC -o $@ $< -libverbs -lpthread

# TSoR's BPF programs in C (tsor/bpf/*.bpf.c: the sockmap local path, the socket-option offload),
# compiled for the kernel's BPF target against its UAPI headers (asm/ is under the multiarch include
# directory) and libbpf's (libbpf-dev); tsor/sockmap.py and tsor/sockopt_offload.py load them with
# libbpf (qlib/libbpf.py) and refuse a stale one
BPF_OBJECTS := $(patsubst %.c,%.o,$(wildcard tsor/bpf/*.bpf.c))
bpf: $(BPF_OBJECTS)
tsor/bpf/%.bpf.o: tsor/bpf/%.bpf.c
	clang -O2 -g -Wall -Wextra -target bpf -I/usr/include/$$(gcc -print-multiarch) -c $< -o $@

# The `quark` and `containerd-shim-quark-v1` on PATH (qvisor/frontend.c, one program; build/bin has
# both names): hands the hot verbs and the shim's start to the sandbox factory, and execs the
# Python console scripts beside it for everything else
frontend: qvisor/_quark build/bin/quark build/bin/containerd-shim-quark-v1
qvisor/_quark: qvisor/frontend.c Makefile
	gcc -O2 -Wall -Wextra -DQUARK_PY='"$(CURDIR)/$(VENV)/bin/quark"' \
		-DQUARK_SHIM_PY='"$(CURDIR)/$(VENV)/bin/containerd-shim-quark-v1"' -o $@ $<
build/bin/quark build/bin/containerd-shim-quark-v1: qvisor/_quark
	@mkdir -p build/bin
	ln -sfn ../../qvisor/_quark $@

# editable_mode=compat: a plain path entry in a .pth file; the default import-hook finder costs
# milliseconds at every start of the Python `quark` (bench/README.md, "Start-up and supervisor memory").
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,k8s]' --config-settings editable_mode=compat
	touch $@

# runc-style use and containerd both look the binaries up on PATH: point them at this checkout
links: venv bytecode frontend
	@for b in quark containerd-shim-quark-v1; do ln -sfn $(CURDIR)/build/bin/$$b /usr/local/bin/$$b; done
	@ln -sfn $(CURDIR)/$(VENV)/bin/tsord /usr/local/bin/tsord

# Byte-compile ahead: with PYTHONDONTWRITEBYTECODE set (common in CI images) every `quark` and
# shim start would otherwise recompile its modules (~5 ms each time). Only stale files are redone.
bytecode: venv
	@$(PY) -m compileall -q qvisor qkernel tsor shim cni >/dev/null

demo: install
	$(PY) -m tests.demo.qvisor_demo
	$(PY) -m tests.demo.tsor_demo

# the host's suite, then the cgroup v2 lane (a qemu guest, about 4 minutes; see test-cgroup2), then
# the RDMA lane's short subset on soft-RoCE (tests/vm/lane.py's RDMA_SMOKE; `make test-rdma`: all of it),
# then the two-guest RDMA lane (tests/vm/pair.py: two hosts' soft-RoCE devices on one wire, about 1 minute)
test: install vm-deps node-root
	$(VENV)/bin/pytest -q -ra tests
	$(PY) -m tests.vm.lane
	$(PY) -m tests.vm.lane --rdma --smoke
	$(PY) -m tests.vm.pair

test-unit: install
	$(VENV)/bin/pytest -q -ra tests/unit

# The RDMA lane: every test that needs a verbs device (pytest marker rdma_device). On a host whose
# kernel lists an RDMA device (an RNIC, or rxe/siw made by hand) they run here, on its first device;
# elsewhere in the qemu guest of the cgroup v2 lane with a soft-RoCE device (rdma_rxe) made at boot
# (tests/vm/README.md). ARGS (pytest arguments) replace the selection.
test-rdma: install vm-deps
	@if [ -n "$$(ls /sys/class/infiniband 2>/dev/null)" ]; then \
		$(VENV)/bin/pytest -q -ra $(or $(ARGS),-m rdma_device tests); \
	else \
		$(PY) -m tests.vm.lane --rdma -- $(ARGS); \
	fi

# The two-guest RDMA lane (tests/vm/README.md): two qemu guests joined by a wire, a soft-RoCE device
# on each end; guest a runs pytest on tests/pair against guest b (tests/pair/peer.py)
test-rdma-pair: install vm-deps
	$(PY) -m tests.vm.pair

# The cgroup v2 lane (tests/vm/README.md): pytest in a qemu guest (TCG) booting Debian 12's own 6.1
# kernel on a cgroup2-only hierarchy, the host's / shared over 9p. Runs the v2 subset (tests/vm/lane.py), or ARGS
# (pytest arguments, replacing tests/cgroup2): make test-cgroup2 ARGS="tests/unit/test_spec.py -x"
VM_APT_PACKAGES := qemu-system-x86 busybox-static

# qemu from apt; the kernel package is only downloaded and unpacked into /var/cache/quark-vm (never
# installed: its postinst would touch the host's /boot), and the guest's initramfs is built there
vm-deps: venv
	@$(MAKE) --no-print-directory apt APT_PACKAGES="$(VM_APT_PACKAGES)"
	@$(PY) -m tests.vm.lane --prepare

test-cgroup2: install vm-deps
	$(PY) -m tests.vm.lane -- $(ARGS)

# matplotlib (the `bench` extra) draws bench/results/tsor.png; nginx is fetched by bench/tsor.py itself
# (tests/support/nginx.py: downloaded and unpacked, never installed on the host)
bench: install
	$(PY) -m pip install -q -e '.[bench]' --config-settings editable_mode=compat
	$(PY) bench/startup.py
	$(PY) bench/tsor.py

# rebuild the exec trampoline from qvisor/trampoline.S and print the base64 embedded in
# qvisor/trampoline.py (tests/unit/test_trampoline.py checks the two agree)
trampoline:
	gcc -nostdlib -static -Wl,--build-id=none -Wl,-n -s -o /tmp/quark-trampoline qvisor/trampoline.S
	base64 -w0 /tmp/quark-trampoline; echo; rm -f /tmp/quark-trampoline

# regenerate the committed protobuf modules of the shim from shim/proto/*.proto
proto: install
	$(PY) -m pip install -q -e '.[proto]'
	$(PY) -m shim.pb.generate
	$(PY) -m tests.support.cri.generate

clean:
	rm -rf $(VENV) *.egg-info build qkernel/_fastpath.so tsor/transport/_rdma_pump.so $(BPF_OBJECTS)
