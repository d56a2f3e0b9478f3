"""Debian 12's own kernel for the cgroup v2 lane, unpacked into a cache, never installed.

Installing linux-image-*-amd64 would run its postinst on the host (initramfs hooks, /boot); the lane
needs only the kernel image and its modules, so the package is fetched with `apt-get download` and
unpacked with `dpkg-deb -x` under /var/cache/quark-vm/<version>/. `busybox depmod` writes the
modules.dep/alias the guest's on-demand modprobe reads. Everything is reused while present.

`suite`: bookworm's kernel (6.1, every lane's default) or bookworm-backports' (the two-guest lane's
`--kernel-suite bookworm-backports`: a later kernel whose rxe carries SMC-R, tests/vm/README.md).
A suite the host's apt sources do not list is read through apt lists of the cache's own
(CACHE/apt-SUITE): the host's apt configuration is never changed.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("QUARK_VM_CACHE", "/var/cache/quark-vm"))
META_PACKAGE = "linux-image-amd64"   # bookworm: depends on linux-image-6.1.0-<abi>-amd64
BUSYBOX = "/bin/busybox"
DONE = ".complete"   # written last: a directory without it is a half-finished unpack
SUITE_FILE = ".suite"   # which suite's kernel a cached directory holds (none: bookworm's)
SUITES = {"bookworm": "", "bookworm-backports": "deb http://deb.debian.org/debian bookworm-backports main"}


class LaneError(Exception):
    """A set-up step of the lane failed; the message says which and what to do."""


@dataclass(frozen=True)
class Kernel:
    version: str   # uname -r, e.g. 6.1.0-57-amd64
    root: Path     # the unpacked package

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules" / self.version


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, capture_output=True, text=True, **kw)


def _apt_options(suite: str) -> list[str]:
    """apt's options to read `suite`: none for bookworm (the host's own sources); else lists and a
    source list of the cache's own."""
    if not SUITES.get(suite):
        return []
    d = CACHE / f"apt-{suite}"
    for sub in ("lists/partial", "cache/archives/partial"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "sources.list").write_text(SUITES[suite] + "\n")
    return ["-o", f"Dir::Etc::SourceList={d}/sources.list", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={d}/lists", "-o", f"Dir::Cache={d}/cache"]


def candidate_version(suite: str = "bookworm") -> str | None:
    """The kernel version linux-image-amd64's candidate depends on, from apt's local lists."""
    r = _run(["apt-cache", *_apt_options(suite), "show", "--no-all-versions", META_PACKAGE])
    m = re.search(r"^Depends:.*?\blinux-image-(\d[^\s,()]*-amd64)\b", r.stdout, re.MULTILINE)
    return m.group(1) if r.returncode == 0 and m else None


def suite_of(root: Path) -> str:
    f = root / SUITE_FILE
    return f.read_text().strip() if f.exists() else "bookworm"


def cached_kernels(suite: str = "bookworm") -> list[Kernel]:
    if not CACHE.is_dir():
        return []
    return sorted((Kernel(d.name, d) for d in CACHE.iterdir()
                   if (d / DONE).exists() and suite_of(d) == suite), key=lambda k: k.version)


@contextlib.contextmanager
def cache_lock() -> Iterator[None]:
    """Two lanes on one host share the cache: one of them fills it, the other waits."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _apt_update(suite: str = "bookworm") -> None:
    r = _run(["apt-get", *_apt_options(suite), "update", "-q"])
    if r.returncode != 0:
        raise LaneError(f"apt-get update failed: {r.stderr.strip()}")


def _download(package: str, into: Path, suite: str = "bookworm") -> Path:
    # the sandbox user _apt cannot write into a 0700 temporary directory: download as root
    argv = ["apt-get", *_apt_options(suite), "download", "-q", "-o", "APT::Sandbox::User=root", package]
    r = _run(argv, cwd=into)
    if r.returncode != 0:   # stale lists name a file the mirror no longer has
        _apt_update(suite)
        r = _run(argv, cwd=into)
    debs = list(into.glob(f"{package}_*.deb"))
    if r.returncode != 0 or not debs:
        raise LaneError(f"apt-get download {package} failed: {r.stderr.strip()}")
    return debs[0]


def _unpack(version: str, suite: str = "bookworm") -> Kernel:
    package = f"linux-image-{version}"
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=".unpack-") as tmp:
        deb = _download(package, Path(tmp), suite)
        root = Path(tmp) / "root"
        r = _run(["dpkg-deb", "-x", str(deb), str(root)])
        if r.returncode != 0:
            raise LaneError(f"dpkg-deb -x {deb.name} failed: {r.stderr.strip()}")
        # modules.dep is made by the package's postinst (depmod), which we do not run
        r = _run([BUSYBOX, "depmod", "-b", str(root), version])
        if r.returncode != 0:
            raise LaneError(f"busybox depmod for {version} failed: {r.stderr.strip()}")
        (root / SUITE_FILE).write_text(suite + "\n")
        (root / DONE).touch()
        final = CACHE / version
        shutil.rmtree(final, ignore_errors=True)   # a half-finished unpack of an interrupted run
        root.rename(final)
    return Kernel(version, final)


def ensure_kernel(suite: str = "bookworm") -> Kernel:
    """The current kernel of `suite`, unpacked in the cache (downloaded once, 70-110 MB)."""
    if suite not in SUITES:
        raise LaneError(f"no kernel suite {suite!r}: one of {', '.join(SUITES)}")
    with cache_lock():
        version = candidate_version(suite)
        if version is None:
            if cached_kernels(suite):   # no lists (offline, minimal image): what we have will do
                return cached_kernels(suite)[-1]
            _apt_update(suite)
            version = candidate_version(suite)
            if version is None:
                raise LaneError(f"apt-cache knows no {META_PACKAGE} in {suite}: is it in apt's sources?")
        kernel = Kernel(version, CACHE / version)
        if not (kernel.root / DONE).exists():
            print(f"quark-vm: fetching {version} ({suite}) into {CACHE} (apt-get download + dpkg-deb -x)", flush=True)
            kernel = _unpack(version, suite)
            for old in cached_kernels(suite):   # ~400 MB each: keep only the current one of each suite
                if old.version != version:
                    shutil.rmtree(old.root, ignore_errors=True)
        if not kernel.vmlinuz.exists():
            raise LaneError(f"{kernel.vmlinuz} is missing: remove {kernel.root} and rerun")
        return kernel
