"""Settings that depend on the environment: CPU threads per worker, ``device="auto"``."""
from __future__ import annotations

import os

import torch

import zpp.config
from zpp.config import cpu_threads_per_worker, resolve_device


def test_cpu_threads_default_user_torch_and_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(zpp.config, "torch_threads_at_import", torch.get_num_threads())
    cores = os.cpu_count() or 1
    assert cpu_threads_per_worker(2) == max(1, cores // 2)       # default: cores / local workers
    assert cpu_threads_per_worker(4 * cores) == 1
    before = torch.get_num_threads()
    torch.set_num_threads(before + 3)                             # the user's torch.set_num_threads
    try:
        assert cpu_threads_per_worker(2) == before + 3
        monkeypatch.setenv("OMP_NUM_THREADS", "5")                # OMP_NUM_THREADS wins
        assert cpu_threads_per_worker(2) == 5
    finally:
        torch.set_num_threads(before)
    monkeypatch.setenv("OMP_NUM_THREADS", "not-a-number")
    assert cpu_threads_per_worker(2) == max(1, cores // 2)


def test_device_auto():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


def test_default_token_budget_per_device_and_use(demo_model):
    """CPU: the small serving budget for `zpp serve`, 2048 for offline use; CUDA: 2048; an explicit
    value always wins; without chunked prefill the whole model length."""
    from zpp.config import (CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS, CPU_SERVE_MAX_NUM_BATCHED_TOKENS,
                            CUDA_MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelConfig, ParallelConfig,
                            SchedulerConfig)

    def config(device, kw):
        cfg = EngineConfig(model=ModelConfig(model=demo_model),
                           parallel=ParallelConfig.__new__(ParallelConfig), scheduler=SchedulerConfig(**kw))
        object.__setattr__(cfg.parallel, "device", device)
        return cfg

    def budget(device="cpu", **kw):
        return config(device, kw).max_num_batched_tokens

    assert budget() == CPU_SERVE_MAX_NUM_BATCHED_TOKENS < CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS
    assert budget(streaming=False) == CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS == 2048
    assert budget("cuda") == budget("cuda", streaming=False) == CUDA_MAX_NUM_BATCHED_TOKENS == 2048
    assert budget(max_num_batched_tokens=100) == 100
    assert budget(enable_chunked_prefill=False) == 8192

    def pairs(device="cpu", **kw):
        return config(device, kw).prefill_attention_budget

    from zpp.config import CPU_SERVE_PREFILL_ATTENTION_BUDGET
    assert pairs() == CPU_SERVE_PREFILL_ATTENTION_BUDGET == 65536
    assert pairs(streaming=False) is None and pairs("cuda") is None
    assert pairs(enable_chunked_prefill=False) is None
    assert pairs(prefill_attention_budget=0) is None and pairs("cuda", prefill_attention_budget=5) == 5
