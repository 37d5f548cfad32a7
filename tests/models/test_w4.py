"""The 4-bit formats (MXFP4, compressed-tensors pack-quantized, GPTQ, AWQ): each repacked into
zpp's one 4-bit layout and dequantized on the CPU exactly by the format's own rule --

* MXFP4 bit for bit equal to HF transformers' ``convert_moe_packed_tensors`` (bf16 and fp32, every
  E8M0 exponent);
* pack-quantized equal to ``compressed_tensors``' own unpacking and dequantization (symmetric and
  asymmetric, groups 32 and 128, rows not a multiple of 8), its configs validate with the package;
* GPTQ (v1 zeros + 1, sym and asym) and AWQ (interleaved nibble order) against a hand-computed
  example and against AutoGPTQ's / AutoAWQ's unpacking written out in tests/w4_checkpoint.py;
* refusals (act-order, bits != 4, other AWQ versions, ...) in one line naming the field;

and end to end, tiny random checkpoints in each release's exact layout (gpt-oss MXFP4 as released;
DeepSeek-V3 with only the routed experts in pack-quantized int4 group 32 and Kimi K2-Thinking's
``ignore``; Llama in GPTQ and in AWQ): on the CPU zpp's greedy ids equal HF transformers' on the
dequantized twin (an engine for gpt-oss at PP = 3 uneven and DeepSeek-V3 at PP = 2; Llama's splits
chained in process), and every stage's
weights equal the twin's as zpp loads it (the stage's weight report counts them dequantized).
"""
from __future__ import annotations

import math
import os
import random
import shutil

import pytest
import torch

from helpers import hf_greedy
from w4_checkpoint import (AWQ_ORDER, KIMI_K2_THINKING_IGNORE, awq_reference, gptq_reference, pack_along,
                          quantize_int4, quantize_mxfp4, write_w4_checkpoint)

VOCAB = 49152
MAX_NEW = 8


def _get(d: dict):
    return lambda name: d[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# --- MXFP4 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantization_is_transformers_bit_for_bit(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from zpp.models.quantization.base import PlannedTensor
    from zpp.models.quantization.mxfp4 import Mxfp4Config
    g = torch.Generator().manual_seed(0)
    E, N, K = 3, 10, 96
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8, generator=g)   # every exponent
    scales[0, :, 0] = torch.arange(117, 127)                                             # and the usual ones
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)                        # [E, K, N]
    t = {"x_blocks": blocks, "x_scales": scales}
    got = Mxfp4Config().materialize(PlannedTensor("x", "dequantize", "x_blocks", "x_scales", dtype), _get(t),
                                    torch.device("cpu"))
    assert got.shape == ref.shape == (E, K, N) and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(ref))


