"""FP8 checkpoints (compressed-tensors per channel / per tensor with static input scales, and 128 x 128
block scales) on the CPU, where every FP8 weight is dequantized on load: zpp's greedy tokens equal HF
transformers' (fp32, CPU) on the same checkpoint dequantized, at PP = 1, 2 and 3 (stages chained
in process) and through the engine at PP = 2 with chunked prefill and prefix caching; HF itself reads the FP8 checkpoints to those same weights (compressed-tensors
with ``dequantize=True``; block FP8 where its dequantizer is right, see ``test_hf_reads_fp8``).
Tiny Llama dims are not multiples of 128 (partial blocks: 192, 320, 64); the Qwen3-MoE one's are
(its FP8 experts are dequantized too); the real SmolLM2 (demo model) has 576 / 192 / 1536. The MoE
families (Qwen3-MoE, Mixtral, DeepSeek-V3's MLA) through the engine and every split: test_fp8_moe.py.

Also: the layer-by-layer FP8 loading a GPU with FP8 does (weights kept in e4m3 with canonical scales,
merged q/k/v, tensor-parallel slices, block grids), run here on the CPU; a missing scale or weight is
named; unsupported quantization configs and the FP8 flags on the CPU are refused in one line."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from helpers import hf_greedy
from fp8_checkpoint import write_fp8_checkpoint

MAX_NEW = 10
VOCAB = 49152
PROMPT_LENS = (3, 17, 40)


def _llama():  # dims not multiples of 128: partial 128-blocks everywhere
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(vocab_size=VOCAB, hidden_size=192, intermediate_size=320, num_hidden_layers=3,
                                         num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _qwen3_moe():  # dims multiples of 128 (k/v 64: one partial block); layer 1 dense
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2)


FAMILIES = {"llama": _llama, "qwen3-moe": _qwen3_moe}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(25)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, demo_model):
    """(family, layout) -> (FP8 checkpoint dir, its dequantized twin); family ``smollm2`` = the demo model."""
    made: dict[tuple[str, str], tuple[str, str]] = {}
    srcs: dict[str, str] = {}

    def get(family: str, layout: str, **kw) -> tuple[str, str]:
        key = (family, layout) + tuple(sorted(kw.items()))
        if key not in made:
            if family not in srcs:
                if family == "smollm2":
                    srcs[family] = demo_model
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
            write_fp8_checkpoint(srcs[family], d, layout, dequantized_dst=d + "-deq", **kw)
            made[key] = (d, d + "-deq")
        return made[key]
    return get


def _greedy(llm, prompts, n=MAX_NEW):
    from zpp import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


# Each layout at PP = 1 and 2 across the families (a layout's loading does not depend on the split:
# every stage runs the same loader on its own tensors; ct-tensor loads as per channel). Two engines
# for the suite's time: Llama ct-tensor and the real SmolLM2 in the block layout (its 576 rows end on
# a partial block), both at PP = 2; every Llama layout's PP = 1, 2, 3 chained in process; the MoE
# families' engine run (DeepSeek-V3 block, chunked prefill and prefix caching) is test_fp8_moe.py's,
# their every split and layout in-process there.
@pytest.mark.slow
@pytest.mark.parametrize("family, layout, pp", [("llama", "ct-tensor", 2), ("smollm2", "block", 2)])
def test_greedy_matches_hf(ckpt, prompts, family, layout, pp):
    """Batched prompts cut into chunks of at most 16 tokens, prefix caching on (a request sharing 32
    tokens with an earlier one reads them from the cache)."""
    from zpp import LLM
    d, deq = ckpt(family, layout)
    shared = prompts[2][:32] + [11, 12, 13]
    reference = hf_greedy(deq, prompts + [shared], MAX_NEW)
    with LLM(d, pipeline_parallel_size=pp, max_num_batched_tokens=16, enable_prefix_caching=True,
             kv_cache_memory="64MiB") as llm:
        got = _greedy(llm, prompts)
        hits = llm.engine.kv.prefix_hits
        got.append(_greedy(llm, [shared])[0])
        assert llm.engine.kv.prefix_hits - hits == 32
    for i, ref in enumerate(reference):
        assert got[i] == ref, f"{family} {layout} PP={pp}, prompt {i}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "block"])
def test_llama_splits_in_process_match_hf(ckpt, prompts, layout, one_torch_thread):
    """The tiny Llama in every layout at PP = 1 (decoding token by token), 2 and 3, each stage loading
    its part of the FP8 checkpoint (dequantized on load) as a worker does, chained in this process:
    HF's greedy tokens on the dequantized twin, every prompt."""
    from stage_chain import check_splits
    d, deq = ckpt("llama", layout)
    check_splits(d, prompts, hf_greedy(deq, prompts, MAX_NEW), [(3,), (2, 1), (1, 1, 1)], label=f"llama {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", [("llama", "ct-channel"), ("llama", "ct-tensor"), ("qwen3-moe", "block")])
