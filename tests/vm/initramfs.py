"""The guest's initramfs: busybox-static, tests/vm/guest_init.sh as /init, and the kernel modules
that are built as modules (=m) in Debian's 6.1 config but needed before the root is mounted:
virtio-pci, 9p over virtio, overlayfs, virtio-blk. Written as a newc cpio in Python (no cpio package needed),
gzip-compressed, cached next to the kernel under a name keyed by the kernel version and a hash of
the files that make it (this builder, the init script, busybox).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import re
import stat
from pathlib import Path

from tests.vm.kernel import BUSYBOX, CACHE, Kernel, LaneError

HERE = Path(__file__).resolve().parent
GUEST_INIT = HERE / "guest_init.sh"
# what stage 1 of guest_init.sh insmods; their dependencies come along, loaded first.
# virtio_blk: the lane's scratch disk (/dev/vda), for tests of per-device io limits
MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_blk")


def module_order(modules_dir: Path, wanted: tuple[str, ...] = MODULES) -> list[str]:
    """Paths (relative to modules_dir) of `wanted` and what they depend on, each after its
    dependencies, from the modules.dep that depmod wrote; a module the kernel has built in (a later
    kernel's virtio_pci) is left out."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
        by_name[_name(path)] = path
    builtin_list = modules_dir / "modules.builtin"   # built into the kernel (=y): nothing to load
    builtin = {_name(p) for p in builtin_list.read_text().split()} if builtin_list.exists() else set()
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for d in deps.get(path, []):
            visit(d)
        order.append(path)
    for name in wanted:
        if name in builtin and name not in by_name:
            continue
        if name not in by_name:
            raise LaneError(f"module {name} is not in {modules_dir}/modules.dep")
        visit(by_name[name])
    return order


def static_nodes(modules_dir: Path) -> list[str]:
    """`kmod static-nodes` for busybox: a line "c|b MODE MAJOR MINOR PATH" for every module that names
    its device node (alias devname:PATH) and its number (alias char-major-M-N / block-major-M-N).
    On a booted Debian these nodes exist before their modules load (systemd-tmpfiles creates them),
    and opening one loads its module: /dev/fuse, /dev/net/tun, /dev/loop-control, ..."""
    names: dict[str, str] = {}
    numbers: dict[str, tuple[str, int, int]] = {}
    for line in (modules_dir / "modules.alias").read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] != "alias":
            continue
        alias, module = parts[1], parts[2]
        if alias.startswith("devname:"):
            names[module] = alias[len("devname:"):]
        m = re.fullmatch(r"(char|block)-major-(\d+)-(\d+)", alias)
        if m:
            numbers[module] = (m.group(1)[0], int(m.group(2)), int(m.group(3)))
    lines = []
    for module, path in sorted(names.items(), key=lambda kv: kv[1]):
        if module in numbers:
            kind, major, minor = numbers[module]
            # world-usable as systemd's static-nodes-permissions.conf makes them; the rest root's
            mode = "0666" if path in ("fuse", "net/tun") else "0600"
            lines.append(f"{kind} {mode} {major} {minor} {path}")
    return lines


def _name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    return base[:base.index(".ko")].replace("-", "_")


def _module_bytes(path: Path) -> bytes:
    # busybox insmod takes a plain ELF: decompress what the package ships compressed
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith(".gz"):
        return gzip.decompress(data)
    return data


class Cpio:
    """A newc ("070701") archive, as the kernel's initramfs unpacker reads it."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 0

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        self.ino += 1
        raw = name.encode() + b"\0"
        fields = (self.ino, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data), 0, 0,
                  rdev[0], rdev[1], len(raw), 0)
        self.buf.write(b"070701" + b"".join(b"%08x" % f for f in fields) + raw)
        self._pad()
        self.buf.write(data)
        self._pad()

    def _pad(self) -> None:
        self.buf.write(b"\0" * (-self.buf.tell() % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, perm: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | perm, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def _key(kernel: Kernel) -> str:
    h = hashlib.sha256()
    for p in (Path(__file__), GUEST_INIT, Path(BUSYBOX)):
        h.update(p.read_bytes())
    h.update(repr(MODULES).encode())
    return f"{kernel.version}-{h.hexdigest()[:16]}"


def build(kernel: Kernel) -> bytes:
    a = Cpio()
    for d in ("bin", "dev", "lib", "lib/modules", "proc", "sys", "lower", "upper", "newroot"):
        a.dir(d)
    # the kernel opens /dev/console for init before anything can mount devtmpfs
    a.chardev("dev/console", 5, 1)
    a.file("init", GUEST_INIT.read_bytes(), 0o755)
    a.file("bin/busybox", Path(BUSYBOX).read_bytes(), 0o755)
    a.symlink("bin/sh", "busybox")
    names = []
    for rel in module_order(kernel.modules):
        name = _name(rel) + ".ko"
        a.file(f"lib/modules/{name}", _module_bytes(kernel.modules / rel))
        names.append(name)
    a.file("modules.list", ("\n".join(names) + "\n").encode())
    a.file("static-nodes", "".join(line + "\n" for line in static_nodes(kernel.modules)).encode())
    return gzip.compress(a.finish(), compresslevel=6, mtime=0)


def ensure_initramfs(kernel: Kernel) -> Path:
    """The cached initramfs for `kernel` and the current builder, built when missing."""
    if not Path(BUSYBOX).exists():
        raise LaneError(f"{BUSYBOX} is missing: install busybox-static (make apt)")
    path = CACHE / f"initramfs-{_key(kernel)}.cpio.gz"
    if path.exists():
        return path
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(build(kernel))
    tmp.rename(path)
    # older builders' for this kernel, and those of kernels no longer cached (each suite keeps its own)
    cached = {d.name for d in CACHE.iterdir() if d.is_dir()}
    for old in CACHE.glob("initramfs-*.cpio.gz"):
        version = old.name[len("initramfs-"):].rsplit("-", 1)[0]
        if old != path and (version == kernel.version or version not in cached):
            old.unlink(missing_ok=True)
    return path
