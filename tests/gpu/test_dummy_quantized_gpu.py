"""``--load-format dummy`` with a block FP8 config on a GPU with FP8 (compute capability >= 8.9):
the module-by-module start (:func:`zpp.models.loader.init_dummy_weights_quantized`) equals, bit
for bit on the GPU, the whole stage filled in bf16 and then quantized, and its peak of allocated
CUDA memory stays near the quantized stage's bytes (the CPU twin of this test is
tests/models/test_dummy_quantized.py)."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a GPU with FP8 (compute capability >= 8.9)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg() -> dict:
    """Qwen3-30B-A3B's config (block FP8, as its -FP8 release) shrunk to 8 layers of 1024 with 64
    experts of 512: 1.69 GB in bf16, 0.86 GB held (as planned on meta for 9.0)."""
    with open(os.path.join(ROOT, "scripts", "configs", "qwen3-30b-a3b", "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=64, num_experts_per_tok=8,
               vocab_size=8192, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "activation_scheme": "dynamic"})
    return cfg


def _whole_then_quantized(cfg, info, device):
    from zpp.models import quantization as q
    from zpp.models.loader import init_dummy_weights
    from zpp.models.registry import resolve_model_class
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = resolve_model_class(cfg, 1)(cfg, info, 256)
    finally:
        torch.set_default_dtype(torch.float32)
    init_dummy_weights(model, 0)
    q.parse_quantization_config(cfg).quantize_like_checkpoint(model)
    return model.eval()


def test_dummy_block_fp8_start_equals_the_whole_fill_and_peaks_near_the_fp8_bytes():
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.registry import resolve_model_class
    from zpp.models.weight_bytes import weight_bytes_by_dtype
    cfg, dev = _cfg(), torch.device("cuda")
    info = StageInfo(0, 1, 0, cfg["num_hidden_layers"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        bf16 = sum(p.numel() * p.element_size() for p in resolve_model_class(cfg, 1)(cfg, info, 256).parameters())
    torch.set_default_dtype(torch.float32)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = load_stage_model("/nonexistent", copy.deepcopy(cfg), info, torch.bfloat16, dev, 256, "dummy")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    by_dtype = weight_bytes_by_dtype(got)
    held = sum(by_dtype.values())
    print(f"bf16 {bf16 / 2**20:.0f} MiB, held {held / 2**20:.0f} MiB (fp8 {by_dtype.get('fp8', 0) / 2**20:.0f}), "
          f"peak allocated {peak / 2**20:.0f} MiB, reserved {torch.cuda.max_memory_reserved() / 2**20:.0f} MiB")
    assert by_dtype.get("fp8", 0) > 0.45 * bf16
    assert peak < held + (bf16 - held) / 4
    ref = _whole_then_quantized(copy.deepcopy(cfg), info, dev)
    gs = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    rs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    assert gs.keys() == rs.keys()
    for k in gs:
        assert gs[k].dtype == rs[k].dtype and torch.equal(gs[k].reshape(-1).view(torch.uint8),
                                                          rs[k].reshape(-1).view(torch.uint8)), k
