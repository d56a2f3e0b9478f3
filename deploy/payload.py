"""Builds quark's node payload: everything quark needs on a Kubernetes node, under one directory that
deploy/install.py copies to /opt/quark. A node needs no Python, no compiler and no package manager:

    bin/python3.11          this machine's Python (Debian's), its ELF interpreter and library path set
                            to /opt/quark/lib, so it runs on a node with any libc, or none of its own
    bin/quark               the C front end (qvisor/frontend.c), built for this layout; also
    bin/containerd-shim-quark-v1   under the shim's name, which containerd runs (runtime_path)
    bin/tsord, bin/quark-cni, bin/quark-install    Python programs (#!/opt/quark/bin/python3.11)
    share/containerd-quark.toml    deploy/containerd/quark.toml, which the installer points at here
    libexec/                the Python CLI and shim the front end execs
    lib/                    the dynamic loader and every shared library those ELF files need
                            (found with ldd here), plus the ones quark dlopens (libbpf)
    lib/python3.11/         the standard library
    lib/python3/dist-packages/   quark's packages with their compiled parts (the fast path, the BPF
                            objects), its dependencies at the venv's versions, libseccomp's binding

The path /opt/quark is fixed: an ELF interpreter must be an absolute path. Every other search path
is relative ($ORIGIN), so that a node can hold several versions side by side (deploy/versions.py);
the file PAYLOAD_ID names this one (its version and the digest of its files). Run as
`.venv/bin/python deploy/payload.py build/payload` (make payload); a directory already there is
replaced. `--version V` stamps the payload as quark V (its qlib/version.py and its distribution's
metadata; default: the tree's), as deploy/image.py does for a node image's tag.

The same tree gives the same files (deploy/image.py checks it, byte for byte): the bytecode is
compiled as unchecked hashes (no source time in it; the payload's sources and their bytecode are
only ever replaced together), and pip compiles nothing itself.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

if __package__ in (None, ""):   # run as deploy/payload.py (make payload): the checkout's packages
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deploy import versions  # noqa: E402

PREFIX = "/opt/quark"
PYVER = f"python{sys.version_info[0]}.{sys.version_info[1]}"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("qlib", "qvisor", "qkernel", "tsor", "shim", "cni")
# the distribution whose metadata (entry points: the factory's programs) the payload carries
DISTRIBUTION = "quark-runtime"
EXTRAS = ("k8s",)   # tsord's route source from the API server runs from the payload too
# loaded with dlopen, so ldd cannot name them: libbpf (qlib/libbpf.py); libgcc_s (glibc loads it
# to unwind a cancelled thread)
DLOPENED = ("libbpf.so.1", "libgcc_s.so.1")
# Debian's binding of libseccomp (python3-seccomp), which the venv sees as a system site package
SYSTEM_MODULES = ("seccomp",)
# the standard library parts quark never imports: tests, GUIs, build files
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "__pycache__",
               "site-packages", "dist-packages", f"config-{sys.version_info[0]}.{sys.version_info[1]}-x86_64-linux-gnu"}
# built by `make install`, loaded by the packages (each beside the source it is checked against)
COMPILED = ("qkernel/_fastpath.so", "tsor/bpf/sockmap.bpf.o", "tsor/bpf/sockopt.bpf.o", "tsor/bpf/service_lb.bpf.o")
# TSoR's rdma transport needs the node's own rdma-core (libibverbs and the providers for its NIC,
# which must be the same build): not carried; its pump stays out so that nothing links the payload's
# libraries to a libibverbs that is not there
LEFT_OUT = ("_rdma_pump.so",)
# the installer's modules (deploy/install.py, run as /opt/quark/bin/quark-install)
INSTALLER = ("install.py", "node_config.py", "node_processes.py", "versions.py")
# Python programs: name -> (module, function)
PROGRAMS = {
    "bin/tsord": ("tsor.daemon", "main"),
    "bin/quark-cni": ("cni.plugin", "main"),
    "bin/quark-install": ("deploy.install", "main"),
    "libexec/quark": ("qvisor.cli", "main"),
    "libexec/containerd-shim-quark-v1": ("shim.main", "main"),
}


class PayloadError(Exception):
    pass


def build(out: str, version: str | None = None) -> None:
    missing = [c for c in COMPILED if not os.path.exists(os.path.join(REPO, c))]
    if missing:
        raise PayloadError(f"not built: {', '.join(missing)} (run make install first)")
    stage = tempfile.mkdtemp(prefix=".payload-", dir=os.path.dirname(os.path.abspath(out)) or ".")
    try:
        site = os.path.join(stage, "lib", "python3", "dist-packages")
        python = copy_python(stage)
        install_packages(site, version)
        write_programs(stage)
        os.makedirs(os.path.join(stage, "share"))
        shutil.copy2(os.path.join(REPO, "deploy", "containerd", "quark.toml"),
                     os.path.join(stage, "share", "containerd-quark.toml"))
        build_frontend(stage)
        bundle_libraries(stage, python)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j0", "-s", stage, "-p", PREFIX,
                        "--invalidation-mode", "unchecked-hash", os.path.join(stage, "lib")], check=True, stdout=subprocess.DEVNULL)
        # its name among a node's versions (deploy/versions.py): the version and the files' digest
        with open(os.path.join(stage, versions.ID_FILE), "w") as f:
            f.write(f"{version or importlib.metadata.version(DISTRIBUTION)}-{versions.tree_digest(stage)[:12]}\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def copy_python(stage: str) -> str:
    """The interpreter the venv was made from, and its standard library."""
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    stdlib = sysconfig.get_paths()["stdlib"]
    os.makedirs(os.path.join(stage, "bin"))
    python = os.path.join(stage, "bin", PYVER)
    shutil.copy2(exe, python)
    os.symlink(PYVER, os.path.join(stage, "bin", "python3"))
    shutil.copytree(stdlib, os.path.join(stage, "lib", PYVER), symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_SKIP or n.endswith(".pyc")])
    return python


def install_packages(site: str, version: str | None = None) -> None:
    """quark (its own files, compiled parts included), and its dependencies at the versions the
    venv has (pip, from its cache or PyPI), and the system modules the venv borrows."""
    os.makedirs(site)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-compile",
                    "--no-warn-script-location", "--target", site, *pins(DISTRIBUTION, EXTRAS)], check=True)
    shutil.rmtree(os.path.join(site, "bin"), ignore_errors=True)   # scripts for the venv's python
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(REPO, pkg), os.path.join(site, pkg),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_quark", "frontend.c", *LEFT_OUT))
    os.makedirs(os.path.join(site, "deploy"))
    for name in INSTALLER:
        shutil.copy2(os.path.join(REPO, "deploy", name), os.path.join(site, "deploy", name))
    for mod in SYSTEM_MODULES:
        for root in sys.path:
            for name in os.listdir(root) if os.path.isdir(root) else ():
                if name.split(".")[0] == mod and name.endswith(".so"):
                    shutil.copy2(os.path.join(root, name), os.path.join(site, name))
    dist = importlib.metadata.distribution(DISTRIBUTION)
    version = version or dist.version
    if version != dist.version:
        stamp(os.path.join(site, "qlib", "version.py"), version)
    info = os.path.join(site, f"{DISTRIBUTION.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info)
    for name in ("METADATA", "entry_points.txt"):
        text = dist.read_text(name) or ""
        if name == "METADATA":
            text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", text, count=1)
        with open(os.path.join(info, name), "w") as f:
            f.write(text)


def stamp(path: str, version: str) -> None:
    """qlib/version.py's VERSION set to `version`."""
    if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+_-]*", version):
        raise PayloadError(f"--version {version!r}: letters, digits and . + _ - only")
    with open(path) as f:
        text, n = re.subn(r'(?m)^VERSION = ".*"$', f'VERSION = "{version}"', f.read())
    if n != 1:
        raise PayloadError(f"{path}: no VERSION line to stamp")
    with open(path, "w") as f:
        f.write(text)