def test_mxfp4_quantizer_round_trips():
    """The tests' quantizer: a weight made of e2m1 values times powers of two comes back exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(1)
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w = vals[torch.randint(0, 15, (2, 4, 64), generator=g)]
    w[..., 0] = 6.0                                      # every block's amax 6: exponent 0
    w[:, :, 32] = -6.0
    w = w * 2.0 ** torch.randint(-3, 4, (2, 4, 1), generator=g)
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2), w)


# --- compressed-tensors pack-quantized -----------------------------------------------------------
@pytest.mark.parametrize("group, symmetric, n", [(32, True, 16), (128, True, 8), (32, False, 12), (128, False, 24)])
def test_pack_quantized_equals_compressed_tensors(group, symmetric, n):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from zpp.models.quantization.base import PlannedTensor
    from zpp.models.quantization.int4_compressed import PackQuantizedConfig
    torch.manual_seed(2)
    K = 256
    w = torch.randn(n, K)
    q, s, z = quantize_int4(w, group, symmetric)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    sd = {"weight": w.to(torch.bfloat16), "weight_scale": s.to(torch.bfloat16)}
    if not symmetric:
        sd["weight_zero_point"] = (z - 8).to(torch.int8)
    packed = PackedQuantizationCompressor.compress(sd, scheme)           # the library's own packing
    assert set(packed) == {"weight_packed", "weight_scale", "weight_shape"} | (set() if symmetric else
                                                                               {"weight_zero_point"})
    ref = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    t = {f"x.{k}": v for k, v in packed.items()}
    cfg = PackQuantizedConfig(group_size=group, symmetric=symmetric)
    got = cfg.materialize(PlannedTensor("x.weight", "dequantize", "x.weight_packed", "x.weight_scale", torch.bfloat16),
                          _get(t), torch.device("cpu"))
    assert ref.dtype == torch.bfloat16 and torch.equal(_bits(got), _bits(ref))
    qweight, scales, zeros = cfg.repack("x", _get(t))
    assert qweight.shape == (n, K // 2) and qweight.dtype == torch.uint8 and torch.equal(scales, t["x.weight_scale"])
    assert (zeros is None) == symmetric
    if not symmetric:
        assert torch.equal(zeros.long(), z)


def test_pack_quantized_configs_validate_with_compressed_tensors():
    """Kimi K2-Thinking's quantization_config (and its asymmetric / group-128 variants) parse with
    compressed-tensors' own model, and zpp reads the same scheme from it."""
    from compressed_tensors.quantization import QuantizationConfig as CtConfig

    from zpp.models.quantization import parse_quantization_config
    from zpp.models.quantization.int4_compressed import PackQuantizedConfig, ignored
    for group, sym in ((32, True), (128, False)):
        q = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                           "targets": ["Linear"],
                                           "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                       "group_size": group, "num_bits": 4, "observer": "minmax",
                                                       "observer_kwargs": {}, "strategy": "group",
                                                       "symmetric": sym, "type": "int"}}},
             "format": "pack-quantized", "ignore": KIMI_K2_THINKING_IGNORE, "kv_cache_scheme": None,
             "quant_method": "compressed-tensors", "quantization_status": "compressed"}
        ct = CtConfig.model_validate(q)
        w = ct.config_groups["group_0"].weights
        got = parse_quantization_config({"quantization_config": q})
        assert isinstance(got, PackQuantizedConfig)
        assert (got.group_size, got.symmetric, got.ignore) == (w.group_size, w.symmetric, tuple(ct.ignore))
    assert ignored("model.layers.3.self_attn.q_a_proj", KIMI_K2_THINKING_IGNORE)
    assert ignored("model.layers.3.mlp.shared_experts.up_proj", KIMI_K2_THINKING_IGNORE)
    assert ignored("model.layers.0.mlp.down_proj", KIMI_K2_THINKING_IGNORE)
    assert ignored("lm_head", KIMI_K2_THINKING_IGNORE)
    assert not ignored("model.layers.3.mlp.experts.7.down_proj", KIMI_K2_THINKING_IGNORE)


# --- GPTQ / AWQ ----------------------------------------------------------------------------------
def test_gptq_hand_computed_example():
    """K = 8 rows, N = 8 columns, one group: qweight word [0, n] holds rows 0..7 of column n at bits
    4i; qzeros word [0, 0] the eight columns' zeros - 1 (v1); w = s * (q - (stored + 1))."""
    from zpp.models.quantization.gptq import GptqConfig
    from zpp.models.quantization.w4_layout import dequantize_w4
    # column n: rows k hold q = (k + n) % 16; column zeros stored 3 + n % 4 (zero 4 + n % 4); scale 0.5 + n
    words = []
    for n in range(8):
        v = 0
        for k in range(8):
            v |= ((k + n) % 16) << (4 * k)
        words.append(v - 2 ** 32 if v >= 2 ** 31 else v)
    z = 0
    for n in range(8):
        z |= (3 + n % 4) << (4 * n)
    t = {"x.qweight": torch.tensor([words], dtype=torch.int32), "x.qzeros": torch.tensor([[z]], dtype=torch.int32),
         "x.scales": torch.tensor([[0.5 + n for n in range(8)]], dtype=torch.float16)}
    want = torch.tensor([[(0.5 + n) * ((k + n) % 16 - (4 + n % 4)) for k in range(8)] for n in range(8)])
    cfg = GptqConfig(group_size=8, sym=False)
    qweight, scales, zeros = cfg.repack("x", _get(t))
    assert torch.equal(dequantize_w4(qweight, scales, zeros, 8, "int4", torch.float32), want)
    t["x.g_idx"] = torch.zeros(8, dtype=torch.int32)
    assert torch.equal(gptq_reference(t["x.qweight"], t["x.qzeros"], t["x.scales"], t["x.g_idx"]), want)


