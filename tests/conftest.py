"""Shared fixtures: the real demo model (SmolLM2-135M-Instruct, converted once), the shared servers, the
two hosts. Helpers that tests import are in helpers.py."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from helpers import OBSERVED_ALIAS, OBSERVED_NAME, ServerProcess, demo_model_or_skip, pp2_server
from two_hosts import TwoHosts, ensure_openssh, unavailable_reason

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["process_guard"]  # a test that starts a process and is not marked slow fails


@pytest.fixture(scope="session")
def demo_model() -> str:
    return demo_model_or_skip()


@pytest.fixture
def private_tmpdir(monkeypatch):
    """A fresh, short temporary directory (ipc socket paths must stay under 108 bytes) that this
    process's ``tempfile`` uses, for counting what a run leaves there (``helpers.ipc_socket_files``);
    give it to a subprocess as ``TMPDIR``. Removed after the test."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="zpp-t-")
    monkeypatch.setattr(tempfile, "tempdir", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _offline_llm_on_cpu_unless_gpu_test(request, monkeypatch):
    """``device="auto"`` (the default of ``LLM`` and of ``ParallelConfig``) is CUDA on a GPU machine;
    the CPU tests compare against HF on the CPU, so outside ``test_gpu.py`` "auto" means the CPU."""
    import torch
    if torch.cuda.is_available() and request.module.__name__ != "test_gpu":
        monkeypatch.setattr("zpp.config.resolve_device", lambda d: "cpu" if d == "auto" else d)


@pytest.fixture(scope="module")
def one_torch_thread():
    """This process's torch on one thread for a module (``pytestmark =
    pytest.mark.usefixtures("one_torch_thread")``) whose in-process work is tiny ops (stages chained in
    process, HF references of small random models): on a shared 2-core machine two threads per tiny
    op wait on each other (5-10x slower). Engine workers set their own. Restored after the module."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, demo_model) -> str:
    """A 4-layer Llama (hidden 64, vocab 49152) with random float32 weights (initializer_range 0.3:
    logits that depend strongly on the context) and SmolLM2's tokenizer and chat template, written
    once per session: for tests of the engine itself (scheduling, preemption, the prefix cache,
    chunked prefill, seeded sampling, limits) that compare zpp with zpp and need no real text. Each
    decode step costs a fraction of the demo model's 30 layers."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-llama-session")
    LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(d)
    for f in os.listdir(demo_model):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(demo_model, f), d)
    return str(d)


@pytest.fixture(scope="session")
def tokenizer(demo_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(demo_model)


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


@pytest.fixture(scope="module")
def shared_pp2_prefix_server(request, demo_model):
    """``zpp serve`` at PP=2 with prefix caching (max-model-len 512, 64 KV blocks), the default log
    level (info) with ``--enable-log-requests``, stats every 0.5 s, served as ``OBSERVED_NAME`` and
    ``OBSERVED_ALIAS`` (``--served-model-name`` with two names): the server of
    tests/server/test_observability.py, and of the prefix-cache test of tests/server/test_serving.py after it."""
    yield from _shared_server(request, lambda: ServerProcess(
        [demo_model, "-pp", "2", "--served-model-name", OBSERVED_NAME, OBSERVED_ALIAS, "--max-model-len", "512",
         "--num-kv-blocks", "64", "--enable-prefix-caching", "--log-stats-interval", "0.5", "--enable-log-requests"]))


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