def pins(name: str, extras: tuple[str, ...] = ()) -> list[str]:
    """name's requirements, and theirs, as `name==version` of what the venv has: the closure pip
    installs with --no-deps (the venv was made with the system's site packages: the first found
    is the venv's own, which is what quark runs with)."""
    from packaging.requirements import Requirement
    seen: dict[str, str] = {}
    todo = [(name, extras)]
    while todo:
        dist_name, dist_extras = todo.pop()
        dist = importlib.metadata.distribution(dist_name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in dist_extras or ("",)):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen[key] = importlib.metadata.distribution(req.name).version
                todo.append((req.name, tuple(req.extras)))
    return [f"{k}=={v}" for k, v in sorted(seen.items())]


def write_programs(stage: str) -> None:
    for rel, (module, func) in PROGRAMS.items():
        path = os.path.join(stage, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"#!{PREFIX}/bin/{PYVER}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        os.chmod(path, 0o755)


def build_frontend(stage: str) -> None:
    exe = os.path.join(stage, "bin", "quark")
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", f'-DQUARK_PY="{PREFIX}/libexec/quark"',
                    f'-DQUARK_SHIM_PY="{PREFIX}/libexec/containerd-shim-quark-v1"', "-o", exe,
                    os.path.join(REPO, "qvisor", "frontend.c")], check=True)
    os.link(exe, os.path.join(stage, "bin", "containerd-shim-quark-v1"))


