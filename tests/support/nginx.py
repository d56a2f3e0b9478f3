"""nginx as Debian 12 ships it, for TSoR's nginx test and benchmark, without installing it on the host.

`apt-get install nginx` would run its postinst, which starts a host nginx on port 80. Instead the
bookworm `nginx` and `nginx-common` packages are only downloaded and unpacked (`dpkg-deb -x`) into
CACHE, as tests/vm does with its kernel, and the container gets the unpacked files by bind mounts:
Debian's /etc/nginx tree (nginx.conf unmodified; the `sites-enabled/default` link that
nginx-common's postinst would make is made here), the binary, and what the default configuration
writes to (/var/log/nginx, /var/lib/nginx, /run) and serves (/var/www/html).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

CACHE = "/var/cache/quark-bench/nginx"
PACKAGES = ("nginx", "nginx-common")
INDEX = bytes(range(32, 127)) * 10 + b"quark-tsor-nginx-index\n"   # 973 bytes ...
INDEX = INDEX + b"x" * (1024 - len(INDEX) - 1) + b"\n"                 # ... padded to exactly 1 KiB
# what nginx needs of the host's /etc: user www-data (nginx.conf's `user`), name service, loader cache
HOST_ETC = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "hosts", "localtime")
# the default spec's three capabilities, and what nginx's root master needs: chown of its temp dirs
# under /var/lib/nginx to www-data, and setuid/setgid/setgroups in the workers
CAPS = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_CHOWN", "CAP_SETUID", "CAP_SETGID",
        "CAP_DAC_OVERRIDE"]


class NginxUnavailable(RuntimeError):
    """nginx could not be downloaded or does not run here; the message says why."""


@dataclass
class Nginx:
    root: str        # the unpacked packages
    binary: str      # <root>/usr/sbin/nginx
    etc: str         # <root>/etc/nginx: nginx.conf, mime.types, sites-available/default, ...
    version: str     # `nginx -V`'s first line


def _download(dest: str) -> None:
    def fetch() -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", "download", *PACKAGES], cwd=dest, check=False, capture_output=True,
                              text=True)
    r = fetch()
    if r.returncode != 0:   # stale or missing package lists: refresh once
        subprocess.run(["apt-get", "update", "-q"], check=False, capture_output=True, text=True)
        r = fetch()
    if r.returncode != 0:
        raise NginxUnavailable(f"apt-get download {' '.join(PACKAGES)} failed: {r.stderr.strip()[-500:]}")


def ensure_nginx(cache: str = CACHE) -> Nginx:
    """Debian's nginx unpacked under `cache` (downloaded and unpacked once, reused after)."""
    root = os.path.join(cache, "root")
    binary, etc = os.path.join(root, "usr/sbin/nginx"), os.path.join(root, "etc/nginx")
    if not (os.access(binary, os.X_OK) and os.path.isfile(os.path.join(etc, "nginx.conf"))):
        os.makedirs(cache, exist_ok=True)
        work = tempfile.mkdtemp(prefix="unpack-", dir=cache)
        try:
            _download(work)
            tree = os.path.join(work, "root")
            for deb in sorted(glob.glob(os.path.join(work, "*.deb"))):
                r = subprocess.run(["dpkg-deb", "-x", deb, tree], check=False, capture_output=True, text=True)
                if r.returncode != 0:
                    raise NginxUnavailable(f"dpkg-deb -x {deb}: {r.stderr.strip()}")
            # nginx-common's postinst enables the default site; an unpacked package has no postinst
            link = os.path.join(tree, "etc/nginx/sites-enabled/default")
            if not os.path.lexists(link):
                os.symlink("/etc/nginx/sites-available/default", link)
            shutil.rmtree(root, ignore_errors=True)
            try:
                os.rename(tree, root)      # complete or absent: a killed unpack is redone next time
            except OSError:
                if not os.access(binary, os.X_OK):   # else another caller's unpack won the race
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    r = subprocess.run([binary, "-V"], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise NginxUnavailable(f"{binary} -V does not run here (a shared library missing?): "
                               f"{r.stderr.strip()[-500:]}")
    return Nginx(root, binary, etc, r.stderr.splitlines()[0])


# issue 13's third row: the transport's own speed, without the per-response cork and sendfile
NO_CORK = {"sendfile on;": "sendfile off;", "tcp_nopush on;": "tcp_nopush off; tcp_nodelay off;"}


def prepare_bundle(bundle: str, ngx: Nginx, replace: dict[str, str] | None = None) -> None:
    """Turn a host-rootfs bundle (tests/support/testbed.py's Testbed.bundle) into one that runs
    nginx with Debian's default nginx.conf, unmodified, in the foreground. `replace`: lines of
    nginx.conf to change (e.g. NO_CORK), in a copy mounted over the package's.

    The host has no /etc/nginx or /usr/sbin/nginx to mount onto, so the container's /etc is a
    directory of the few host files nginx reads with an `nginx` mount point, and the unpacked tree
    is mounted at /opt/nginx for the binary. Writable: /var/log/nginx, /var/lib/nginx, /run
    (tmpfs); /var/www/html holds a 1 KiB index.html (INDEX)."""
    rootfs = os.path.join(bundle, "rootfs")
    etc = os.path.join(bundle, "etc")
    os.makedirs(os.path.join(etc, "nginx"), exist_ok=True)
    for name in HOST_ETC:
        src = os.path.join("/etc", name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(etc, name))   # follows /etc/localtime's link
    html = os.path.join(bundle, "html")
    os.makedirs(html, exist_ok=True)
    with open(os.path.join(html, "index.html"), "wb") as f:
        f.write(INDEX)
    os.chmod(html, 0o755)
    for d in ("opt/nginx", "var/log/nginx", "var/lib/nginx", "var/www/html", "run"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    mounts = [m for m in spec["mounts"] if m["destination"] not in ("/etc", "/run")]
    mounts += [
        {"destination": "/etc", "type": "bind", "source": etc, "options": ["rbind", "ro"]},
        {"destination": "/etc/nginx", "type": "bind", "source": ngx.etc, "options": ["rbind", "ro"]},
        {"destination": "/opt/nginx", "type": "bind", "source": ngx.root, "options": ["rbind", "ro"]},
        {"destination": "/var/www/html", "type": "bind", "source": html, "options": ["rbind", "ro"]}]
    if replace:
        with open(os.path.join(ngx.etc, "nginx.conf")) as f:
            conf = f.read()
        for old, new in replace.items():
            if old not in conf:
                raise NginxUnavailable(f"nginx.conf has no line {old!r} to replace")
            conf = conf.replace(old, new)
        with open(os.path.join(bundle, "nginx.conf"), "w") as f:
            f.write(conf)
        mounts.append({"destination": "/etc/nginx/nginx.conf", "type": "bind",
                       "source": os.path.join(bundle, "nginx.conf"), "options": ["bind", "ro"]})
    mounts += [{"destination": d, "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=755"]}
               for d in ("/var/log/nginx", "/var/lib/nginx", "/run")]
    spec["mounts"] = mounts
    spec["process"]["args"] = ["/opt/nginx/usr/sbin/nginx", "-g", "daemon off;"]
    spec["process"]["capabilities"] = {k: list(CAPS) for k in ("bounding", "effective", "permitted")}
    with open(path, "w") as f:
        json.dump(spec, f, indent=2)
