"""zpp.utils.process.watch_parent: a child whose parent died before the child could watch it (still
importing) exits at once instead of living on as an orphan."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

WATCHED_CHILD = ("import sys, time\nfrom zpp.utils.process import watch_parent\nwatch_parent()\n"
                 "print('watching', flush=True)\ntime.sleep(0.2)\n")


@pytest.mark.slow
def test_watch_parent_when_the_parent_died_first():
    """The parent's pid, given by the parent (ZPP_PARENT_PID, or multiprocessing's record), is what
    counts: a child whose recorded parent is not its parent any more exits 1 at once."""
    from zpp.utils.process import PARENT_PID_ENV
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ok = subprocess.run([sys.executable, "-c", WATCHED_CHILD], env={**env, PARENT_PID_ENV: str(os.getpid())},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "watching" in ok.stdout, ok.stderr
    # As if its parent had died while it started: it has been re-parented, the recorded pid differs.
    orphan = subprocess.run([sys.executable, "-c", WATCHED_CHILD], env={**env, PARENT_PID_ENV: "1"},
                            capture_output=True, text=True, timeout=60)
    assert orphan.returncode == 1 and "watching" not in orphan.stdout, orphan.stderr
    # It does not pass the variable on to its own children.
    code = "from zpp.utils.process import expected_parent; import os; expected_parent(); print(os.environ.get('%s'))"
    r = subprocess.run([sys.executable, "-c", code % PARENT_PID_ENV], env={**env, PARENT_PID_ENV: str(os.getpid())},
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "None", r.stderr
