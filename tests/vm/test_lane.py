"""The cgroup v2 lane's host side, without booting anything: the initramfs archive busybox's cpio
reads back, module load order from a modules.dep, the run script, pytest's summary line."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tests.vm import initramfs, lane
from tests.vm.initramfs import Cpio, module_order, static_nodes
from tests.vm.kernel import BUSYBOX, LaneError


def test_cpio_reads_back_with_busybox(tmp_path) -> None:
    a = Cpio()
    a.dir("bin")
    a.file("bin/odd", b"12345", 0o755)     # sizes that need padding to 4 bytes
    a.file("init", b"#!/bin/sh\necho hi\n", 0o755)
    a.symlink("bin/sh", "busybox")
    a.chardev("console", 5, 1)
    archive = tmp_path / "a.cpio"
    archive.write_bytes(a.finish())
    listing = subprocess.run([BUSYBOX, "cpio", "-t", "-v", "-F", str(archive)], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert [line.split()[0] for line in listing] == ["drwxr-xr-x", "-rwxr-xr-x", "-rwxr-xr-x", "lrwxrwxrwx",
                                                     "crw-------"]
    assert listing[3].endswith("bin/sh -> busybox")
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run([BUSYBOX, "cpio", "-i", "-d", "-F", str(archive)], cwd=out, check=True, capture_output=True)
    assert (out / "bin/odd").read_bytes() == b"12345" and (out / "init").read_text() == "#!/bin/sh\necho hi\n"
    if os.geteuid() == 0:   # cpio made the node: the kernel's unpacker would too
        rdev = (out / "console").stat().st_rdev
        assert (os.major(rdev), os.minor(rdev)) == (5, 1)


def test_module_order_puts_dependencies_first(tmp_path) -> None:
    (tmp_path / "modules.dep").write_text(
        "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko\n"
        "kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko\n"
        "kernel/fs/netfs/netfs.ko:\n"
        "kernel/net/9p/9pnet.ko:\n"
        "kernel/net/9p/9pnet_virtio.ko.xz: kernel/net/9p/9pnet.ko\n")
    order = [p.rsplit("/", 1)[1] for p in module_order(tmp_path, ("9p", "9pnet_virtio"))]
    assert order == ["9pnet.ko", "netfs.ko", "fscache.ko", "9p.ko", "9pnet_virtio.ko.xz"]
    with pytest.raises(LaneError, match="overlay"):
        module_order(tmp_path, ("overlay",))


def test_static_nodes_pair_names_with_numbers(tmp_path) -> None:
    (tmp_path / "modules.alias").write_text(
        "alias fs-fuse fuse\nalias char-major-10-229 fuse\nalias devname:fuse fuse\n"
        "alias block-major-7-* loop\nalias char-major-10-237 loop\nalias devname:loop-control loop\n"
        "alias devname:nonumber nonumber\nalias char-major-99-1 noname\n"
        "alias devname:net/tun tun\nalias char-major-10-200 tun\n")
    assert static_nodes(tmp_path) == ["c 0666 10 229 fuse", "c 0600 10 237 loop-control",
                                      "c 0666 10 200 net/tun"]


def test_initramfs_key_changes_with_the_init_script(tmp_path, monkeypatch) -> None:
    from tests.vm.kernel import Kernel
    k = Kernel("6.1.0-1-amd64", tmp_path)
    before = initramfs._key(k)
    script = tmp_path / "guest_init.sh"
    script.write_text(initramfs.GUEST_INIT.read_text() + "# changed\n")
    monkeypatch.setattr(initramfs, "GUEST_INIT", script)
    assert initramfs._key(k) != before and initramfs._key(k).startswith("6.1.0-1-amd64-")


def test_run_script_uses_this_checkout_and_interpreter() -> None:
    lines = lane.run_script(["tests/unit/test_spec.py", "-k", "a b"]).splitlines()
    assert lines[0] == f"cd {shlex.quote(str(lane.PROJECT))} || exit 4"
    argv = shlex.split(lines[1])
    assert argv[:3] == ["exec", "env", "PYTHONDONTWRITEBYTECODE=1"]
    assert argv[3:] == [sys.executable, "-m", "pytest", *lane.PYTEST_FIXED, "tests/unit/test_spec.py", "-k", "a b"]
    assert "no:cacheprovider" in lane.PYTEST_FIXED   # the guest's writes are lost anyway
    assert shlex.split(lane.run_script([]).splitlines()[1])[-len(lane.DEFAULT_TESTS):] == lane.DEFAULT_TESTS


def test_a_command_runs_instead_of_pytest_with_an_out_folder() -> None:
    lines = lane.run_script([], rdma=True, command="bench/x.py --json $QUARK_VM_OUT/x.json").splitlines()
    assert lines[-2] == f"mkdir -p {lane.GUEST_OUT}"
    assert shlex.split(lines[-1])[-3:] == ["sh", "-c", "bench/x.py --json $QUARK_VM_OUT/x.json"]
    assert f"QUARK_VM_OUT={lane.GUEST_OUT}" in shlex.split(lines[-1])


def test_the_rdma_lane_makes_its_device_before_pytest() -> None:
    lines = lane.run_script([], rdma=True).splitlines()
    add = lines.index(f"/usr/bin/rdma link add {lane.RDMA_DEVICE} type rxe netdev qrv0")
    assert lines[0] == "set -e" and lines.index("set +e") > add   # a device that cannot be made fails the lane
    assert lines[-2].startswith("cd ") and lines[-1].endswith(shlex.join(lane.RDMA_TESTS))


@pytest.mark.parametrize("line,want", [
    ("66 passed in 21.19s", "66 passed in 21.19s"),
    ("2 failed, 7 passed in 122.54s (0:02:02)", "2 failed, 7 passed in 122.54s (0:02:02)"),
    ("======= 1 passed, 3 skipped, 1 warning in 3.20s =======", "1 passed, 3 skipped, 1 warning in 3.20s"),
    ("no tests ran in 0.01s", "no tests ran in 0.01s"),
])
def test_summary_line(line, want) -> None:
    assert lane.summary_line(f"....\nFAILED x.py::t - boom\n{line}\n[ 31.2] reboot: Power down\n") == want


def test_summary_line_absent() -> None:
    assert lane.summary_line("quark-vm: mounting cgroup2 failed\n") is None



def test_a_module_the_kernel_has_built_in_is_not_loaded(tmp_path) -> None:
    """6.12 builds virtio_pci in (modules.builtin): the initramfs needs no module for it; a wanted
    module that is neither built in nor a module is still an error."""
    (tmp_path / "modules.dep").write_text("kernel/fs/9p/9p.ko.xz: kernel/net/9p/9pnet.ko.xz\n"
                                          "kernel/net/9p/9pnet.ko.xz:\n")
    (tmp_path / "modules.builtin").write_text("kernel/drivers/virtio/virtio_pci.ko\n")
    assert module_order(tmp_path, ("virtio_pci", "9p")) == ["kernel/net/9p/9pnet.ko.xz", "kernel/fs/9p/9p.ko.xz"]
    with pytest.raises(LaneError, match="overlay"):
        module_order(tmp_path, ("overlay",))


def test_each_kernel_suite_keeps_its_own_kernel_and_apt_lists(tmp_path, monkeypatch) -> None:
    """The two-guest lane's bookworm-backports kernel sits beside the other lanes' bookworm one (neither
    removes the other), and backports is read through apt lists of the cache's own: the host's apt
    sources are never touched."""
    from tests.vm import kernel
    monkeypatch.setattr(kernel, "CACHE", tmp_path)
    for version, suite in (("6.1.0-57-amd64", None), ("6.12.95+deb12-amd64", "bookworm-backports")):
        (tmp_path / version).mkdir()
        (tmp_path / version / kernel.DONE).touch()
        if suite:
            (tmp_path / version / kernel.SUITE_FILE).write_text(suite + "\n")
    assert [k.version for k in kernel.cached_kernels()] == ["6.1.0-57-amd64"]
    assert [k.version for k in kernel.cached_kernels("bookworm-backports")] == ["6.12.95+deb12-amd64"]
    assert kernel._apt_options("bookworm") == []
    opts = kernel._apt_options("bookworm-backports")
    lists = tmp_path / "apt-bookworm-backports"
    assert f"Dir::State::Lists={lists}/lists" in opts and "Dir::Etc::SourceParts=/dev/null" in opts
    assert (lists / "sources.list").read_text().split()[2] == "bookworm-backports"
    with pytest.raises(LaneError, match="no kernel suite"):
        kernel.ensure_kernel("sid")