def test_awq_hand_computed_example():
    """One row k, eight columns: nibble i of the word holds column AWQ_ORDER[i]."""
    from zpp.models.quantization.awq import AwqConfig
    from zpp.models.quantization.w4_layout import dequantize_w4
    cols = [3, 9, 1, 14, 0, 7, 12, 5]                       # q of columns 0..7
    zc = [8, 2, 3, 4, 5, 6, 7, 1]
    word = sum(cols[AWQ_ORDER[i]] << (4 * i) for i in range(8))
    zword = sum(zc[AWQ_ORDER[i]] << (4 * i) for i in range(8))
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [3, 1, 0, 12, 9, 14, 7, 5]
    t = {"x.qweight": torch.tensor([[word - 2 ** 32 if word >= 2 ** 31 else word]] * 2, dtype=torch.int32),
         "x.qzeros": torch.tensor([[zword]], dtype=torch.int32),
         "x.scales": torch.tensor([[0.25 * (n + 1) for n in range(8)]], dtype=torch.float16)}
    want = torch.tensor([[0.25 * (n + 1) * (cols[n] - zc[n])] * 2 for n in range(8)])       # [N, K = 2]
    qweight, scales, zeros = AwqConfig(group_size=2).repack("x", _get(t))
    assert torch.equal(dequantize_w4(qweight, scales, zeros, 2, "int4", torch.float32), want)
    assert torch.equal(awq_reference(t["x.qweight"], t["x.qzeros"], t["x.scales"], 2), want)


@pytest.mark.parametrize("fmt, group, symmetric", [("gptq", 32, True), ("gptq", 128, False), ("awq", 32, False),
                                                   ("awq", 128, False)])
