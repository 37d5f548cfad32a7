"""Process helpers shared by every zpp process (front end, engine core, workers, node agent).

- :func:`main_module_hidden`, :func:`sigint_blocked`: context managers around spawning children
  (no re-run of the user's ``__main__``; children start with SIGINT blocked).
- :func:`watch_parent`: a child dies with its parent (``PR_SET_PDEATHSIG`` and a polling thread),
  also one whose parent died while it started (:func:`expected_parent`).
- :func:`set_pdeathsig`: only the kernel's half of that (for forked children).
- :func:`freeze_gc`: after start-up, keep full garbage collections short.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time


def set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL this process when its parent thread exits (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


PARENT_PID_ENV = "ZPP_PARENT_PID"
"""Set by a zpp process in the environment of a child it starts with ``subprocess`` (not
multiprocessing): the pid the child must have as its parent (:func:`expected_parent`)."""


def expected_parent() -> int:
    """The pid of the process that started this one, as that process said it (not ``os.getppid()``,
    which is already init's or a subreaper's pid when the parent died before this child got here):
    multiprocessing's record of the parent in a spawned child, else ``$ZPP_PARENT_PID`` (removed
    from the environment, so that this process's own children do not inherit it), else
    ``os.getppid()``."""
    import multiprocessing

    from zpp import envs
    try:
        pid = envs.ZPP_PARENT_PID
    except ValueError:  # not a number: not ours to trust
        pid = None
    os.environ.pop(PARENT_PID_ENV, None)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid:
        return parent.pid
    if pid is not None and pid > 0:
        return pid
    return os.getppid()


def watch_parent(poll_s: float = 0.5) -> None:
    """Exit this process (status 1) as soon as its parent dies, even by SIGKILL, and at once when
    the parent died before this call (the child was still starting: importing, unpickling).

    Args:
        poll_s: seconds between checks of the polling thread (the kernel's ``PR_SET_PDEATHSIG``
            acts at once; the thread covers a parent whose spawning thread ended first).
    """
    parent = expected_parent()
    set_pdeathsig()
    if os.getppid() != parent:  # the parent died before PR_SET_PDEATHSIG was set
        os._exit(1)

    def loop():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=loop, name="zpp-parent-watch", daemon=True).start()


def freeze_gc() -> None:
    """Collect once, then move every object alive now (modules, weights' wrappers, CUDA graphs'
    Python state...) out of the cyclic garbage collector's reach (``gc.freeze``), as vLLM does after
    start-up: a full collection otherwise walks them all, which stalled a worker ~90 ms a few times
    per run at 1000 running requests (seen as GPU gaps in a ``ZPP_TRACE`` timeline)."""
    import gc
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def main_module_hidden():
    """Spawn workers without re-running the user's ``__main__`` in them.

    multiprocessing's spawn re-imports the parent's main script in every child, so a script that
    creates an ``LLM`` at top level without an ``if __name__ == "__main__"`` guard would recurse.
    Workers need nothing from ``__main__`` (their target is a zpp function), so hide it while
    starting them.
    """
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__file__", "__spec__") if main is not None and hasattr(main, k)}
    try:
        for k in saved:
            if k == "__file__":
                delattr(main, k)
            else:
                setattr(main, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


@contextlib.contextmanager
def sigint_blocked():
    """Block SIGINT in the calling thread while it spawns child processes.

    Children inherit the signal mask through fork and exec, so a child starts with SIGINT blocked
    and a terminal's Ctrl-C (sent to the whole process group) never reaches it, not even while it
    imports, before it could ignore the signal (it would print a KeyboardInterrupt traceback and
    die, racing the parent's orderly stop). Every zpp child leaves stopping to its parent. A SIGINT
    that arrives here meanwhile stays pending and is handled when the block ends: none is lost.
    """
    # The first spawn starts multiprocessing's resource tracker, and starting it unblocks SIGINT
    # (SIG_UNBLOCK, not a restore): start it before blocking, or the first child would not be.
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