def test_hf_reads_fp8(ckpt, family, layout):
    """HF transformers loading the FP8 checkpoint itself (compressed-tensors with ``dequantize=True``;
    block FP8 dequantized automatically on a CPU) computes the logits of the dequantized twin that
    the parity tests take as the reference. (HF's block dequantizer derives the block from the scale
    grid's shape, ``rows // grid_rows``, so for dims with a partial block other than a single one --
    the tiny Llama's 192 and 320, SmolLM2's 576 -- it is wrong or raises: those are checked against
    the twin only.)"""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    d, deq = ckpt(family, layout)
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if layout.startswith("ct") else {}
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
    ref = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 900, 17, 4000, 23, 77]])
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=0, atol=0)


def _stage_model(d: str, tp_rank: int = 0, tp_size: int = 1, keep_fp8: bool = False, pp=(0, 1, 0, None)):
    """Build and load one stage in-process; ``keep_fp8``: take the GPU's path (FP8 weights kept)."""
    from zpp.models import quantization as q
    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    stage = StageInfo(pp[0], pp[1], pp[2], pp[3] if pp[3] is not None else n, tp_rank, tp_size)
    if not keep_fp8:
        return load_stage_model(d, cfg, stage, torch.float32, torch.device("cpu"), 256)
    orig = q.fp8_supported
    q.fp8_supported = lambda device: True
    try:
        return load_stage_model(d, cfg, stage, torch.bfloat16, torch.device("cpu"), 256)
    finally:
        q.fp8_supported = orig