def test_gptq_awq_equal_their_reference(fmt, group, symmetric):
    from zpp.models.quantization.awq import AwqConfig
    from zpp.models.quantization.base import PlannedTensor
    from zpp.models.quantization.gptq import GptqConfig
    torch.manual_seed(3)
    N, K = 40, 256
    q, s, z = quantize_int4(torch.randn(N, K), group, symmetric)
    if fmt == "gptq":
        t = {"x.qweight": pack_along(q.t(), 0), "x.qzeros": pack_along((z - 1).t(), 1),
             "x.scales": s.t().to(torch.float16), "x.g_idx": (torch.arange(K) // group).to(torch.int32)}
        ref = gptq_reference(t["x.qweight"], t["x.qzeros"], t["x.scales"], t["x.g_idx"])
        cfg = GptqConfig(group_size=group, sym=symmetric)
    else:
        t = {"x.qweight": pack_along(q.t(), 1, AWQ_ORDER), "x.qzeros": pack_along(z.t(), 1, AWQ_ORDER),
             "x.scales": s.t().to(torch.float16)}
        ref = awq_reference(t["x.qweight"], t["x.qzeros"], t["x.scales"], group)
        cfg = AwqConfig(group_size=group)
    want = (q - z.repeat_interleave(group, 1)).float() * s.to(torch.float16).float().repeat_interleave(group, 1)
    assert torch.equal(ref, want)                                          # the reference is the quantizer's inverse
    got = cfg.materialize(PlannedTensor("x.weight", "dequantize", "x.qweight", "x.scales", torch.float32), _get(t),
                          torch.device("cpu"))
    assert torch.equal(got, ref)
    _, _, zeros = cfg.repack("x", _get(t))
    assert (zeros is None) == (fmt == "gptq" and symmetric)                 # symmetric GPTQ: the implicit 8


def test_gptq_act_order_g_idx_refused():
    from zpp.models.quantization.gptq import GptqConfig
    t = {"x.qweight": torch.zeros(4, 8, dtype=torch.int32), "x.qzeros": torch.zeros(1, 1, dtype=torch.int32),
         "x.scales": torch.ones(1, 8, dtype=torch.float16), "x.g_idx": torch.zeros(32, dtype=torch.int32)}
    t["x.g_idx"][5] = 1
    with pytest.raises(ValueError, match="x.g_idx .*act-order"):
        GptqConfig(group_size=32).repack("x", _get(t))


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "desc_act True"),
    ({"quant_method": "gptq", "bits": 8}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 3}, "bits 3"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point False"),
    ({"quant_method": "mxfp4", "block_size": 16}, "block size 16"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
     "with 8 bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "channel"}}}},
     "weight strategy 'channel'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128,
                                          "actorder": "group"}}}}, "actorder 'group'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128},
                              "input_activations": {"type": "int", "num_bits": 8}}}}, "quantized activations"),
    ({"quant_method": "hqq"}, "quant_method 'hqq'"),
])
def test_refused_in_one_line(qc, match):
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "quantization_config": qc}
    with pytest.raises(ConfigError, match=match) as e:
        resolve_model_class(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("LlamaForCausalLM: ")


# --- end to end: tiny checkpoints in each release's layout ---------------------------------------
def _copy_tokenizer(src: str, dst: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


def _llama_src(out: str, demo_model: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.3, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.float32).eval().save_pretrained(out)
    _copy_tokenizer(demo_model, out)
    return out


def _gpt_oss_src(out: str, demo_model: str) -> str:
    from test_models_gpt_oss import _config, _randomize
    from transformers import GptOssForCausalLM
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config(num_hidden_layers=4, hidden_size=64, intermediate_size=64)).eval()
    _randomize(model)
    model.save_pretrained(out)
    _copy_tokenizer(demo_model, out)
    return out


def _deepseek_src(out: str, demo_model: str) -> str:
    from test_models_deepseek import _save, _v3
    return _save(_v3, out, demo_model, num_hidden_layers=4)


# model -> (source maker, format, group, symmetric, the engine's split; None: no engine start, the
# splits of IN_PROCESS chained in this process -- the loading is the engine's, the Llama path too)
MODELS = {
    "gpt-oss-mxfp4": (_gpt_oss_src, "mxfp4", 32, True, dict(pipeline_parallel_size=3, pp_layer_partition=(1, 2, 1))),
    "deepseek-v3-kimi-int4": (_deepseek_src, "ct-int4", 32, True, dict(pipeline_parallel_size=2)),
    "llama-gptq": (_llama_src, "gptq", 128, True, None),
    "llama-awq": (_llama_src, "awq", 32, False, None),
}
IN_PROCESS = [(4,), (2, 2), (1, 2, 1)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_model):
    """model -> (4-bit checkpoint dir, its dequantized twin, the names quantized)."""
    made: dict[str, tuple[str, str, list[str]]] = {}
    srcs: dict[str, str] = {}

    def get(model: str):
        if model not in made:
            maker, fmt, group, sym, _ = MODELS[model]
            if maker not in srcs:
                srcs[maker] = maker(str(tmp_path_factory.mktemp(maker.__name__)), demo_model)
            d = str(tmp_path_factory.mktemp(model))
            names = write_w4_checkpoint(srcs[maker], d, fmt, d + "-deq", group=group, symmetric=sym)
            made[model] = (d, d + "-deq", names)
        return made[model]
    return get


def _stage(d: str, stage: int, layers: tuple[int, int], pp: int, tp_rank: int = 0, tp_size: int = 1):
    import json

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    cfg = json.load(open(os.path.join(d, "config.json")))
    info = StageInfo(stage, pp, layers[0], layers[1], tp_rank, tp_size)
    return load_stage_model(d, cfg, info, torch.float32, torch.device("cpu"), 256)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_stage_weights_equal_the_dequantized_twin(ckpt, model):
    """Each stage of a 3-way uneven split (and the TP = 2 rank 1 slice of the middle one) loads
    exactly the twin's weights (the format's rule, as the library dequantizes it), and the weight
    report counts them dequantized (no 4-bit bytes on the CPU). The 4-bit checkpoint really is
    quantized where the release is, and only there."""
    import json

    from zpp.models.weight_bytes import weight_bytes_by_dtype
    d, deq, names = ckpt(model)
    fmt = MODELS[model][1]
    n = json.load(open(os.path.join(d, "config.json")))["num_hidden_layers"]
    assert names, "nothing quantized"
    if fmt == "mxfp4":
        assert all(".mlp.experts." in x for x in names) and len(names) == 2 * n
    elif fmt == "ct-int4":
        from zpp.models.quantization.int4_compressed import ignored
        assert all(".mlp.experts." in x and not ignored(x[: -len(".weight")], KIMI_K2_THINKING_IGNORE) for x in names)
        assert not any(".shared_experts." in x or ".self_attn." in x for x in names)
    else:
        assert len(names) == 7 * n
    cuts = [(0, 1, 0, 1), (1, n - 1, 0, 1), (n - 1, n, 0, 1), (1, n - 1, 1, 2)]
    for a, b, rank, tp in cuts:
        s = 0 if a == 0 else (2 if b == n else 1)
        got, ref = _stage(d, s, (a, b), 3, rank, tp), _stage(deq, s, (a, b), 3, rank, tp)
        gp, rp = got.state_dict(), ref.state_dict()  # dense (a float32 CPU stage packs its linears)
        assert gp.keys() == rp.keys()
        for k in gp:
            assert torch.equal(gp[k], rp[k]), f"{model} stage {s}: {k}"
        assert weight_bytes_by_dtype(got) == weight_bytes_by_dtype(ref) and "uint8" not in weight_bytes_by_dtype(got)


def _w4_prompts() -> list[list[int]]:
    rng = random.Random(48)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 30)]


