"""The shim's OOM events (shim/oom.py): one TaskOOM per kill the cgroup's counter shows, none
twice, none after the container is deleted; the exit path's flush is what puts them before the
TaskExit (test_shim_containerd.py::test_oom_event_and_exit checks the order through containerd)."""
from __future__ import annotations

from shim.oom import OomWatch


def _v1(d, kills: int) -> None:
    (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")


def _v2(d, kills: int) -> None:
    (d / "memory.events").write_text(f"low 0\nhigh 0\nmax 4\noom 2\noom_kill {kills}\noom_group_kill 0\n")


def test_each_kill_is_published_once_in_either_cgroup_version(tmp_path):
    for v2, write in ((False, _v1), (True, _v2)):
        d = tmp_path / ("v2" if v2 else "v1")
        d.mkdir()
        write(d, 1)   # before the watch: not this container's (the counter is the cgroup's)
        published = []
        w = OomWatch(str(d), v2, lambda: published.append("oom"))
        w.flush()
        assert published == []
        write(d, 3)
        w.flush()
        w.flush()   # the watcher thread and the exit path both flush: no kill twice
        assert published == ["oom", "oom"]


def test_nothing_is_published_after_close_or_once_the_cgroup_is_gone(tmp_path):
    _v1(tmp_path, 0)
    published = []
    w = OomWatch(str(tmp_path), False, lambda: published.append("oom"))
    (tmp_path / "memory.oom_control").unlink()
    assert w.kills() is None
    w.flush()
    _v1(tmp_path, 2)
    w.close()   # the container was deleted: a late wake-up publishes nothing
    w.flush()
    assert published == []
