"""No orphan processes: SIGTERM / SIGINT stop `zpp serve` and every worker (SIGINT with a stream
open, which also ends the stream; either during start-up, which it aborts); SIGKILL of the engine
core fails the server and leaves no worker. Nor files: each of those exits, and a start-up that
fails, leaves no ipc socket file (``zpp-<pid>-<hex>.sock``) in the temporary directory (a private
``TMPDIR`` per test: the count is exact).

Covered in tests/e2e/test_faults.py, not repeated here (each case costs a server start): SIGKILL of the
server process (its workers are gone within 5 s, after the client hang-ups) and a SIGKILLed stage
worker (the server exits non-zero, nothing is left)."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from helpers import ServerProcess, descendants, free_port, ipc_socket_files, wait_gone as _wait_gone

pytestmark = pytest.mark.slow


def test_sigterm_stops_everything(demo_model, private_tmpdir):
    """(SIGINT: test_signal_ends_open_streams_promptly.) Every process, and the socket files."""
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"],
                      env={"TMPDIR": private_tmpdir})
    try:
        kids = descendants(s.proc.pid)
        assert len(kids) >= 2, "expected at least two worker processes"
        # The front end -> core socket and the core -> workers one.
        assert len(ipc_socket_files(private_tmpdir)) == 2, ipc_socket_files(private_tmpdir)
        os.kill(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert _wait_gone(kids, 10) == [], "worker processes left behind"
        assert ipc_socket_files(private_tmpdir) == []
    finally:
        s.stop()


def _open_long_stream(url: str):
    """Start a 1500-token streamed completion in a thread; return (thread, its non-empty lines)
    once the first event has arrived."""
    import json
    import threading
    import urllib.request
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    lines: list[str] = []
    first = threading.Event()

    def read():
        with urllib.request.urlopen(req, timeout=120) as r:
            for raw in r:
                if raw.strip():
                    lines.append(raw.decode().strip())
                    first.set()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert first.wait(60), "no streamed event"
    return t, lines


def test_signal_ends_open_streams_promptly(demo_model, private_tmpdir):
    """SIGINT while a long stream is open: the stream ends with an error event and [DONE], and the
    server and its workers are gone within seconds (not after the request would have finished),
    their socket files too."""
    import json
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"],
                      env={"TMPDIR": private_tmpdir})
    try:
        kids = descendants(s.proc.pid)
        assert len(kids) >= 2, "expected at least two worker processes"
        t, lines = _open_long_stream(s.url)
        t0 = time.monotonic()
        os.kill(s.proc.pid, signal.SIGINT)
        assert s.proc.wait(20) == 0
        assert time.monotonic() - t0 < 15
        t.join(10)
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))
        assert "shutting down" in err["error"]["message"]
        assert _wait_gone(kids, 10) == [], "worker processes left behind"
        assert ipc_socket_files(private_tmpdir) == []
    finally:
        s.stop()


def _group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) of process group ``pgid`` (via /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
            except (OSError, ValueError):
                continue
            if int(pgrp) == pgid and state != "Z":
                out.append(int(d))
    return out


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ")


@pytest.mark.parametrize("sig,to_group,wait_for,status", [
    # Ctrl-C in a terminal: SIGINT to the whole process group, while the core spawns the workers
    # (they are still importing) and while the workers load their weights.
    ("SIGINT", True, "stage 1: layers", 130),
    ("SIGINT", True, "placement: rank 1", 130),
    ("SIGINT", False, "placement: rank 1", 130),  # kill -INT of the server alone
    ("SIGTERM", False, "placement: rank 1", -signal.SIGTERM),  # worked before: ends by the signal
], ids=["ctrl-c-spawning", "ctrl-c-loading", "sigint-loading", "sigterm-loading"])
def test_signal_during_start_up_aborts_it(demo_model, tmp_path, private_tmpdir, sig, to_group, wait_for, status):
    """A signal while `zpp serve` starts (before /health answers) aborts the start-up: the server
    exits within seconds (SIGINT: status 130; SIGTERM: killed by it), prints one line and no
    traceback, never serves, and leaves no process of its process group (core, workers, resource
    tracker) behind, nor a socket file."""
    import subprocess
    import sys
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "zpp.cli", "serve", demo_model, "-pp", "2",
                                 "--kv-cache-memory", "64MiB", "--host", "127.0.0.1", "--port", str(free_port())],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "TMPDIR": private_tmpdir})
    try:
        deadline = time.monotonic() + 120
        while wait_for not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
        before = log_path.read_text()
        assert "serving" not in before, "the server was up before the signal: the test is too slow"
        t0 = time.monotonic()
        (os.killpg if to_group else os.kill)(proc.pid, getattr(signal, sig))
        try:
            got = proc.wait(20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{sig} during start-up was ignored: still running 20 s later:\n"
                                 f"{log_path.read_text()}") from None
        elapsed = time.monotonic() - t0
        out = log_path.read_text()
        assert got == status, out
        assert elapsed < 10, f"took {elapsed:.1f} s to stop"
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
        assert "serving" not in out, out
        others = [line for line in out.splitlines() if line.strip() and not _LOG_LINE.match(line)]
        assert others == [f"zpp: start-up interrupted ({sig}); everything it started is stopped"], out
        left = _wait_gone(_group_members(proc.pid), 5)
        assert left == [], f"processes left behind: {left}"
        assert ipc_socket_files(private_tmpdir) == []
    finally:
        if proc.poll() is None or _group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_busy_port_fails_before_loading(demo_model):
    import socket
    import subprocess
    import sys
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "zpp.cli", "serve", demo_model, "--host", "127.0.0.1",
                            "--port", str(port), "--log-level", "warning"], capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zpp: error:") and str(port) in lines[0], r.stderr


def _children(pid: int) -> list[int]:
    return [p for p in descendants(pid) if _ppid(p) == pid]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_engine_core_runs_apart_and_its_death_fails_the_server(demo_model, private_tmpdir):
    """zpp serve = front end (HTTP) + engine-core process (scheduler, executor) + workers under the
    core. SIGKILL of the core: the open stream gets an error event, /health answers 503 and the
    server exits non-zero; no worker is left, nor the socket files the core could not remove."""
    import json
    import urllib.error
    import urllib.request
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"],
                      env={"TMPDIR": private_tmpdir})
    try:
        def title(p: int) -> str:
            return open(f"/proc/{p}/cmdline").read().rstrip("\0 ")
        cores = [p for p in _children(s.proc.pid) if title(p) == "zpp::core"]  # not the grammar host, ...
        assert len(cores) == 1, f"expected one engine-core process under the server, got {cores}"
        core = cores[0]
        workers = _children(core)
        assert sorted(t for t in map(title, workers) if t.startswith("zpp::")) == ["zpp::stage0", "zpp::stage1"], \
            "the stage workers run under the engine core, named in ps"
        t, lines = _open_long_stream(s.url)
        os.kill(core, signal.SIGKILL)
        t.join(20)
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))
        assert "engine core" in err["error"]["message"], err
        try:
            code = urllib.request.urlopen(s.url + "/health", timeout=5).status
        except urllib.error.HTTPError as e:
            code = e.code
        except OSError:
            code = None  # already gone: the exit below is what matters
        assert code in (503, None)
        assert s.proc.wait(30) != 0
        assert _wait_gone(workers, 10) == [], "workers outlived their engine core"
        assert ipc_socket_files(private_tmpdir) == []
    finally:
        s.stop()


def test_tokenizer_that_fails_to_load_is_one_line(demo_model, tmp_path, private_tmpdir):
    """A tokenizer that fails to load (here: a truncated tokenizer.json) ends `zpp serve`'s start-up
    with one line naming its directory and transformers' error (exit 2, as other bad settings), and
    no process of the server's group is left, nor a socket file."""
    import subprocess
    import sys
    model = tmp_path / "model"
    model.mkdir()
    for name in os.listdir(demo_model):
        if name != "tokenizer.json":
            os.symlink(os.path.join(demo_model, name), model / name)
    (model / "tokenizer.json").write_text('{"model": ')
    proc = subprocess.Popen([sys.executable, "-m", "zpp.cli", "serve", str(model), "-pp", "2", "--log-level",
                             "warning", "--port", str(free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": private_tmpdir})
    try:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert err.splitlines() == [f"zpp: error: the tokenizer in '{model}' does not load: JSONDecodeError: "
                                    "Expecting value: line 1 column 11 (char 10)"], err
        assert _wait_gone(_group_members(proc.pid), 5) == [], "processes left behind"
        assert ipc_socket_files(private_tmpdir) == []
    finally:
        if proc.poll() is None or _group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