@pytest.mark.slow
@pytest.mark.parametrize("model", [m for m in MODELS if MODELS[m][4] is not None])
def test_greedy_matches_hf_on_the_dequantized_weights(ckpt, model):
    """One engine per model (gpt-oss at PP = 3 split 1/2/1, DeepSeek-V3 at PP = 2), several prompts
    batched, chunked prefill; the stages of a 3-way uneven split of every model load exactly the
    twin's weights (the test above); Llama GPTQ and AWQ: the test below."""
    from zpp import LLM, SamplingParams
    d, deq, _ = ckpt(model)
    prompts = _w4_prompts()
    reference = hf_greedy(deq, prompts, MAX_NEW)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(d, max_num_batched_tokens=16, kv_cache_memory="16MiB", **MODELS[model][4]) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    for i, ref in enumerate(reference):
        assert got[i] == ref, f"{model}: prompt {i}"


@pytest.mark.slow
@pytest.mark.parametrize("model", [m for m in MODELS if MODELS[m][4] is None])
def test_splits_in_process_match_hf_on_the_dequantized_weights(ckpt, model, one_torch_thread):
    """Llama in GPTQ and AWQ: PP = 1 (decoding token by token), 2 and 3, each stage loading its
    part of the 4-bit checkpoint as a worker does and chained in this process: HF's greedy tokens
    on the dequantized twin, every prompt (the engine path: the gpt-oss and DeepSeek starts above)."""
    from stage_chain import check_splits
    d, deq, _ = ckpt(model)
    prompts = _w4_prompts()
    check_splits(d, prompts, hf_greedy(deq, prompts, MAX_NEW), IN_PROCESS, label=model)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt-oss-mxfp4", "deepseek-v3-kimi-int4"])
