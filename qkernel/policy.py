"""Builds and installs the container's seccomp filters: quark's base policy and the bundle's own.

Two filters are stacked rather than merged. For every syscall the kernel runs all filters of the
task and takes the most restrictive action (KILL > TRAP > ERRNO > USER_NOTIF > TRACE > LOG > ALLOW),
so "the stricter of quark's policy and the bundle's linux.seccomp wins" is the kernel's own rule.
Between equally strict answers (two ERRNOs) the newest filter's is kept: the bundle's errno.
"""
from __future__ import annotations

import errno
import os

import seccomp

from qkernel import table
from qkernel.config import check_platform
from qkernel.errors import FilterError

# SECCOMP_RET_DATA of quark's TRACE rules; a bundle's own SCMP_ACT_TRACE rules carry other data.
TRACE_DATA = 0x5155
_ARCHES = {"x86_64": seccomp.Arch.X86_64, "aarch64": seccomp.Arch.AARCH64}
_OPS = {"SCMP_CMP_NE": seccomp.NE, "SCMP_CMP_LT": seccomp.LT, "SCMP_CMP_LE": seccomp.LE,
        "SCMP_CMP_EQ": seccomp.EQ, "SCMP_CMP_GE": seccomp.GE, "SCMP_CMP_GT": seccomp.GT,
        "SCMP_CMP_MASKED_EQ": seccomp.MASKED_EQ}
_FLAGS = {"SECCOMP_FILTER_FLAG_TSYNC": seccomp.Attr.CTL_TSYNC,
          "SECCOMP_FILTER_FLAG_LOG": seccomp.Attr.CTL_LOG,
          "SECCOMP_FILTER_FLAG_SPEC_ALLOW": seccomp.Attr.CTL_SSB}


def install_filter(oci_seccomp, platform: str, no_new_privileges: bool, sockets: bool,
                   caps: frozenset[str] = frozenset(), own_namespaces: frozenset[str] = frozenset(),
                   sockopt_offload: bool = False, sockmap: bool = False, channel_fd: int | None = None) -> int | None:
    """Install quark's filter, then the bundle's; return the listener fd (seccomp) or None (ptrace).

    Called in the container process right before execve. Without no_new_privileges the process
    needs CAP_SYS_ADMIN (in its user namespace) to load a filter, as with runc. `sockets`: the
    sandbox is served by TSoR, so its socket calls are trapped (otherwise they all run natively).
    `sockopt_offload`: TCP_NODELAY/TCP_CORK of its local-path sockets are the kernel's to answer
    (tsor/sockopt_offload.py), so setsockopt of those is not trapped. `sockmap`: TSoR serves it
    with tsord's sockmap path, which traps only shutdown (qkernel/table.py says why). `channel_fd`:
    the socket this process hands its listener to the supervisor on, with sendmsg, right after this
    filter is loaded: its sendmsg must not wait for a supervisor that has no listener yet.
    `caps` (the process's bounding set) and `own_namespaces` (kinds the container has its own of)
    decide the capability grants of the table (table.Grant).
    """
    check_platform(platform)
    # Build both before loading either, so a bad bundle profile fails with nothing installed.
    base = build_base_filter(platform, sockets, caps, own_namespaces, sockopt_offload, sockmap, channel_fd)
    bundle = build_bundle_filter(oci_seccomp) if oci_seccomp is not None else None
    for f in (base, bundle):
        if f is not None:
            f.set_attr(seccomp.Attr.CTL_NNP, 1 if no_new_privileges else 0)
    _load(base, "quark's base policy")
    listener = base.get_notify_fd() if platform == "seccomp" else None
    if bundle is not None:
        try:
            _load(bundle, "the bundle's linux.seccomp")
        except FilterError:
            if listener is not None:
                os.close(listener)
            raise
    return listener


_COMPARE = {"lt": seccomp.LT, "gt": seccomp.GT}


def build_base_filter(platform: str, sockets: bool = True, caps: frozenset[str] = frozenset(),
                      own_namespaces: frozenset[str] = frozenset(),
                      sockopt_offload: bool = False, sockmap: bool = False,
                      channel_fd: int | None = None) -> seccomp.SyscallFilter:
    arch = table.native_arch()
    if arch not in _ARCHES:
        raise FilterError(f"no syscall table for architecture {arch}")
    # Other ABIs on this kernel (i386 int 0x80, x32) are not in the table: a task using one is
    # killed rather than let through unfiltered (gVisor does not run them either).
    f = seccomp.SyscallFilter(seccomp.ALLOW)
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    trap = seccomp.NOTIFY if platform == "seccomp" else seccomp.TRACE(TRACE_DATA)
    for sc in table.table():
        nr = sc.nr(arch)
        if nr is None or sc.fate is table.Fate.NATIVE:
            continue
        if sc.fate is table.Fate.TRAPPED:
            if (sc.tsor_only and not sockets) or (sc.sockmap_only and not sockmap):
                continue
            only = sc.offloaded_only if sockopt_offload and sc.offloaded_only is not None else sc.only
            if only is None and channel_fd is not None and sc.channel_exempt:
                # every fd but the channel's (closed at exec; a later fd of that number escapes the
                # trap, and SO_PASSRIGHTS on local-path ends still stops any fd there)
                f.add_rule(trap, nr, seccomp.Arg(0, seccomp.NE, channel_fd))
            elif only is None:
                f.add_rule(trap, nr)
            for pattern in only.patterns if only is not None else ():
                f.add_rule(trap, nr, *(seccomp.Arg(c[0], _COMPARE[c[2]] if len(c) > 2 else seccomp.EQ, c[1])
                                       for c in pattern))
        else:
            granted = sc.granted(caps, own_namespaces)
            # a grant's trapped patterns: the handler decides (e.g. which filesystem a new mount makes)
            for index, mask, value in sc.grant.trapped if granted else ():
                f.add_rule(trap, nr, seccomp.Arg(index, seccomp.MASKED_EQ, mask, value))
            if sc.applies(caps, own_namespaces):   # else granted, or only denied to holders of a
                add_denial(f, sc, nr, granted=granted)   # capability this process lacks
    return f


