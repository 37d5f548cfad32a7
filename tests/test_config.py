"""Settings that depend on the environment: CPU threads per worker, ``device="auto"``."""
from __future__ import annotations

import os

import pytest
import torch

import zpp.config
from zpp.config import cpu_threads_per_worker, resolve_device
from zpp.errors import ConfigError


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


def test_default_token_budget_and_target_per_device_and_use(demo_model):
    """2048 tokens per micro-batch on CPU and CUDA, serving or offline (issue 28: no 32-token CPU
    serving budget); an explicit value always wins; without chunked prefill the whole model length.
    The target inter-token latency: 0.7 s on CPU and 0.2 s on CUDA for `zpp serve`, none offline or
    without chunked prefill, 0 = none. No attention budget unless set (0 = none)."""
    from zpp.config import (CPU_TARGET_INTER_TOKEN_LATENCY, CUDA_TARGET_INTER_TOKEN_LATENCY,
                            DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig, ModelConfig, ParallelConfig,
                            SchedulerConfig)

    def config(device, kw):
        cfg = EngineConfig(model=ModelConfig(model=demo_model),
                           parallel=ParallelConfig.__new__(ParallelConfig), scheduler=SchedulerConfig(**kw))
        object.__setattr__(cfg.parallel, "device", device)
        return cfg

    def budget(device="cpu", **kw):
        return config(device, kw).max_num_batched_tokens

    assert budget() == budget(streaming=False) == budget("cuda") == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    assert budget(max_num_batched_tokens=100) == 100
    assert budget(enable_chunked_prefill=False) == 8192

    def target(device="cpu", **kw):
        return config(device, kw).target_inter_token_latency

    assert target() == CPU_TARGET_INTER_TOKEN_LATENCY == 0.7
    assert target("cuda") == CUDA_TARGET_INTER_TOKEN_LATENCY == 0.2
    assert target(streaming=False) is None and target("cuda", streaming=False) is None
    assert target(enable_chunked_prefill=False) is None
    assert target(target_inter_token_latency=0.0) is None and target(streaming=False, target_inter_token_latency=1.5) == 1.5
    with pytest.raises(ConfigError, match="--target-inter-token-latency"):
        SchedulerConfig(target_inter_token_latency=-1.0)

    def pairs(device="cpu", **kw):
        return config(device, kw).prefill_attention_budget

    assert pairs() is None and pairs(streaming=False) is None and pairs("cuda") is None
    assert pairs(prefill_attention_budget=0) is None and pairs("cuda", prefill_attention_budget=5) == 5


# --- --pp-layer-partition auto: the split choice ---------------------------------------------------
def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


def test_balanced_partition_is_the_min_max_split():
    """Against brute force over every split: the slowest stage is as fast as it can be, every stage
    has >= 1 layer and the sizes sum to the layers; among optimal splits the one nearest even."""
    import random

    from zpp.models.partition import balanced_partition, even_sizes, stage_times
    rng = random.Random(0)
    for _ in range(300):
        pp = rng.randint(1, 4)
        layers = rng.randint(pp, 12)
        layer_cost = [rng.choice([1.0, rng.uniform(0.5, 2.0)]) for _ in range(pp)]
        extra = [rng.choice([0.0, rng.uniform(0.0, 6.0)]) for _ in range(pp)]
        sizes = balanced_partition(layers, layer_cost, extra)
        assert len(sizes) == pp and sum(sizes) == layers and min(sizes) >= 1
        best = min(max(stage_times(c, layer_cost, extra)) for c in _compositions(layers, pp))
        assert max(stage_times(sizes, layer_cost, extra)) == pytest.approx(best, rel=1e-9)
        even = even_sizes(layers, pp)
        nearest = min(sum(abs(a - b) for a, b in zip(c, even)) for c in _compositions(layers, pp)
                      if max(stage_times(c, layer_cost, extra)) <= best * (1 + 1e-9))
        assert sum(abs(a - b) for a, b in zip(sizes, even)) == nearest


def test_balanced_partition_examples():
    from zpp.errors import ConfigError
    from zpp.models.partition import balanced_partition, parse_partition, partition_layers
    assert balanced_partition(30, [1.0, 1.0], [0.0, 0.0]) == (15, 15)      # equal costs: even
    assert balanced_partition(31, [1.0, 1.0], [0.0, 0.0]) == (16, 15)      # remainder first, as the default
    assert balanced_partition(30, [1.0, 1.0], [0.0, 8.0]) == (19, 11)      # an LM head worth 8 layers
    assert balanced_partition(32, [1.0] * 4, [0.5, 0, 0, 4.0]) == (9, 9, 9, 5)
    assert balanced_partition(4, [1.0, 1.0], [0.0, 100.0]) == (3, 1)       # every stage keeps a layer
    assert balanced_partition(10, [2.0, 1.0], [0.0, 0.0]) == (3, 7)        # a device twice as slow
    with pytest.raises(ConfigError):
        balanced_partition(2, [1.0] * 3, [0.0] * 3)
    assert parse_partition("auto") == "auto" and parse_partition("AUTO") == "auto"
    assert partition_layers(30, 4, "auto") == partition_layers(30, 4)     # provisional: even
