"""Start-up's own forward passes, on the CPU.

* The memory profile's micro-batch keeps every position below ``max_model_len`` (one sequence of
  ``--max-num-batched-tokens`` positions read past the rotary cos/sin table of a DeepSeek-V3 at
  ``--max-model-len 512``: a device-side index assert on the GPU, an IndexError here).
* The MoE warm-up: its token counts build every kernel variant (tile configuration and integer
  class of ``M = T * k``) that a batch of up to ``--max-num-batched-tokens`` tokens launches, for
  the FP8 experts of the measured Qwen3-30B-A3B / DeepSeek-V3 shapes and for bf16; and the GPU's
  last start-up step (``start_up_passes.warm_up_and_watch``) runs the experts at each of those counts.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from zpp.models.layers.attention import build_attention_metadata
from zpp.models.layers.moe import FusedExperts
from zpp.models.layers.moe_warmup import moe_variant, warmup_token_counts
from zpp.models.quantization.fp8_moe import Fp8MoEMethod

_DSV3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512, hidden_size=64,
             intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
             v_head_dim=24, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             topk_method="noaux_tc", scoring_func="sigmoid", hidden_act="silu", rms_norm_eps=1e-6,
             max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
             bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def _runner(tmp_path, cfg: dict, max_model_len: int):
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.workers.model_runner import ModelRunner
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_stage_model(str(d), cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), torch.float32,
                             torch.device("cpu"), max_model_len, "dummy")
    return ModelRunner(model, torch.device("cpu"), torch.float32, 16, None, set(), max_model_len=max_model_len,
                       max_num_seqs=1)


def test_profile_batch_stays_below_max_model_len(tmp_path):
    """``--max-model-len 64`` with 200 batched tokens: sequences of <= 64 tokens, positions < 64,
    disjoint blocks; the profile's forward runs (the one-sequence batch it replaced indexes the
    64-row YaRN table at position 199)."""
    runner = _runner(tmp_path, _DSV3, max_model_len=64)
    lens, pos, tables = runner.profile_batch(200)
    assert lens == [64, 64, 64, 8] and len(pos) == 200 and int(pos.max()) == 63
    assert [len(t) for t in tables] == [4, 4, 4, 1]
    assert sorted(b for t in tables for b in t) == list(range(13))
    runner.profile_forward(200, 1)                     # start-up's pass (the GPU's memory profile)
    assert runner.kv_caches == []
    runner.init_kv_cache(13)
    meta = build_attention_metadata([0], [200], [list(range(13))], 16, torch.device("cpu"))
    with torch.inference_mode(), pytest.raises(IndexError):
        runner.model(torch.zeros(200, dtype=torch.int64), torch.arange(200), None, runner.kv_caches, meta)


def _experts(E: int, H: int, I: int, fp8: bool, block=None) -> FusedExperts:
    with torch.device("meta"):
        ex = FusedExperts(E, H, I)
        if fp8:
            Fp8MoEMethod(block).create_weights(ex)
    return ex


@pytest.mark.parametrize("E,H,I,fp8,block", [
    (128, 2048, 768, True, None), (128, 2048, 768, True, (128, 128)),    # Qwen3-30B-A3B, measured tiles
    (256, 7168, 2048, True, (128, 128)),                                  # DeepSeek-V3 (measured)
    (64, 512, 256, True, None),                                           # no measured entry: defaults
    (128, 2048, 768, False, None)])                                       # bf16 fused_moe
def test_warmup_counts_cover_every_variant(E, H, I, fp8, block):
    k, max_tokens = 8, 8192
    ex = _experts(E, H, I, fp8, block)
    counts = warmup_token_counts(ex, k, max_tokens)
    warmed = {moe_variant(ex, t, k) for t in counts}
    missing = [t for t in range(1, max_tokens + 1) if moe_variant(ex, t, k) not in warmed]
    assert not missing, f"token counts {missing[:5]}... compile while serving"
    assert len(warmed) == len(counts) >= 3 and counts[0] == 1 and counts[-1] <= max_tokens
    if fp8:  # the GEMV path and at least two GEMM tile configurations
        assert ("fp8-gemv",) in warmed and len({v[1] for v in warmed if v[0] == "fp8-gemm"}) >= 2


def test_gpu_start_up_warms_the_experts(tmp_path, monkeypatch):
    """``start_up_passes.warm_up_and_watch`` (the GPU's last start-up step) runs every expert shape at each
    of its warm-up token counts, routed to ``num_experts_per_tok`` experts."""
    from triton import knobs

    from zpp.workers import start_up_passes
    runner = _runner(tmp_path, _DSV3, max_model_len=256)
    seen = []
    real = FusedExperts.forward

    def spy(self, x, weights, ids, reduce=True):
        seen.append((x.shape[0], ids.shape[1]))
        return real(self, x, weights, ids, reduce)
    monkeypatch.setattr(FusedExperts, "forward", spy)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", knobs.runtime.jit_cache_hook)   # restored after

    class Cfg:
        max_num_batched_tokens = 300

        class scheduler:
            max_num_seqs = 1
    start_up_passes.warm_up_and_watch(runner, Cfg)
    ex = next(m for m in runner.model.modules() if isinstance(m, FusedExperts))
    assert seen == [(t, 2) for t in warmup_token_counts(ex, 2, 300)] and len(seen) >= 3