def test_plan_counts_4bit_bytes_as_held(ckpt, model):
    """``zpp plan``'s meta-device build (the loader's own decisions, headers only): for an sm90 GPU
    the 4-bit weights count as the packed bytes + scales where the W4A16 methods exist
    (``zpp.models.quantization.w4a16``), else -- and on the CPU -- dequantized to bf16, exactly the
    twin's bytes."""
    import importlib
    import json

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.quantization.checkpoint import read_index
    from zpp.models.weight_bytes import weight_bytes_by_dtype
    d, deq, names = ckpt(model)
    cfg = json.load(open(os.path.join(d, "config.json")))
    n = cfg["num_hidden_layers"]
    info = StageInfo(0, 1, 0, n)

    def held(path, capability):
        c = json.load(open(os.path.join(path, "config.json")))
        m = load_stage_model(path, c, info, torch.bfloat16, torch.device("meta"), 256, capability=capability)
        return weight_bytes_by_dtype(m)
    deq_bytes = held(deq, None)
    assert held(d, None) == deq_bytes                                    # CPU: dequantized
    try:
        importlib.import_module("zpp.models.quantization.w4a16")
        methods = True
    except ImportError:
        methods = False
    gpu = held(d, (9, 0))
    if not methods:
        assert gpu == deq_bytes
        return
    index = read_index([os.path.join(d, "model.safetensors")])
    packed = sum(math.prod(i.shape) * 4 for k, i in index.items() if i.dtype == "I32" and not k.endswith("g_idx")) \
        + sum(math.prod(i.shape) for k, i in index.items() if i.dtype == "U8" and k.endswith("_blocks"))
    assert gpu.get("uint8", 0) >= packed                                  # the codes, kept packed
    saved = sum(deq_bytes.values()) - sum(gpu.values())
    as_bf16 = sum(math.prod(i.shape) * (4 if k.endswith("_blocks") else 16)    # 2 / 8 codes an element, 2 bytes
                  for k, i in index.items() if k.endswith(("_blocks", ".weight_packed")))
    assert saved >= as_bf16 * 0.6                                        # ~4x smaller than bf16 where 4-bit


@pytest.mark.slow
@pytest.mark.parametrize("model, weight", [
    ("gpt-oss-mxfp4", "model.layers.1.mlp.experts.gate_up_proj_blocks"),
    ("llama-awq", "model.layers.2.self_attn.k_proj.qweight"),
    ("llama-gptq", "model.layers.0.mlp.down_proj.qweight"),
    ("deepseek-v3-kimi-int4", "model.layers.2.mlp.experts.5.up_proj.weight_packed")])
