"""`quark start ID` through the C front end goes straight to the container's supervisor
(qvisor/frontend.c direct_start): no factory, no Python. What only the CLI does — poststart hooks,
the words for a container that cannot start — still goes through the CLI, exactly as before."""
from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from tests.integration.conftest import edit_config
from tests.integration.test_bad_input import failing_start_bundle

pytestmark = pytest.mark.root
FRONT_END = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "qvisor", "_quark")


@pytest.fixture
def env(tmp_path):
    """No factory (so the usual way runs the Python CLI), and every Python that starts leaves a mark.
    Creates run with QUARK_FACTORY=0 (_create), so that none starts one."""
    assert os.access(FRONT_END, os.X_OK), "the front end is built by `make install` (make frontend)"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(tmp_path / 'python-ran')!r}, 'a').write('x')\n")
    return dict(os.environ, QUARK_FACTORY_DIR=str(tmp_path / "no-factory"), PYTHONPATH=str(site))


def _run(quark, env, *args) -> subprocess.CompletedProcess:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.run([FRONT_END, "--root", quark.root, *args], env=env, stdout=out, stderr=err,
                           stdin=subprocess.DEVNULL, timeout=60)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())


def _create(quark, env, b: str, cid: str) -> None:
    r = _run(quark, dict(env, QUARK_FACTORY="0"), "create", "--bundle", b, cid)
    assert r.returncode == 0, r.stderr


def _python_ran(tmp_path) -> bool:
    ran = (tmp_path / "python-ran").exists()
    if ran:
        (tmp_path / "python-ran").unlink()
    return ran


def test_start_reaches_the_supervisor_without_python(quark, bundle, tmp_path, env):
    b = bundle(["sh", "-c", "echo started > /tmp/mark; sleep 100"])
    edit_config(b, lambda s: s["root"].update(readonly=False))
    _create(quark, env, b, "fs1")
    assert _python_ran(tmp_path)   # create: the CLI
    r = _run(quark, env, "start", "fs1")
    assert r.returncode == 0, r.stderr
    assert not _python_ran(tmp_path)
    assert quark.state("fs1")["status"] == "running"
    # a second start is refused in the CLI's words: the supervisor sent the front end back
    r = _run(quark, env, "start", "fs1")
    assert r.returncode == 1 and r.stderr == "quark: cannot start a container in the running state\n", r.stderr
    assert _python_ran(tmp_path)
    quark("delete", "--force", "fs1")


def test_a_failed_start_is_reported_as_the_cli_reports_it(quark, bundle, tmp_path, env):
    errors = []
    for cid, e in (("fs2", env), ("fs3", dict(env, QUARK_FACTORY="0"))):   # direct, then the CLI
        _create(quark, env, failing_start_bundle(bundle), cid)
        _python_ran(tmp_path)
        r = _run(quark, e, "start", cid)
        assert r.returncode == 1
        errors.append(r.stderr)
        assert _python_ran(tmp_path) == (cid == "fs3")
        quark("delete", "--force", cid)
    assert errors[0] == errors[1] and "startContainer" in errors[0], errors


def test_poststart_hooks_still_run_through_the_cli(quark, bundle, tmp_path, env):
    mark = tmp_path / "poststart"
    b = bundle(["sleep", "100"])
    edit_config(b, lambda s: s.update(hooks={"poststart": [
        {"path": "/bin/sh", "args": ["sh", "-c", f"cat > {mark}"]}]}))
    _create(quark, env, b, "fs4")
    _python_ran(tmp_path)
    r = _run(quark, env, "start", "fs4")
    assert r.returncode == 0, r.stderr
    assert _python_ran(tmp_path)   # the supervisor sent it back before starting anything
    assert '"id": "fs4"' in mark.read_text() and quark.state("fs4")["status"] == "running"
    quark("delete", "--force", "fs4")