def is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def ldd(path: str) -> dict[str, str]:
    """soname -> the file this machine's loader resolves it to (the loader itself included)."""
    r = subprocess.run(["ldd", path], capture_output=True, text=True)
    found = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+) => (/\S+) \(", line) or re.match(r"\s*(/\S+) \(", line)
        if m and len(m.groups()) == 2:
            found[m.group(1)] = m.group(2)
        elif m:
            found[os.path.basename(m.group(1))] = m.group(1)
        elif "=> not found" in line:
            raise PayloadError(f"{path}: {line.strip()}")
    return found


def system_library(soname: str) -> str:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        if os.path.exists(os.path.join(d, soname)):
            return os.path.join(d, soname)
    raise PayloadError(f"{soname}: not found on this machine (its package is in the Makefile's APT_PACKAGES)")


def bundle_libraries(stage: str, python: str) -> None:
    """Every library the payload's ELF files need, copied into lib/; the executables made to use
    lib/'s loader, and every ELF file with a search path of its own to search lib/ as well."""
    libdir = os.path.join(stage, "lib")
    elves = [os.path.join(d, n) for d, _, names in os.walk(stage) for n in names
             if not os.path.islink(os.path.join(d, n)) and is_elf(os.path.join(d, n))]
    needed: dict[str, str] = {s: system_library(s) for s in DLOPENED}
    for path in elves + list(needed.values()):   # ldd names a file's whole closure
        needed.update(ldd(path))
    loader = ""
    for soname, src in sorted(needed.items()):
        if soname.startswith("linux-vdso") or os.path.realpath(src).startswith(os.path.realpath(stage)):
            continue
        shutil.copy2(os.path.realpath(src), os.path.join(libdir, soname))
        if soname.startswith("ld-linux"):
            loader = f"{PREFIX}/lib/{soname}"
    if not loader:
        raise PayloadError(f"{python}: ldd named no dynamic loader")
    frontend = os.path.join(stage, "bin", "quark")
    # lib/ searched relative to each file ($ORIGIN: the file's real directory, the executable's
    # found through /proc/self/exe), so that a process keeps loading its own version's libraries
    # after a node's upgrade made another version current (deploy/versions.py)
    for exe in (python, frontend):
        subprocess.run(["patchelf", "--set-interpreter", loader, "--force-rpath", "--set-rpath",
                        "$ORIGIN/../lib", exe], check=True)
    for path in elves:
        if path in (python, frontend):
            continue
        runpath = subprocess.run(["patchelf", "--print-rpath", path], capture_output=True, text=True).stdout.strip()
        if runpath:   # a wheel's $ORIGIN/... path: searched before the executable's, so add lib/ to it
            lib = "$ORIGIN/" + os.path.relpath(libdir, os.path.dirname(path))
            subprocess.run(["patchelf", "--set-rpath", f"{runpath}:{lib}", path], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="payload", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the directory to build (copied to /opt/quark by deploy/install.py)")
    p.add_argument("--version", default=None, help="stamp the payload as this quark version (default: the tree's)")
    args = p.parse_args(argv)
    try:
        build(args.out, args.version)
    except (PayloadError, OSError, subprocess.CalledProcessError) as e:
        print(f"payload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
