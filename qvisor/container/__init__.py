"""Container operations behind the CLI verbs (and usable as a library, e.g. by the shim): one module
per verb, as qvisor/commands/ has one per command, so a verb imports only its own
(`from qvisor.container.start import start`).

Every function takes the state root and the container id, validates the container's status the
way runc does, and raises a QuarkError subclass that says what is wrong.
  common.py    what several verbs share: a container's state, its saved config, --preserve-fds
  create.py    the supervisor started (qvisor/birth.py) and its report read
  start.py  wait.py  kill.py  delete.py  pause.py  resume.py  ps.py  update.py  exec.py
  events.py    the cgroup statistics of `events --stats` and of the shim's Stats
  snapshot.py  hibernate, wake and the snapshot's account (the supervisor does the work)
"""
