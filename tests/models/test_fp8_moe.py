"""FP8 MoE checkpoints in the releases' layouts, for Qwen3-MoE, Mixtral and DeepSeek-V3 (MLA, shared
experts, ``first_k_dense_replace`` dense layers first):

* ``block``: ``quant_method: fp8``, 128 x 128 ``weight_scale_inv`` grids (ceil-div: DeepSeek's MLA
  projections and dense MLP end on partial blocks, as its ``kv_a_proj_with_mqa`` 576 rows do),
  per-expert names ``experts.E.gate_proj.weight`` + ``weight_scale_inv``; every expert, shared
  expert, dense MLP and attention projection FP8 (DeepSeek-V3 / Qwen3 ``-FP8``); routers
  (``mlp.gate``), norms, embeddings and lm_head in bf16, DeepSeek's ``e_score_correction_bias`` float32;
* ``ct-channel``: compressed-tensors ``float-quantized``, ``weight_scale [N, 1]``, dynamic per-token
  activations, ``ignore: ["lm_head", "re:.*mlp.gate$"]`` (``-FP8-dynamic``), bf16 elsewhere;
* ``block-fused`` (Qwen3-MoE): the block layout with each layer's experts under HF transformers 5's
  fused names (``experts.gate_up_proj`` + ``gate_up_proj_scale_inv``).
* ``ct-tensor`` (Mixtral): compressed-tensors per tensor with static per-tensor ``input_scale``
  (llm-compressor's FP8 scheme: the ``-FP8`` releases with static activation scales).

On the CPU (every FP8 weight dequantized on load) zpp's greedy tokens equal HF transformers' on the
same checkpoint dequantized (HF's reference once per checkpoint, three prompts):

* every family in ``block`` and ``ct-channel`` at PP = 1, 2 (2/2), 3 (2/1/1) and an uneven PP = 2
  (1/3), ``block-fused`` and ``ct-tensor`` at one split each: the stages built and chained in this
  process (each stage loads only its layers' tensors, as a worker does; the activations go from one
  stage's forward to the next's). PP = 1 decodes token by token, the other splits take HF's tokens
  as inputs (two forwards each) -- cheap enough to cover every split;
* the engine itself (worker processes, gloo between stages, chunked prefill, prefix caching,
  decoding) once: DeepSeek-V3 block at PP = 3 with ``--pp-layer-partition 1,2,1``; each stage
  reports its weight bytes by dtype and its KV capacity in tokens.

Also the GPU's loading path, run on the CPU: expert weights stay e4m3 with canonical scales that
dequantize exactly to the checkpoint's, routers keep their dtype, the expert layer's output equals
the dequantized model's; ``--quantization fp8`` and dummy weights with a block FP8 config quantize
experts too (per output channel / in 128 x 128 tiles).
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
from stage_chain import check_splits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

VOCAB = 2048  # token ids of the prompts; the tokenizer (SmolLM2's) is only loaded
MAX_NEW = 8


def _qwen3_moe():  # experts 128 x 128: whole blocks (k/v 64 rows: one partial block); layer 2 dense
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


FAMILIES = {"qwen3-moe": _qwen3_moe, "mixtral": _mixtral}
# DeepSeek-V3 (test_models_deepseek's _v3: q LoRA 32, kv LoRA 32, 8 routed experts + 1 shared, noaux_tc
# routing, YaRN) with hidden 128, experts 128 wide, dense MLP 96 wide, layers 0-1 dense, 2-3 MoE.
DEEPSEEK = dict(vocab_size=VOCAB, num_hidden_layers=4, first_k_dense_replace=2, moe_intermediate_size=128, hidden_size=128)
MOE_LAYER = {"qwen3-moe": 0, "mixtral": 0, "deepseek-v3": 2}
EXPERT = {"qwen3-moe": "model.layers.0.mlp.experts.1.{}.weight", "mixtral": "model.layers.0.block_sparse_moe.experts.1.{}.weight",
          "deepseek-v3": "model.layers.2.mlp.experts.1.{}.weight"}
PROJ = {"qwen3-moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"),
        "deepseek-v3": ("gate_proj", "up_proj", "down_proj")}
ROUTER = {"qwen3-moe": "model.layers.0.mlp.gate.weight", "mixtral": "model.layers.0.block_sparse_moe.gate.weight",
          "deepseek-v3": "model.layers.2.mlp.gate.weight"}
IGNORE = {"qwen3-moe": ("lm_head", "re:.*mlp.gate$"), "deepseek-v3": ("lm_head", "re:.*mlp.gate$"),
          "mixtral": ("lm_head", "re:.*block_sparse_moe.gate")}
LAYOUTS = [(f, lay) for f in ("qwen3-moe", "deepseek-v3", "mixtral") for lay in ("block", "ct-channel")] + \
    [("qwen3-moe", "block-fused"), ("mixtral", "ct-tensor")]
# In-process splits of the 4 layers: PP = 1, 2 (even), 3 (2/1/1, the engine's default split) and an
# uneven PP = 2; the fused names (their loading is the block layout's but for the names) and Mixtral's
# per-tensor layout with static input scales (llm-compressor's FP8 scheme; loaded as per channel) at one.
SPLITS = {"block-fused": [(1, 3)], "ct-tensor": [(2, 2)]}
DEFAULT_SPLITS = [(4,), (2, 2), (2, 1, 1), (1, 3)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_model):
    """(family, layout) -> (FP8 checkpoint dir, its dequantized fp32 twin); ``block-fused`` shares
    the ``block`` checkpoint's twin (the same weights)."""
    made: dict[tuple[str, str], tuple[str, str]] = {}
    srcs: dict[str, str] = {}

    def get(family: str, layout: str) -> tuple[str, str]:
        if (family, layout) not in made:
            if family not in srcs:
                if family == "deepseek-v3":
                    from test_models_deepseek import _save, _v3
                    srcs[family] = _save(_v3, str(tmp_path_factory.mktemp(family)), demo_model, **DEEPSEEK)
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
            fused = layout == "block-fused"
            base = "block" if fused else layout
            deq = get(family, "block")[1] if fused else d + "-deq"
            names = write_fp8_checkpoint(srcs[family], d, base, dequantized_dst=None if fused else deq,
                                         high_precision=torch.bfloat16, ignore=IGNORE[family], fused_experts=fused)
            assert EXPERT[family].format(PROJ[family][2]) in names          # experts are FP8 in the release
            assert not any(".gate.weight" in n for n in names)               # routers are not
            made[(family, layout)] = (d, deq)
        return made[(family, layout)]
    return get


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(47)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 21, 37)]


