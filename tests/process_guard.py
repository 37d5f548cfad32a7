"""A pytest plugin (loaded by tests/conftest.py) that keeps the fast tier fast: a test not marked
``slow`` fails if it, or a fixture it sets up, starts a process.

Watched, cheaply (no audit hook, which would run on every ``open`` and ``id()``): every
``subprocess`` call (``Popen._execute_child``, which ``run``, ``check_output`` ... go through),
``multiprocessing`` and ``concurrent.futures.ProcessPoolExecutor`` processes of any start method
(``BaseProcess.start``), ``os.fork`` (``os.register_at_fork``), ``os.posix_spawn[p]`` and
``os.system``. (``platform.uname()``'s one ``uname -p`` per process runs before any test.) A module-scoped fixture that starts a server is charged to the first test that asks
for it, which is the one to mark.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

_recorders: list[list[str]] = []  # one per watched phase in progress (a nested pytester run adds one)
_installed = False


def _record(what: str) -> None:
    for r in _recorders:
        r.append(what)


def _unwatch(seen: list[str]) -> None:
    for i, r in enumerate(_recorders):
        if r is seen:  # by identity: two recorders may hold equal lists
            del _recorders[i]
            return


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    execute_child = subprocess.Popen._execute_child

    def _execute_child(self, args, executable, *rest, **kw):
        _record(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))!r}"[:200])
        return execute_child(self, args, executable, *rest, **kw)
    subprocess.Popen._execute_child = _execute_child

    start = multiprocessing.process.BaseProcess.start

    def _start(self):
        _record(f"multiprocessing process {self.name!r} (target {getattr(self, '_target', None)!r})"[:200])
        return start(self)
    multiprocessing.process.BaseProcess.start = _start

    os.register_at_fork(before=lambda: _record("os.fork()"))
    for name in ("posix_spawn", "posix_spawnp", "system"):
        original = getattr(os, name, None)
        if original is not None:
            def wrapper(*a, _original=original, _name=name, **kw):
                _record(f"os.{_name}({a[0]!r})"[:200])
                return _original(*a, **kw)
            setattr(os, name, wrapper)


def pytest_configure(config):
    # platform.uname() runs `uname -p` once per process, for whichever caller asks first (the openai
    # client does, for its headers): run it now so that no test is charged for it.
    import platform
    platform.uname().processor  # noqa: B018  (computed once, cached on the one uname_result)
    _install()


def _recording(item, fresh: bool):
    """Record the processes started while the hook's phase runs into the item's list (a new one
    when ``fresh``, at setup)."""
    seen = None if fresh else getattr(item, "_started_processes", None)
    if seen is None:
        item._started_processes = seen = []
    _recorders.append(seen)
    try:
        yield
    finally:
        _unwatch(seen)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _recording(item, fresh=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _recording(item, fresh=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seen = getattr(item, "_started_processes", None)
    if call.when != "call" or not seen or item.get_closest_marker("slow") is not None or report.failed:
        return
    first = seen[0]
    more = f" (and {len(seen) - 1} more)" if len(seen) > 1 else ""
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} started a process but is not marked slow: {first}{more}. Tests that "
                       f"start a process belong to the slow tier: add @pytest.mark.slow (tests/process_guard.py)")
