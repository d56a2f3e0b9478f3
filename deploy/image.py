"""Builds quark's node image (the image of deploy/daemonset.yaml and deploy/cleanup/daemonset.yaml)
as an OCI image archive, with Debian's tools and no registry:

    make image                                   # build/quark-node-VERSION.oci.tar
    .venv/bin/python -m deploy.image --payload build/payload --out build/quark-node.oci.tar

Two layers:
  1. Debian 12 minbase, made with mmdebstrap from Debian's archive (what debian:bookworm-slim holds:
     the shell, coreutils and util-linux's nsenter the installer restarts containerd with; no
     documentation, manual pages or locales). Made once and kept in /var/cache/quark-node, like the
     fresh nodes' roots of tests/support/fresh_node.py.
  2. The node payload at /opt/quark (deploy/payload.py: quark with its own Python and libraries).

Reproducible: the payload layer is written here, its entries in sorted order with owner 0:0, no
user or group names and every time set to SOURCE_DATE_EPOCH (default: the time of the tree's last
commit); gzip without a name or a time; the config's dates that same time. So the same tree (and the
same cached base) gives the same archive, digest for digest.

The archive is an OCI image layout (oci-layout, index.json, blobs/sha256/...) in a tar, which
`ctr images import`, `podman load` and `skopeo copy oci-archive:...` read; its index names the
image both ways containerd and podman look for a name (io.containerd.image.name,
org.opencontainers.image.ref.name). A manifest.json beside it (docker's archive format) lets
`docker load` read it too. To a registry: `skopeo copy oci-archive:FILE docker://REGISTRY/quark/node:TAG`.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPOSITORY = "quark/node"                   # deploy/daemonset.yaml's image, without the tag
SUITE = "bookworm"                          # the suite the payload's Python and libraries come from
MIRROR = "http://deb.debian.org/debian"
CACHE = Path("/var/cache/quark-node")
# a slim minbase, as Debian's own slim images are: documentation (but the copyright files),
# manual pages, info pages and translations left out by dpkg; device nodes left to the runtime
BASE_OPTIONS = ("--variant=minbase", "--skip=output/dev",
                "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/info/*",
                "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                "--dpkgopt=path-exclude=/usr/share/locale/*")
PAYLOAD_DIR = "opt/quark"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
PATH_ENV = "PATH=/opt/quark/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageError(Exception):
    pass


@dataclass
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **annotations: str) -> dict:
        d = {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data)}
        if annotations:
            d["annotations"] = annotations
        return d


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH, else the time of the tree's last commit, else 0."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    r = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return int(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip().isdigit() else 0


def commit() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def _base_path() -> Path:
    key = hashlib.sha256(" ".join((SUITE, *BASE_OPTIONS)).encode()).hexdigest()[:12]
    return CACHE / f"image-base-{SUITE}-{key}.tar"


def base_tarball_if_built() -> Path | None:
    return _base_path() if _base_path().exists() else None


def base_tarball() -> Path:
    """The base layer's tar (mmdebstrap), made when missing; keyed by what makes it."""
    return mmdebstrap_tar(_base_path(), SUITE, BASE_OPTIONS, f"image-base-{SUITE}-*.tar")


