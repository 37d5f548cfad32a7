"""tests/process_guard.py (the conftest's plugin that keeps the fast tier free of processes): a test
session in this process (pytester) with tests that start processes every way the guard watches;
those not marked ``slow`` fail, naming themselves and what they started."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

_TESTS = '''
import multiprocessing, os, subprocess, sys
import pytest

def test_subprocess_run():
    subprocess.run(["true"], check=True)

def test_os_system():
    assert os.system("true") == 0

def test_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def test_multiprocessing_spawn():
    p = multiprocessing.get_context("spawn").Process(target=os.getpid, name="guarded-child")
    p.start()
    p.join(60)
    assert p.exitcode == 0

@pytest.fixture
def server():
    proc = subprocess.Popen(["sleep", "0.01"])
    yield proc
    proc.wait()

def test_uses_a_fixture_that_starts_a_process(server):
    pass

@pytest.mark.slow
def test_marked_slow(server):
    subprocess.run(["true"], check=True)

def test_in_process():
    assert sum(range(10)) == 45
'''


@pytest.mark.slow  # it starts processes itself (inside the inner session)
def test_tests_that_start_a_process_unmarked_fail(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: a slow test\n")
    pytester.makepyfile(test_inner=_TESTS)
    r = pytester.runpytest_inprocess("-p", "process_guard", "-q")
    r.assert_outcomes(failed=5, passed=2)
    out = r.stdout.str()
    for name, what in [("test_subprocess_run", "subprocess 'true'"), ("test_os_system", "os.system('true')"),
                       ("test_fork", "os.fork()"), ("test_multiprocessing_spawn", "multiprocessing process 'guarded-child'"),
                       ("test_uses_a_fixture_that_starts_a_process", "subprocess 'sleep 0.01'")]:
        assert f"test_inner.py::{name} started a process but is not marked slow: {what}" in out, out
    assert "test_marked_slow started" not in out and "test_in_process started" not in out, out
