"""FP8 MoE checkpoints in the releases' layouts -- block 128 x 128 ``weight_scale_inv`` with
per-expert names and the routers in high precision (DeepSeek-V3 / Qwen3-FP8), compressed-tensors
per output channel (``-FP8-dynamic``) -- for Qwen3-MoE, Mixtral and DeepSeek-V3 (MLA, shared experts):

* on the CPU (every FP8 weight dequantized on load) zpp's greedy tokens equal HF transformers' on
  the same checkpoint dequantized, here at PP = 3 (DeepSeek-V3) and an uneven PP = 2 split
  (Mixtral) -- PP = 1 and 2 and Qwen3-MoE's block layout are test_fp8.py's; each stage reports its
  weight bytes by dtype (the checkpoint's, exactly) and its KV capacity in tokens;
* the GPU's loading path, run here on the CPU: expert weights stay e4m3 with canonical scales that
  dequantize exactly to the checkpoint's, routers keep their dtype, the expert layer's output
  equals the dequantized model's; ``--quantization fp8`` and dummy weights with a block FP8 config
  quantize experts too (per output channel / in 128 x 128 tiles).
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from fp8_checkpoint import write_fp8_checkpoint
from helpers import hf_greedy

VOCAB = 49152
MAX_NEW = 8


def _qwen3_moe():  # experts 128 x 128: whole blocks; 4 layers, layer 2 dense
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


FAMILIES = {"qwen3-moe": _qwen3_moe, "mixtral": _mixtral}
EXPERT = {"qwen3-moe": "model.layers.0.mlp.experts.1.{}.weight", "mixtral": "model.layers.0.block_sparse_moe.experts.1.{}.weight",
          "deepseek-v3": "model.layers.1.mlp.experts.1.{}.weight"}
PROJ = {"qwen3-moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"),
        "deepseek-v3": ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_model):
    """(family, layout) -> (FP8 checkpoint dir, its dequantized fp32 twin)."""
    made: dict[tuple[str, str], tuple[str, str]] = {}
    srcs: dict[str, str] = {}

    def get(family: str, layout: str) -> tuple[str, str]:
        if (family, layout) not in made:
            if family not in srcs:
                if family == "deepseek-v3":       # MLA, shared experts, fp32 router; experts 128 wide
                    from test_models_deepseek import _save, _v3
                    srcs[family] = _save(_v3, str(tmp_path_factory.mktemp(family)), demo_model, num_hidden_layers=3,
                                         moe_intermediate_size=128, hidden_size=128)
                else:
                    cls, cfg = FAMILIES[family]()
                    torch.manual_seed(0)
                    out = str(tmp_path_factory.mktemp(family))
                    cls(cfg).to(torch.float32).eval().save_pretrained(out)
                    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                        if os.path.exists(os.path.join(demo_model, f)):
                            shutil.copy(os.path.join(demo_model, f), out)
                    srcs[family] = out
            d = str(tmp_path_factory.mktemp(f"{family}-{layout}"))
            names = write_fp8_checkpoint(srcs[family], d, layout, dequantized_dst=d + "-deq")
            assert EXPERT[family].format(PROJ[family][2]) in names           # experts are FP8 in the file
            assert not any(n.endswith(".mlp.gate.weight") or ".gate.weight" in n for n in names)  # routers are not
            made[(family, layout)] = (d, d + "-deq")
        return made[(family, layout)]
    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(47)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 21)]


def _bytes(d: str) -> int:
    from safetensors import safe_open
    total = 0
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as s:
                for k in s.keys():
                    t = s.get_slice(k)
                    n = 1
                    for x in t.get_shape():
                        n *= x
                    total += n * {"F32": 4, "BF16": 2, "F8_E4M3": 1}[t.get_dtype()]
    return total


@pytest.mark.slow
@pytest.mark.parametrize("family, layout, pp, partition", [
    ("deepseek-v3", "block", 3, None), ("mixtral", "ct-channel", 2, (2, 1))])
def test_greedy_matches_hf(ckpt, prompts, family, layout, pp, partition):
    """zpp on the FP8 checkpoint (dequantized on load on the CPU) against HF on the dequantized
    twin; every stage's weight bytes by dtype add up to the twin's (fp32 on the CPU: the same
    tensors), and the KV capacity is the blocks' tokens."""
    from zpp import LLM, SamplingParams
    d, deq = ckpt(family, layout)
    ref = hf_greedy(deq, prompts, MAX_NEW)
    kw = {"pp_layer_partition": partition} if partition else {}
    with LLM(d, pipeline_parallel_size=pp, max_num_batched_tokens=16, kv_cache_memory="32MiB", **kw) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats()
    assert [list(o.outputs[0].token_ids) for o in outs] == ref, f"{family} {layout} PP={pp} {partition}"
    assert len(stats.stage_weight_bytes) == pp and all(set(s) == {"fp32"} for s in stats.stage_weight_bytes)
    if family != "deepseek-v3":               # (DeepSeek-V3's file also holds what zpp skips)
        assert sum(s["fp32"] for s in stats.stage_weight_bytes) == _bytes(deq)
    assert stats.kv_cache_tokens == stats.num_kv_blocks * 16 > 0