def mmdebstrap_tar(path: Path, suite: str, options: tuple[str, ...], recipes: str) -> Path:
    """A Debian root's tarball at `path`, made with mmdebstrap from Debian's archive when missing;
    the tarballs of earlier recipes beside it (the glob `recipes`) removed. Also the fresh test
    nodes' roots (tests/support/fresh_node.py)."""
    if path.exists():
        return path
    if not shutil.which("mmdebstrap"):
        raise ImageError("mmdebstrap is not installed (make apt installs it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.tar")
    r = subprocess.run(["mmdebstrap", "--quiet", *options, suite, str(tmp), MIRROR], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ImageError(f"mmdebstrap {suite} failed: {r.stderr.strip()[-2000:]}")
    tmp.rename(path)
    for old in path.parent.glob(recipes):
        if old != path:
            old.unlink()
    return path


def payload_tar(payload: Path, epoch: int) -> bytes:
    """The payload as a layer: every entry under opt/quark/, sorted, owned by 0:0, dated `epoch`."""
    if not (payload / "bin" / "quark").exists():
        raise ImageError(f"{payload}: not a quark payload (make payload builds one)")
    buf = io.BytesIO()

    def normal(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = epoch
        if ti.name == PAYLOAD_DIR:
            ti.mode = 0o755   # the build's staging directory was private
        return ti

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        opt = tarfile.TarInfo(os.path.dirname(PAYLOAD_DIR))   # the directory above the payload
        opt.type, opt.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(normal(opt))
        # tarfile.add walks directories in sorted order and stores a second name of a file as a link
        tar.add(payload, arcname=PAYLOAD_DIR, filter=normal)
    return buf.getvalue()


def gzipped(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as z:
        z.write(data)
    return out.getvalue()


def rfc3339(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def build(payload: Path, out: Path, version: str, epoch: int | None = None) -> str:
    """Writes the node image's archive to `out`; returns the manifest's digest."""
    epoch = source_date_epoch() if epoch is None else epoch
    labels = {"org.opencontainers.image.title": "quark node",
              "org.opencontainers.image.description": "quark's node payload (/opt/quark) and its installer",
              "org.opencontainers.image.version": version,
              "org.opencontainers.image.revision": commit(),
              "org.opencontainers.image.licenses": "Apache-2.0"}
    return write_archive(
        out, [base_tarball().read_bytes(), payload_tar(payload, epoch)],
        {"Env": [PATH_ENV], "Cmd": ["/opt/quark/bin/tsord", "--config", "/etc/quark/tsor.yaml"], "Labels": labels},
        f"docker.io/{REPOSITORY}:{version}", version, epoch=epoch,
        history=[f"mmdebstrap {' '.join(BASE_OPTIONS)} {SUITE}",
                 f"deploy/payload.py --version {version} (/{PAYLOAD_DIR})"])


def write_archive(out: Path, layers_raw: list[bytes], image_config: dict, name: str, ref: str, *, epoch: int = 0,
                  history: list[str] | None = None) -> str:
    """An OCI image archive at `out`: the layers (uncompressed tars, gzipped here), an image config
    around `image_config` (Env, Cmd, ...), its manifest, an index naming it `name` for containerd
    and `ref` for podman, and docker's manifest.json; every date `epoch`. Returns the manifest's
    digest. (tests/integration/containerd_env.py makes its test images with it too.)"""
    created = rfc3339(epoch)
    layers = [Blob(MEDIA_LAYER, gzipped(raw)) for raw in layers_raw]
    config = Blob(MEDIA_CONFIG, _json({
        "created": created, "architecture": "amd64", "os": "linux", "config": image_config,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(r).hexdigest() for r in layers_raw]},
        "history": [{"created": created, "created_by": by} for by in history or ()],
    }))
    manifest = Blob(MEDIA_MANIFEST, _json({
        "schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "config": config.descriptor(),
        "layers": [layer.descriptor() for layer in layers],
        "annotations": {"org.opencontainers.image.created": created},
    }))
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{**manifest.descriptor(**{"io.containerd.image.name": name,
                                                     "org.opencontainers.image.ref.name": ref}),
                            "platform": {"architecture": "amd64", "os": "linux"}}]}
    docker = [{"Config": _blob_path(config), "RepoTags": [name.removeprefix("docker.io/").removeprefix("library/")],
               "Layers": [_blob_path(layer) for layer in layers]}]
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": _json(index),
             "manifest.json": _json(docker)}
    for blob in (config, manifest, *layers):
        files[_blob_path(blob)] = blob.data
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for d in ("blobs", "blobs/sha256"):
                ti = tarfile.TarInfo(d)
                ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, epoch
                tar.addfile(ti)
            for path in sorted(files):
                ti = tarfile.TarInfo(path)
                ti.size, ti.mode, ti.mtime = len(files[path]), 0o644, epoch
                tar.addfile(ti, io.BytesIO(files[path]))
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
    return manifest.digest


def _blob_path(blob: Blob) -> str:
    return "blobs/sha256/" + blob.digest.split(":", 1)[1]


def _json(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def main(argv: list[str] | None = None) -> int:
    from qlib.version import VERSION
    p = argparse.ArgumentParser(prog="python -m deploy.image", description=__doc__.split("\n\n")[0])
    p.add_argument("--payload", required=True, type=Path, help="the node payload (make payload)")
    p.add_argument("--version", default=VERSION,
                   help="the image's tag; the payload must be stamped with it (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="the archive (default: build/quark-node-VERSION.oci.tar)")
    args = p.parse_args(argv)
    out = args.out or REPO / "build" / f"quark-node-{args.version}.oci.tar"
    try:
        stamped = _payload_version(args.payload)
        if stamped != args.version:
            raise ImageError(f"{args.payload} is quark {stamped}, not {args.version} "
                             f"(deploy/payload.py --version {args.version} stamps it)")
        digest = build(args.payload, out, args.version)
    except (ImageError, OSError) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    print(f"{out}: docker.io/{REPOSITORY}:{args.version} {digest}")
    return 0


def _payload_version(payload: Path) -> str:
    import re
    text = (payload / "lib" / "python3" / "dist-packages" / "qlib" / "version.py").read_text()
    m = re.search(r'(?m)^VERSION = "(.*)"$', text)
    return m.group(1) if m else ""


if __name__ == "__main__":
    sys.exit(main())