def _index(d: str):
    from zpp.models.quantization.checkpoint import read_index
    return read_index([os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")])


def _bytes(d: str) -> int:
    size = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
    return sum(torch.Size(i.shape).numel() * size[i.dtype] for i in _index(d).values())


def _config(d: str) -> dict:
    from zpp.models.registry import normalize_config
    with open(os.path.join(d, "config.json")) as f:
        return normalize_config(json.load(f))


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", LAYOUTS)
def test_every_split_matches_hf(ckpt, prompts, family, layout):
    """PP = 1, 2, 3 and an uneven split, each stage loading its own part of the FP8 checkpoint
    (dequantized on load on the CPU): HF's greedy tokens on the dequantized twin, every prompt. PP = 1
    decodes token by token; the other splits are checked with HF's tokens as their inputs (two
    forwards each: the FP8 part is the loading, and the stage boundaries are the split's), the
    engine decoding through real stages in :func:`test_engine_at_pp3_uneven_matches_hf`."""
    d, deq = ckpt(family, layout)
    ref = hf_greedy(deq, prompts, MAX_NEW)
    check_splits(d, prompts, ref, SPLITS.get(layout, DEFAULT_SPLITS), label=f"{family} {layout}")


@pytest.mark.slow
def test_engine_at_pp3_uneven_matches_hf(ckpt, prompts):
    """The engine (three worker processes, gloo between them) on DeepSeek-V3's block layout at PP = 3
    with ``--pp-layer-partition 1,2,1`` (a stage with a dense and an MoE layer; prompts prefilled in
    chunks of 16 tokens, prefix caching on: a request sharing 32 tokens with an earlier one reads
    them from the cache): HF's greedy tokens on the twin; each stage reports its weight bytes by
    dtype (together the twin's bytes) and the KV capacity is the blocks' tokens. (One start: the
    module's other splits and layouts are the same loading, run in-process above; the MoE engine
    runs test_fp8.py had at PP = 2 -- Qwen3-MoE and DeepSeek-V3 block, chunked prefill and prefix
    caching -- are folded into this one.)"""
    from zpp import LLM, SamplingParams
    family, layout, partition = "deepseek-v3", "block", (1, 2, 1)
    d, deq = ckpt(family, layout)
    shared = prompts[2][:32] + [11, 12, 13]
    ref = hf_greedy(deq, prompts + [shared], MAX_NEW)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(d, pipeline_parallel_size=3, pp_layer_partition=partition, max_num_batched_tokens=16,
             enable_prefix_caching=True, kv_cache_memory="32MiB") as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        hits = llm.engine.kv.prefix_hits
        outs += llm.generate([shared], sp, use_tqdm=False)
        assert llm.engine.kv.prefix_hits - hits == 32
        stats = llm.engine.stats()
    assert [list(o.outputs[0].token_ids) for o in outs] == ref, f"{family} {layout} PP=3 {partition}"
    assert len(stats.stage_weight_bytes) == 3 and all(set(s) == {"fp32"} for s in stats.stage_weight_bytes)
    assert sum(s["fp32"] for s in stats.stage_weight_bytes) == _bytes(deq)   # (the same tensors, fp32)
    assert stats.kv_cache_tokens == stats.num_kv_blocks * 16 > 0


@pytest.mark.slow
def test_checkpoints_in_the_release_layouts(ckpt):
    """What the writer made is what the releases hold: FP8 experts (per expert or fused) with
    their block grids (ceil-div) / per-channel scales, bf16 routers, norms and embeddings,
    DeepSeek's shared experts, dense MLP and MLA projections FP8 with partial last blocks, its
    ``e_score_correction_bias`` float32; the compressed-tensors config ignores the routers."""
    for family, layout in LAYOUTS:
        d, _ = ckpt(family, layout)
        index = _index(d)
        assert index[ROUTER[family]].dtype == "BF16" and index["model.embed_tokens.weight"].dtype == "BF16"
        assert index["model.norm.weight"].dtype == "BF16"
        if layout == "block-fused":
            p = "model.layers.0.mlp.experts."
            gu, s = index[p + "gate_up_proj"], index[p + "gate_up_proj_scale_inv"]
            assert (gu.dtype, gu.shape, s.shape) == ("F8_E4M3", (4, 256, 128), (4, 2, 1))
            assert index[p + "down_proj_scale_inv"].shape == (4, 1, 1)
            continue
        w = EXPERT[family].format(PROJ[family][0])
        assert index[w].dtype == "F8_E4M3"
        scale = index[w[: -len("weight")] + ("weight_scale_inv" if layout == "block" else "weight_scale")]
        assert scale.shape == {"block": (1, 1), "ct-channel": (128, 1), "ct-tensor": (1,)}[layout]
        assert scale.dtype == "F32"
        with open(os.path.join(d, "config.json")) as f:
            q = json.load(f)["quantization_config"]
        if layout.startswith("ct"):
            assert q["ignore"] == list(IGNORE[family])
        else:
            assert q["weight_block_size"] == [128, 128]
        if family == "deepseek-v3":
            p = "model.layers.2.mlp."
            assert index[p + "gate.e_score_correction_bias"].dtype == "F32"
            assert index[p + "shared_experts.down_proj.weight"].dtype == "F8_E4M3"
            assert index["model.layers.0.mlp.down_proj.weight"].dtype == "F8_E4M3"          # dense layer
            a = "model.layers.0.self_attn."
            assert index[a + "kv_a_proj_with_mqa.weight"].shape == (48, 128)
            assert index[a + "kv_b_proj.weight"].dtype == "F8_E4M3"
            if layout == "block":   # 48 rows, 96-wide dense MLP: one partial block each
                assert index[a + "kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 1)
                assert index["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
                assert index[a + "q_b_proj.weight_scale_inv"].shape == (2, 1)             # 192 rows


def _stage(d: str, keep_fp8: bool, dtype=torch.bfloat16, load_format="safetensors", quantization=None):
    from zpp.models import quantization as q
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    cfg = _config(d)
    orig = q.fp8_supported
    q.fp8_supported = (lambda device: True) if keep_fp8 else orig
    try:
        return load_stage_model(d, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), dtype, torch.device("cpu"), 256,
                                load_format, quantization=quantization)
    finally:
        q.fp8_supported = orig


def _experts(model, family):
    layer = model.model.layers[MOE_LAYER[family]]
    return layer.mlp.experts, layer.mlp.gate


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("qwen3-moe", "block"), ("qwen3-moe", "block-fused"),
                                            ("mixtral", "ct-channel"), ("deepseek-v3", "block"),
                                            ("deepseek-v3", "ct-tensor")])
def test_experts_kept_fp8(ckpt, family, layout):
    """The GPU's loading path on the CPU: experts e4m3 with their canonical scales (block grids
    ``[E, 2I/128, H/128]`` / ``[E, H/128, I/128]``, per channel ``[E, 2I]`` / ``[E, H]``, a per-tensor
    scale broadcast to its rows) dequantizing exactly to the checkpoint's, per-expert or fused;
    routers in their dtype; the expert layer's output equal to the dequantized model's; fp8 bytes
    as in the file."""
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
    if layout.startswith("block"):
        assert ex.gate_up_proj_scale.shape == (E, 2 * I // 128, -(-H // 128))
        assert ex.down_proj_scale.shape == (E, -(-H // 128), I // 128)
    else:
        assert ex.gate_up_proj_scale.shape == (E, 2 * I) and ex.down_proj_scale.shape == (E, H)
    # the model's dtype (bf16 here), the file's bf16 router loaded as it is; DeepSeek's router is fp32
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
    if family == "deepseek-v3":   # as vLLM: shared experts and MLA projections FP8, kv_b_proj not
        moe, attn = model.model.layers[MOE_LAYER[family]].mlp, model.model.layers[0].self_attn
        for lin in (moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj, attn.q_a_proj, attn.q_b_proj,
                    attn.kv_a_proj_with_mqa, attn.o_proj):
            assert lin.weight.dtype == torch.float8_e4m3fn and lin.fp8 is not None
        assert attn.kv_b_proj.weight.dtype == torch.bfloat16 and attn.kv_b_proj.fp8 is None
        torch.testing.assert_close(attn.kv_b_proj.weight, full["model.layers.0.self_attn.kv_b_proj.weight"].to(
            torch.bfloat16), rtol=0, atol=0)
    # the stage's fp8 bytes: every e4m3 tensor of the file the layout keeps (experts, shared experts
    # and MLA projections; not DeepSeek's kv_b_proj, which MLA reads outside the layer)
    index = _index(d)
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
