"""Pods quark-cni registered with tsord: who a pod is (its sandbox id, Kubernetes name, namespace
and uid), which network namespace it has and which addresses the CNI chain gave it.

tsord checks a registration with the kernel, as it checks a sandbox's hello (identity.py): the
netns path must be a network namespace other than the node's, and every address must be configured
in it. Registrations are kept in a file (`state_dir/pods.json`, written whole and renamed into
place) so a restarted tsord knows them again; at start it drops those whose namespace is gone
(the pod was deleted while tsord was down) or is another one now (the path was reused).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass

from tsor import kernel_sockets
from tsor.addr import unmapped
from tsor.errors import NotAllowed

log = logging.getLogger("tsor.pods")
MAX_PODS = 4096


@dataclass(frozen=True)
class Pod:
    sandbox: str
    ifname: str
    netns: str           # the path CNI was given
    netns_inode: int     # what it named then: a reused path names another namespace
    ips: tuple[str, ...]
    name: str = ""
    namespace: str = ""
    uid: str = ""

    @property
    def key(self) -> str:
        return f"{self.sandbox}/{self.ifname}"

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}" if self.name else self.sandbox


def check_claim(netns: str, ips: list[str], own_netns: int) -> tuple[int, tuple[str, ...]]:
    """The namespace's inode and the claimed addresses, once the kernel confirms them; NotAllowed
    naming what is wrong otherwise."""
    try:
        inode, owned = kernel_sockets.netns_file(netns)
    except FileNotFoundError:
        raise NotAllowed(f"netns {netns}: no such file") from None
    except (ValueError, OSError) as e:
        raise NotAllowed(f"netns {netns}: {e}") from None
    if inode == own_netns:
        raise NotAllowed(f"netns {netns} is the node's own network namespace")
    claimed = tuple(sorted({unmapped(a) for a in ips}))
    foreign = set(claimed) - {unmapped(a) for a in owned}
    if foreign:
        raise NotAllowed(f"addresses not in netns {netns}: {sorted(foreign)}")
    return inode, claimed


class PodRegistry:
    def __init__(self, state_file: str | None) -> None:
        self.state_file = state_file
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()   # one writer of the file at a time, newest state last
        self._pods: dict[str, Pod] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def load(self) -> None:
        """The registrations a previous tsord kept, less those whose namespace is gone or changed."""
        if self.state_file is None:
            return
        try:
            with open(self.state_file, encoding="utf-8") as f:
                saved = json.load(f)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable (%s): starting with no pods", self.state_file, e)
            return
        kept = {}
        for raw in saved.get("pods", []) if isinstance(saved, dict) else []:
            try:
                pod = Pod(**{**raw, "ips": tuple(raw["ips"])})
                inode = os.stat(pod.netns).st_ino
            except (TypeError, KeyError):
                log.warning("%s: a malformed entry dropped: %r", self.state_file, raw)
                continue
            except OSError:
                log.info("pod %s: its netns %s is gone; dropped", pod.label, pod.netns)
                continue
            if inode != pod.netns_inode:
                log.info("pod %s: %s names another namespace now; dropped", pod.label, pod.netns)
                continue
            kept[pod.key] = pod
        with self._lock:
            self._pods = kept
        self._save()
        log.info("%d pod registrations kept from %s", len(kept), self.state_file)

    def add(self, pod: Pod) -> None:
        """Register `pod` (replacing an earlier registration of the same sandbox and interface);
        NotAllowed if another pod's namespace holds one of its addresses."""
        with self._lock:
            other = self._held_elsewhere(set(pod.ips), pod.netns_inode, besides=pod.key)
            if other is not None:
                raise NotAllowed(f"addresses {sorted(set(other.ips) & set(pod.ips))} belong to pod {other.label}")
            if pod.key not in self._pods and len(self._pods) >= MAX_PODS:
                raise NotAllowed(f"{MAX_PODS} pods are registered already")
            self._pods[pod.key] = pod
        self._save()

    def remove(self, key: str) -> bool:
        with self._lock:
            existed = self._pods.pop(key, None) is not None
        if existed:
            self._save()
        return existed

    def get(self, key: str) -> Pod | None:
        return self._pods.get(key)

    def claimed_elsewhere(self, addrs: set[str], inode: int) -> Pod | None:
        """A pod of another network namespace registered with one of `addrs`."""
        with self._lock:
            return self._held_elsewhere(addrs, inode)

    def _held_elsewhere(self, addrs: set[str], inode: int, besides: str | None = None) -> Pod | None:
        return next((p for p in self._pods.values()
                     if p.key != besides and p.netns_inode != inode and addrs & set(p.ips)), None)

    def by_netns(self, inode: int) -> Pod | None:
        with self._lock:
            return next((p for p in self._pods.values() if p.netns_inode == inode), None)

    def gc(self, keep: set[str]) -> list[str]:
        """Forget every registration the runtime no longer has (CNI GC's valid attachments)."""
        with self._lock:
            gone = [k for k in self._pods if k not in keep]
            for k in gone:
                del self._pods[k]
        if gone:
            self._save()
        return gone

    def _save(self) -> None:
        if self.state_file is None:
            return
        with self._file_lock:
            with self._lock:
                data = json.dumps({"pods": [asdict(p) for p in self._pods.values()]}, indent=1)
            os.makedirs(os.path.dirname(self.state_file), mode=0o700, exist_ok=True)
            tmp = f"{self.state_file}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
            os.rename(tmp, self.state_file)