def test_kept_weights_hand_over_the_w4_layout(ckpt, model, weight):
    """What a GPU's W4A16 method receives for a kept weight (:meth:`W4Config.plan_kept`): canonical
    ``qweight`` uint8 ``[..., N, K/2]``, ``scales``, ``zeros`` (asymmetric only), which
    ``dequantize_w4`` turns into exactly the twin's weight (rows as the checkpoint's: gpt-oss's
    gate_up stays interleaved)."""
    import json

    from safetensors import safe_open

    from zpp.models.quantization import parse_quantization_config
    from zpp.models.quantization.checkpoint import read_index
    from zpp.models.quantization.w4_layout import dequantize_w4
    d, deq, _ = ckpt(model)
    quant = parse_quantization_config(json.load(open(os.path.join(d, "config.json"))))
    index = read_index([os.path.join(d, "model.safetensors")])
    planned = quant.plan_kept(index, weight, None)
    loaded = quant.loaded_name(weight)
    stem = loaded[: -len("weight")] if loaded.endswith(".weight") else loaded + "_"
    roles = ["qweight", "scales"] + (["zeros"] if model == "llama-awq" else [])
    assert [t.name for t in planned] == [stem + r for r in roles]
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        got = {t.name.rsplit(".", 1)[-1].rsplit("_", 1)[-1]: quant.materialize(t, f.get_tensor, torch.device("cpu"))
               for t in planned}
    with safe_open(os.path.join(deq, "model.safetensors"), "pt") as f:
        ref = f.get_tensor(loaded)
    if model == "gpt-oss-mxfp4":
        ref = ref.transpose(1, 2)                                          # [E, 2I (interleaved), H]
    assert got["qweight"].dtype == torch.uint8 and got["qweight"].shape == (*ref.shape[:-1], ref.shape[-1] // 2)
    w = dequantize_w4(got["qweight"], got["scales"], got.get("zeros"), quant.group_size, quant.fmt, torch.float32)
    assert torch.equal(w, ref)


@pytest.mark.parametrize("fmt, group, zeros", [("mxfp4", 32, False), ("int4", 32, False), ("int4", 128, True)])
def test_dummy_quantizer_is_the_formats_rounding(fmt, group, zeros):
    """``quantize_w4`` (``--load-format dummy`` with a 4-bit config): MXFP4 codes equal the tests'
    independent quantizer's; int4 within half a step of every weight (nothing clips)."""
    from zpp.models.quantization.w4_base import quantize_w4
    from zpp.models.quantization.w4_layout import dequantize_w4
    torch.manual_seed(5)
    w = torch.randn(2, 24, 256, dtype=torch.bfloat16)
    qweight, scales, z = quantize_w4(w, group, fmt, zeros)
    assert qweight.shape == (2, 24, 128) and scales.shape == (2, 24, 256 // group) and (z is not None) == zeros
    if fmt == "mxfp4":
        blocks, ref_scales = quantize_mxfp4(w)
        assert torch.equal(qweight, blocks.reshape(2, 24, 128)) and torch.equal(scales, ref_scales)
        return
    deq = dequantize_w4(qweight, scales, z, group, fmt, torch.float32)
    step = scales.float().repeat_interleave(group, -1)
    assert ((deq - w.float()).abs() <= step / 2 + 1e-6).all()
    assert int(torch.stack([qweight & 15, qweight >> 4]).max()) == 15     # the whole code range is used


@pytest.mark.parametrize("fmt, weight, present, missing", [
    ("mxfp4", "m.experts.down_proj_blocks", [], "m.experts.down_proj_scales"),
    ("ct", "m.down_proj.weight_packed", ["m.down_proj.weight_shape"], "m.down_proj.weight_scale"),
    ("gptq", "m.down_proj.qweight", ["m.down_proj.scales"], "m.down_proj.qzeros"),
    ("awq", "m.down_proj.qweight", ["m.down_proj.qzeros"], "m.down_proj.scales")])
def test_missing_companion_tensor_is_named(fmt, weight, present, missing):
    """A 4-bit weight without its scales / zeros / shape is refused from the headers, the tensor named."""
    from zpp.models.quantization.awq import AwqConfig
    from zpp.models.quantization.base import TensorInfo
    from zpp.models.quantization.gptq import GptqConfig
    from zpp.models.quantization.int4_compressed import PackQuantizedConfig
    from zpp.models.quantization.mxfp4 import Mxfp4Config
    cfg = {"mxfp4": Mxfp4Config(), "ct": PackQuantizedConfig(), "gptq": GptqConfig(), "awq": AwqConfig()}[fmt]
    index = {n: TensorInfo("f", "U8" if fmt == "mxfp4" else "I32", (4, 4)) for n in [weight] + present}
    assert cfg.is_quantized(index[weight])
    assert cfg.weight_kind(index, weight) is None and all(cfg.is_auxiliary(n) for n in present)
    with pytest.raises(ValueError, match=f"{weight}.* has no {missing}"):
        cfg.plan_dequantize(index, weight, torch.float32)
