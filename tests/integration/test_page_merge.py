"""supervisor.memory_merge (qvisor/page_merge.py): with the operator's setting, each supervisor
offers its memory to the kernel's samepage merging (KSM) and the container's processes never do."""
from __future__ import annotations

import os
import time

import pytest

from qlib.procfs import parent_pid
from tests.support import ksm

pytestmark = pytest.mark.root


def _config(tmp_path, text: str) -> dict:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return dict(os.environ, QUARK_CONFIG=str(p))


def _ksm(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/ksm_stat") as f:
        return dict(line.split(None, 1) for line in f.read().replace(":", "").splitlines())


def _up(quark, bundle, env: dict, cid: str) -> tuple[int, int]:
    quark("create", "--bundle", bundle(["sleep", "1000"]), cid, env=env)
    quark("start", cid, env=env)
    init = quark.state(cid)["pid"]
    return parent_pid(init), init


def test_the_supervisor_offers_its_pages_and_the_containers_processes_never_do(quark, bundle, tmp_path):
    env = _config(tmp_path, "supervisor:\n  memory_merge: true\n")
    sup, init = _up(quark, bundle, env, "pm1")
    assert _ksm(sup)["ksm_merge_any"] == "yes"
    assert _ksm(init)["ksm_merge_any"] == "no"   # the mark passes through fork and exec: taken off
    r = quark("exec", "pm1", "cat", "/proc/self/ksm_stat", env=env)
    assert "ksm_merge_any: no" in r.stdout, r.stdout
    quark("delete", "--force", "pm1", env=env)


def test_without_the_setting_nothing_is_offered(quark, bundle, tmp_path):
    env = _config(tmp_path, "supervisor:\n  memory_merge: false\n")
    sup, _ = _up(quark, bundle, env, "pm2")
    assert _ksm(sup)["ksm_merge_any"] == "no"
    quark("delete", "--force", "pm2", env=env)


@pytest.mark.parametrize("text, field", [
    ("supervisor:\n  memory_merge: often\n", "supervisor.memory_merge"),
    ("supervisor:\n  merge: true\n", "supervisor.merge"),
    ("supervisor: true\n", "supervisor"),
])
def test_a_bad_setting_fails_create_naming_the_file_and_field_and_leaves_nothing(quark, bundle, tmp_path, text, field):
    env = _config(tmp_path, text)
    r = quark("create", "--bundle", bundle(["true"]), "pm3", env=env, check=False)
    assert r.returncode != 0
    assert str(tmp_path / "config.yaml") in r.stderr and field in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert quark.ids() == []


@pytest.fixture
def ksmd():
    """The host's ksmd running for the test, fast; put back as it was (and everything it merged
    unmerged) after. Skipped when the host already uses KSM: the test would disturb it."""
    try:
        ksm.check_unused()
    except OSError:
        pytest.skip("needs a kernel with KSM (/sys/kernel/mm/ksm)")
    except ksm.InUse as e:
        pytest.skip(f"{e}: this test would change it")
    with ksm.running():
        yield


def test_ksmd_merges_the_supervisors_pages_and_none_of_the_containers(quark, bundle, tmp_path, ksmd):
    env = _config(tmp_path, "supervisor:\n  memory_merge: true\n")
    procs = [_up(quark, bundle, env, f"pk{i}") for i in range(3)]
    deadline = time.monotonic() + 60
    merged = 0
    while time.monotonic() < deadline:
        merged = min(int(_ksm(sup)["ksm_merging_pages"]) for sup, _ in procs)
        if merged > 100:
            break
        time.sleep(0.5)
    assert merged > 100, [_ksm(sup) for sup, _ in procs]
    assert all(int(_ksm(init)["ksm_merging_pages"]) == 0 for _, init in procs)
    for i in range(3):
        quark("delete", "--force", f"pk{i}", env=env)
