"""Build a small busybox bundle (rootfs + config.json) from Debian's busybox-static.

The demo, the tests and the benchmarks all need a real image without a registry: this is it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

from qvisor.spec import default_spec

BUSYBOX = "/bin/busybox"


def make_rootfs(rootfs: str) -> None:
    for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "root", "var", "usr/bin"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    os.chmod(os.path.join(rootfs, "tmp"), 0o1777)
    shutil.copy2(BUSYBOX, os.path.join(rootfs, "bin/busybox"))
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        link = os.path.join(rootfs, "bin", a)
        if not os.path.lexists(link):
            os.symlink("busybox", link)
    with open(os.path.join(rootfs, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    with open(os.path.join(rootfs, "etc/group"), "w") as f:
        f.write("root:x:0:\nnogroup:x:65534:\n")


def make_bundle(bundle: str, args: list[str], *, terminal: bool = False, readonly: bool = True,
                rootfs: str | None = None, **overrides: object) -> dict:
    """Write `<bundle>/config.json` (runc's default spec running `args`) and, unless `rootfs` names
    an existing one, a busybox rootfs. Top-level keys in `overrides` replace the spec's."""
    os.makedirs(bundle, exist_ok=True)
    spec = default_spec()
    if rootfs is None:
        make_rootfs(os.path.join(bundle, "rootfs"))
        rootfs = "rootfs"
    spec["root"] = {"path": rootfs, "readonly": readonly}
    spec["process"]["args"] = args
    spec["process"]["terminal"] = terminal
    spec.update(overrides)
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f, indent=2)
    return spec
