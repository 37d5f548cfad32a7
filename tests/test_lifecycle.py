"""No orphan processes: SIGTERM / SIGINT stop `zpp serve` and every worker (SIGINT with a stream
open, which also ends the stream); SIGKILL of the engine core fails the server and leaves no worker.

Covered in tests/test_faults.py, not repeated here (each case costs a server start): SIGKILL of the
server process (its workers are gone within 5 s, after the client hang-ups) and a SIGKILLed stage
worker (the server exits non-zero, nothing is left)."""
from __future__ import annotations

import os
import signal
import time

from conftest import ServerProcess, descendants, wait_gone as _wait_gone


def test_sigterm_stops_everything(demo_model):
    """(SIGINT: test_signal_ends_open_streams_promptly.)"""
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"])
    try:
        kids = descendants(s.proc.pid)
        assert len(kids) >= 2, "expected at least two worker processes"
        os.kill(s.proc.pid, signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert _wait_gone(kids, 10) == [], "worker processes left behind"
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


def test_signal_ends_open_streams_promptly(demo_model):
    """SIGINT while a long stream is open: the stream ends with an error event and [DONE], and the
    server and its workers are gone within seconds (not after the request would have finished)."""
    import json
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"])
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
    finally:
        s.stop()


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


def test_engine_core_runs_apart_and_its_death_fails_the_server(demo_model):
    """zpp serve = front end (HTTP) + engine-core process (scheduler, executor) + workers under the
    core. SIGKILL of the core: the open stream gets an error event, /health answers 503 and the
    server exits non-zero; no worker is left."""
    import json
    import urllib.error
    import urllib.request
    s = ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--kv-cache-memory", "64MiB"])
    try:
        cores = [p for p in _children(s.proc.pid) if "resource_tracker" not in open(f"/proc/{p}/cmdline").read()]
        assert len(cores) == 1, f"expected one engine-core process under the server, got {cores}"
        core = cores[0]
        workers = _children(core)
        assert len(workers) >= 2, "the stage workers run under the engine core"
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
    finally:
        s.stop()