def add_denial(f: seccomp.SyscallFilter, sc: table.Syscall, nr: int | str, granted: bool = False) -> None:
    """The ERRNO rule(s) of a DENIED entry; a granted one keeps only its still-denied argument patterns."""
    err = seccomp.ERRNO(sc.errno)
    if granted:
        for index, mask, value in sc.grant.still_denied:
            f.add_rule(err, nr, seccomp.Arg(index, seccomp.MASKED_EQ, mask, value))
    elif sc.when is not None:
        f.add_rule(err, nr, seccomp.Arg(sc.when.index, seccomp.MASKED_EQ, sc.when.mask, sc.when.match))
    else:
        f.add_rule(err, nr)


def build_bundle_filter(spec) -> seccomp.SyscallFilter:
    """The bundle's linux.seccomp (a qvisor.spec.Seccomp) as a libseccomp filter, as runc reads it."""
    if spec.listener_path:
        raise FilterError("linux.seccomp.listenerPath: quark's own filter holds the seccomp "
                          "listener (the kernel allows one per task); SCMP_ACT_NOTIFY is not supported")
    default = _action(spec.default_action, spec.default_errno_ret, "linux.seccomp.defaultAction")
    f = seccomp.SyscallFilter(default)
    for name in spec.architectures:
        arch = getattr(seccomp.Arch, name.removeprefix("SCMP_ARCH_"), None)
        if arch is None:
            raise FilterError(f"linux.seccomp.architectures: unknown architecture {name!r}")
        if not f.exist_arch(arch):
            f.add_arch(arch)
    for flag in spec.flags:
        if flag not in _FLAGS:
            raise FilterError(f"linux.seccomp.flags: unsupported flag {flag!r}")
        f.set_attr(_FLAGS[flag], 1)
    for i, rule in enumerate(spec.syscalls):
        where = f"linux.seccomp.syscalls[{i}]"
        action = _action(rule.action, rule.errno_ret, f"{where}.action")
        if rule.action == spec.default_action and rule.errno_ret == spec.default_errno_ret:
            continue   # libseccomp refuses rules that repeat the default; runc skips them too
        conds = []
        for arg in rule.args:
            if arg.op not in _OPS:
                raise FilterError(f"{where}.args: unknown operator {arg.op!r}")
            conds.append(seccomp.Arg(arg.index, _OPS[arg.op], arg.value, arg.value_two))
        # libseccomp cannot AND two comparisons of one argument; like runc, OR them instead.
        indexes = [a.index for a in rule.args]
        groups = [[c] for c in conds] if len(set(indexes)) != len(indexes) else [conds]
        for name in rule.names:
            if table.resolve(seccomp.Arch.NATIVE, name) is None:
                continue   # unknown to this libseccomp: ignored, as runc does
            for group in groups:
                try:
                    # by name: libseccomp maps it to each architecture's own number
                    f.add_rule(action, name, *group)
                except RuntimeError as e:
                    raise FilterError(f"{where}: cannot add a rule for {name}: {e}") from e
    return f


def _action(name: str, errno_ret: int | None, where: str):
    if name in ("SCMP_ACT_KILL", "SCMP_ACT_KILL_THREAD"):
        return seccomp.KILL
    if name == "SCMP_ACT_KILL_PROCESS":
        return seccomp.KILL_PROCESS
    if name == "SCMP_ACT_TRAP":
        return seccomp.TRAP
    if name == "SCMP_ACT_ERRNO":
        return seccomp.ERRNO(errno.EPERM if errno_ret is None else errno_ret)
    if name == "SCMP_ACT_TRACE":
        return seccomp.TRACE(errno.EPERM if errno_ret is None else errno_ret)
    if name == "SCMP_ACT_ALLOW":
        return seccomp.ALLOW
    if name == "SCMP_ACT_LOG":
        return seccomp.LOG
    if name == "SCMP_ACT_NOTIFY":
        raise FilterError(f"{where}: SCMP_ACT_NOTIFY is not supported (quark's filter holds the listener)")
    raise FilterError(f"{where}: unknown action {name!r}")


def _load(f: seccomp.SyscallFilter, what: str) -> None:
    try:
        f.load()
    except RuntimeError as e:
        hint = (" (without noNewPrivileges the process needs CAP_SYS_ADMIN to load a filter)"
                if f"-{errno.EACCES})" in str(e) else "")
        raise FilterError(f"loading {what} failed: {e}{hint}") from e