def _stage(d: str, keep_fp8: bool, dtype=torch.bfloat16, load_format="safetensors", quantization=None):
    from zpp.models import quantization as q
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    orig = q.fp8_supported
    q.fp8_supported = (lambda device: True) if keep_fp8 else orig
    try:
        return load_stage_model(d, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), dtype, torch.device("cpu"), 256,
                                load_format, quantization=quantization)
    finally:
        q.fp8_supported = orig


def _experts(model, family):
    layer = model.model.layers[1 if family == "deepseek-v3" else 0]
    return layer.mlp.experts, layer.mlp.gate


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("qwen3-moe", "block"), ("mixtral", "ct-channel"),
                                            ("deepseek-v3", "block"), ("deepseek-v3", "ct-tensor")])
def test_experts_kept_fp8(ckpt, family, layout):
    """The GPU's loading path on the CPU: experts e4m3 with their canonical scales (block grids
    ``[E, 2I/128, H/128]`` / ``[E, H/128, I/128]``, per channel ``[E, 2I]`` / ``[E, H]``, a per-tensor
    scale broadcast to its rows) dequantizing exactly to the checkpoint's; routers in their dtype;
    the expert layer's output equal to the dequantized model's; fp8 bytes as in the file."""
    from safetensors.torch import load_file
    from zpp.models.quantization.fp8_moe import Fp8MoEMethod
    from zpp.models.weight_bytes import weight_bytes_by_dtype
    d, deq = ckpt(family, layout)
    model, ref = _stage(d, keep_fp8=True), _stage(deq, keep_fp8=False)
    ex, gate = _experts(model, family)
    rex, rgate = _experts(ref, family)
    assert isinstance(ex.quant_method, Fp8MoEMethod) and ex.gate_up_proj.dtype == torch.float8_e4m3fn
    assert ex.down_proj.dtype == torch.float8_e4m3fn
    E, H, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
    if layout == "block":
        assert ex.gate_up_proj_scale.shape == (E, 2 * I // 128, -(-H // 128))
        assert ex.down_proj_scale.shape == (E, -(-H // 128), I // 128)
    else:
        assert ex.gate_up_proj_scale.shape == (E, 2 * I) and ex.down_proj_scale.shape == (E, H)
    assert gate.weight.dtype == (torch.float32 if family == "deepseek-v3" else torch.bfloat16)
    full = load_file(os.path.join(deq, "model.safetensors"))
    gu, dn = ex.quant_method.dequantized(ex, torch.float32)
    g, u, dname = (EXPERT[family].format(p) for p in PROJ[family])
    torch.testing.assert_close(gu[1], torch.cat([full[g], full[u]]), rtol=0, atol=0)
    torch.testing.assert_close(dn[1], full[dname], rtol=0, atol=0)
    x = torch.randn(7, H, dtype=torch.bfloat16)
    with torch.inference_mode():
        w, ids = rgate(x)
        torch.testing.assert_close(ex(x, w, ids), rex(x, w, ids), rtol=0, atol=0)
    # the stage's fp8 bytes: every e4m3 tensor of the file the layout keeps (experts, shared experts
    # and MLA projections; not DeepSeek's kv_b_proj, which MLA reads outside the layer)
    from zpp.models.quantization.checkpoint import read_index
    index = read_index([os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")])
    kept = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert weight_bytes_by_dtype(model)["fp8"] == kept
    f8 = {n: i for n, i in index.items() if i.dtype == "F8_E4M3"}
    expert_bytes = sum(torch.Size(i.shape).numel() for n, i in f8.items() if ".experts." in n)
    assert kept >= expert_bytes and kept <= sum(torch.Size(i.shape).numel() for i in f8.values())


@pytest.mark.slow
def test_online_and_dummy_quantization_of_experts(ckpt):
    """``--quantization fp8`` (run on the CPU in-process): experts per output channel within e4m3's
    rounding of the bf16 weights; ``--load-format dummy`` with a block FP8 config: experts in
    128 x 128 tiles, as the checkpoint would hold them."""
    from zpp.models.quantization.fp8 import parse_fp8
    from zpp.models.quantization.fp8_moe import quantize_experts
    _, deq = ckpt("qwen3-moe", "block")
    model = _stage(deq, keep_fp8=False)
    ex, _ = _experts(model, "qwen3-moe")
    before = ex.gate_up_proj.detach().clone()
    assert quantize_experts(model) == 3                                       # layers 0, 1, 3
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn and ex.gate_up_proj_scale.shape == (4, 256)
    back = ex.quant_method.dequantized(ex, torch.float32)[0]
    rel = (back - before.float()).abs() / before.float().abs().amax(-1, keepdim=True)
    assert rel.max() < 2 ** -4                                                # e4m3: 3 mantissa bits
    dummy = _stage(deq, keep_fp8=False, load_format="dummy")
    n = parse_fp8({"quant_method": "fp8", "weight_block_size": [128, 128]}).quantize_like_checkpoint(dummy)
    dex, _ = _experts(dummy, "qwen3-moe")
    assert dex.gate_up_proj.dtype == torch.float8_e4m3fn and dex.gate_up_proj_scale.shape == (4, 2, 1)
    assert n >= 3