def _full_weights(deq: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(deq, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("family, layout, tp, kept, reverted", [
    ("llama", "ct-tensor", 1, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, set()),
    ("llama", "ct-channel", 2, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, set()),
    # block: q (192 rows) and gate (320) are not the last shards of qkv / gate_up and not block-aligned;
    # o_proj and down_proj (one shard) keep their partial blocks at TP=1; at TP=2 no slice is aligned.
    # Qwen3-MoE (dense layer 1 checked): q's half (64 rows) is not aligned, the MLP's halves (128) are.
    ("llama", "block", 1, {"o_proj", "down_proj"}, {"qkv_proj", "gate_up_proj"}),
    ("llama", "block", 2, set(), {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
    ("qwen3-moe", "block", 2, {"gate_up_proj", "down_proj"}, {"qkv_proj", "o_proj"}),
])
def test_fp8_weights_kept_and_scaled(ckpt, family, layout, tp, kept, reverted):
    """The GPU's loading path, on the CPU: layers whose layout suits the kernels keep e4m3 weights whose
    canonical scales (per-tensor q/k/v scales as per-channel rows of one qkv, block grids, this TP
    rank's slice) dequantize to exactly the checkpoint's weights; the others are dequantized on load.
    Qwen3-MoE at TP=2: every expert's 64-row slice is not a whole 128-block, so its experts are
    dequantized (at TP=1 they stay FP8: test_fp8_moe.py)."""
    from zpp.models.quantization.fp8_utils import dequantize
    d, deq = ckpt(family, layout)
    full = _full_weights(deq)
    for rank in range(tp):
        model = _stage_model(d, rank, tp, keep_fp8=True)
        li = 1 if family == "qwen3-moe" else 0
        layer = model.model.layers[li]
        mods = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
        if hasattr(layer.mlp, "gate_up_proj"):
            mods.update(gate_up_proj=layer.mlp.gate_up_proj, down_proj=layer.mlp.down_proj)
        pre = f"model.layers.{li}."
        ref = {"qkv_proj": [full[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"],
               "o_proj": [full[pre + "self_attn.o_proj.weight"]],
               "gate_up_proj": [full[pre + f"mlp.{x}_proj.weight"] for x in ("gate", "up")],
               "down_proj": [full[pre + "mlp.down_proj.weight"]]}
        for name, mod in mods.items():
            assert (mod.fp8 is not None) == (name in kept), (name, rank)
            if name not in kept:
                assert name in reverted and mod.weight.dtype == torch.bfloat16
            if name in ("o_proj", "down_proj"):      # row-parallel: this rank's columns
                k = mod.in_features
                want = ref[name][0][:, rank * k:(rank + 1) * k]
            else:                                     # column-parallel: this rank's rows of each shard
                want = torch.cat([w.chunk(tp, 0)[rank] for w in ref[name]])
            got = dequantize(mod.weight, mod.fp8.weight_scale, mod.fp8.block, torch.float32) if mod.fp8 else \
                mod.weight.float()
            if mod.fp8 is not None:
                torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
            else:                                     # dequantized on load to bf16
                torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0)
            if layout == "ct-tensor" and mod.fp8 is not None:
                assert mod.fp8.input_scale is not None and mod.fp8.input_scale.numel() == 1
        if family == "qwen3-moe":                     # experts of layer 0: dequantized to bf16
            ex = model.model.layers[0].mlp.experts
            assert ex.down_proj.dtype == torch.bfloat16
            w = full["model.layers.0.mlp.experts.1.down_proj.weight"]
            k = ex.intermediate_size
            torch.testing.assert_close(ex.down_proj[1].float(), w[:, rank * k:(rank + 1) * k].to(torch.bfloat16).float(),
                                       rtol=0, atol=0)


@pytest.mark.slow
def test_fp8_forward_reference_on_cpu(ckpt):
    """A stage whose layers kept FP8 weights runs its forward through the PyTorch stand-in of the GPU
    kernels. One token (the W8A16 GEMV's case: activations not quantized) gives the dequantized
    model's logits up to bf16 rounding (the bf16 model itself is 1.4% from fp32 here); six tokens
    (activations quantized per token) are further off on this deliberately rough random model
    (weights N(0, 0.3): bf16 4%, FP8 activations 18% from fp32), within 30%."""
    from zpp.models.layers.attention import build_attention_metadata
    d, deq = ckpt("llama", "ct-channel")
    fp8, ref = _stage_model(d, keep_fp8=True), _stage_model(deq)
    bf16 = _stage_model(deq).to(torch.bfloat16)

    def logits(m, dt, n):
        meta = build_attention_metadata([0], [n], [[0]], 16, torch.device("cpu"))
        kv = [torch.zeros(2, 2, 16, m.num_kv_heads, m.head_dim, dtype=dt) for _ in range(3)]
        ids = torch.tensor([5, 900, 17, 4000, 23, 77][-n:])
        with torch.inference_mode():
            return m.compute_logits(m(ids, torch.arange(n), None, kv, meta))

    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(logits(fp8, torch.bfloat16, 1), logits(bf16, torch.bfloat16, 1)) < 0.03
    assert rel(logits(fp8, torch.bfloat16, 6), logits(ref, torch.float32, 6)) < 0.3


@pytest.mark.slow
def test_missing_scale_or_weight_is_named(ckpt, tmp_path):
    d = str(tmp_path / "no-scale")
    write_fp8_checkpoint(_src_of(ckpt, "llama"), d, "ct-channel",
                         drop=("model.layers.1.self_attn.k_proj.weight_scale",))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*weight_scale"):
        _stage_model(d)
    # where FP8 weights are kept too (a layer with a scale-less FP8 weight is not kept: it is dequantized)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*weight_scale"):
        _stage_model(d, keep_fp8=True)
    d2 = str(tmp_path / "no-weight")
    write_fp8_checkpoint(_src_of(ckpt, "llama"), d2, "block", drop=("model.layers.2.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.gate_up_proj\.weight \(shards 1 of 2\)"):
        _stage_model(d2)
    # a stage that does not own layer 2 does not care
    _stage_model(d2, pp=(0, 2, 0, 2))


def _src_of(ckpt, family: str) -> str:
    """The unquantized checkpoint a family's FP8 ones are written from (its dequantized twin's
    tokenizer and config are the source's; the weights are rewritten from the twin)."""
    _, deq = ckpt(family, "ct-channel")
    return deq


@pytest.mark.slow
def test_kv_scales_from_checkpoint(ckpt):
    from zpp.models.layers.attention import Attention
    d, _ = ckpt("llama", "ct-channel", kv_scales=True)
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
    model = _stage_model(d, pp=(1, 2, 2, 3))
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attn) == 1 and attn[0].kv_scales_loaded
    assert attn[0].k_scale == pytest.approx(0.07) and attn[0].v_scale == pytest.approx(0.05)


@pytest.mark.slow
def test_configs_validate_with_compressed_tensors(ckpt):
    """The configs the writer makes (and zpp accepts) are valid for the compressed-tensors library."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from zpp.models.quantization import parse_quantization_config
    for layout, block, static in (("ct-channel", None, False), ("ct-tensor", None, True)):
        d, _ = ckpt("llama", layout)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        ct.QuantizationConfig.model_validate(cfg["quantization_config"])
        parsed = parse_quantization_config(cfg)
        assert (parsed.method, parsed.block, parsed.static_activations) == ("compressed-tensors", block, static)
    d, _ = ckpt("llama", "block")
    with open(os.path.join(d, "config.json")) as f:
        assert parse_quantization_config(json.load(f)).block == (128, 128)
    # compressed-tensors' own block scheme (FP8_BLOCK): weight_scale grids, dynamic per-group activations
    scheme = ct.preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    cfg = {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                   "config_groups": {"group_0": scheme.model_dump()}}}
    assert parse_quantization_config(cfg).block == tuple(scheme.weights.block_structure)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "quant_method 'gptq'"),  # 4-bit formats: test_w4.py
    ({"quant_method": "awq", "version": "gemv"}, "quant_method 'awq'"),
    ({"load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}}, "with 8 bits"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}}, "format 'naive-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                                          "symmetric": False}}}}, "asymmetric weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128}}}},
     "weight strategy 'group'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
])
def test_unsupported_quantization_refused_in_one_line(qc, match):
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100, "quantization_config": qc}
    with pytest.raises(ConfigError, match=match) as e:
        resolve_model_class(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("LlamaForCausalLM: ")


def test_fp8_flags_refused_on_cpu(demo_model):
    from zpp import LLM
    from zpp.cli import build_parser, engine_config_from_args
    from zpp.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^--quantization fp8 needs a CUDA GPU of compute capability >= 8\.9 "
                                          r"\(FP8\), but this run is on the CPU$"):
        LLM(demo_model, device="cpu", quantization="fp8")
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype fp8 needs a CUDA GPU .* on the CPU$"):
        LLM(demo_model, device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match=r"--quantization 'int8' is not supported"):
        LLM(demo_model, device="cpu", quantization="int8")
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype 'fp8_e5m2' is not one of"):
        LLM(demo_model, device="cpu", kv_cache_dtype="fp8_e5m2")
    args = build_parser().parse_args(["serve", demo_model, "--device", "cpu", "--quantization", "fp8",
                                      "--kv-cache-dtype", "fp8"])
    with pytest.raises(ConfigError, match="--quantization fp8 needs"):
        engine_config_from_args(args).validate()


@pytest.mark.slow
def test_online_quantization_and_kv_bytes(ckpt):
    """``--quantization fp8``'s quantizer on a bf16 model (run here on the CPU): every linear layer e4m3
    per output channel, within e4m3's rounding of the weights; an FP8 KV cache takes half the bytes
    per block."""
    from zpp.models.quantization.fp8_utils import FP8_DTYPE, dequantize
    from zpp.models.quantization.fp8 import quantize_model_fp8
    from zpp.workers.model_runner import ModelRunner
    _, deq = ckpt("llama", "ct-channel")
    model = _stage_model(deq)
    model = model.to(torch.bfloat16)
    before = model.model.layers[0].mlp.down_proj.weight.float().clone()
    assert quantize_model_fp8(model) == 4 * 3
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8_DTYPE and down.fp8.weight_scale.shape == (192,)
    err = (dequantize(down.weight, down.fp8.weight_scale, None, torch.float32) - before).abs()
    assert (err <= before.abs() / 16 + down.fp8.weight_scale[:, None] * 2 ** -9).all()
    assert "weight_scale" not in dict(down.named_parameters())           # a buffer: not a checkpoint tensor
    bf16 = ModelRunner(model, torch.device("cpu"), torch.bfloat16, 16, None, set())
    fp8 = ModelRunner(model, torch.device("cpu"), torch.bfloat16, 16, None, set(), kv_cache_dtype=FP8_DTYPE)
    assert 2 * fp8.kv_bytes_per_block() == bf16.kv_bytes_per_block()
