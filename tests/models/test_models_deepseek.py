"""DeepSeek-V2 / V3 on small random-weight checkpoints written by HF transformers' ``save_pretrained``:
greedy tokens equal HF's (fp32, CPU) at PP = 1, 2, 3 (uneven splits), TP = 2, batched and alone,
with chunked prefill and prefix caching; the KV cache holds the compressed latent rows; the MoE
routers and YaRN match HF's; unsupported options are refused in one line; V3's multi-token-
prediction tensors are skipped at load."""
from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest

from helpers import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

MAX_NEW = 12
VOCAB = 49152  # SmolLM2's tokenizer
PROMPT_LENS = (3, 19, 41)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
              max_position_embeddings=256, initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _v3(**kw):  # noaux_tc routing with a score-correction bias, q LoRA, YaRN, one dense layer first
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = dict(COMMON, num_hidden_layers=5, q_lora_rank=32, n_routed_experts=8, n_group=4, topk_group=2,
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
               rope_scaling=YARN)
    return DeepseekV3ForCausalLM, DeepseekV3Config(**{**cfg, **kw})


def _v2_lite(**kw):  # no q LoRA (plain q_proj), group-limited greedy routing, default RoPE
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    cfg = dict(COMMON, num_hidden_layers=4, q_lora_rank=None, n_routed_experts=8, n_group=4, topk_group=2,
               topk_method="group_limited_greedy", num_experts_per_tok=3, n_shared_experts=2,
               first_k_dense_replace=1, routed_scaling_factor=1.5)
    return DeepseekV2ForCausalLM, DeepseekV2Config(**{**cfg, **kw})


def _v2_qlora(**kw):  # q LoRA, greedy routing, biases on attention and MLPs, MoE from layer 0, YaRN
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    cfg = dict(COMMON, num_hidden_layers=3, q_lora_rank=40, n_routed_experts=6, topk_method="greedy",
               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, attention_bias=True,
               mlp_bias=True, rope_scaling={**YARN, "mscale": 0.707})
    return DeepseekV2ForCausalLM, DeepseekV2Config(**{**cfg, **kw})


CONFIGS = {"v3": _v3, "v2-lite": _v2_lite, "v2-qlora": _v2_qlora}


def _save(maker, out_dir: str, demo_model: str, **kw) -> str:
    """Random fp32 weights (biases and V3's e_score_correction_bias randomised too: HF zeroes them),
    saved with ``save_pretrained``, plus SmolLM2's tokenizer."""
    import torch
    cls, cfg = maker(**kw)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith(".bias"):
                t.normal_(0.0, 0.3)
        for name, t in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(demo_model, f)):
            shutil.copy(os.path.join(demo_model, f), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4321)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def shared_prefix(prompts) -> list[list[int]]:
    """Two prompts sharing prompts[2]'s first 32 tokens (two full 16-token blocks), for prefix caching."""
    rng = random.Random(99)
    return [prompts[2][:32] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 11)]


_MODELS: dict[str, tuple[str, list[list[int]]]] = {}


@pytest.fixture(scope="module")
def model_of(tmp_path_factory, demo_model, prompts, shared_prefix):
    """config name -> (checkpoint dir, HF greedy tokens of prompts + shared_prefix), made once."""
    def get(name: str):
        if name not in _MODELS:
            d = _save(CONFIGS[name], str(tmp_path_factory.mktemp(name)), demo_model)
            _MODELS[name] = d, hf_greedy(d, prompts + shared_prefix, MAX_NEW)
        return _MODELS[name]
    return get


def _generate(llm, prompts, one_by_one: bool = False) -> list[list[int]]:
    from zpp import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    if one_by_one:
        return [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def _check(got, reference, what: str) -> None:
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"{what}: prompt {i}"


# --- greedy parity against HF transformers --------------------------------------------------------
@pytest.fixture(scope="module")
def v3_pp1_llm(model_of):
    """V3 at PP=1, prompts cut into 16-token chunks, prefix caching on, 16-token blocks, a 16 MiB KV
    cache: one start for the parity test and the KV-capacity check below."""
    from zpp import LLM
    with LLM(model_of("v3")[0], kv_cache_memory="16MiB", max_num_batched_tokens=16, enable_prefix_caching=True,
             block_size=16) as llm:
        yield llm


@pytest.mark.slow
def test_v3_pp1_chunked_prefill_prefix_caching(v3_pp1_llm, model_of, prompts, shared_prefix):
    """PP=1, prompts cut into 16-token chunks, prefix caching on: batched, then alone, then two
    requests sharing a cached 32-token prefix -- all equal HF."""
    _, ref = model_of("v3")
    llm = v3_pp1_llm
    _check(_generate(llm, prompts), ref, "batched")
    _check(_generate(llm, prompts, one_by_one=True), ref, "alone")
    _check(_generate(llm, shared_prefix), ref[len(prompts):], "shared prefix (cached blocks)")


@pytest.mark.slow
def test_pipeline_parallel_matches_hf(model_of, prompts, shared_prefix):
    """The engine at PP=3 with ``--pp-layer-partition 1,3,1`` (a middle stage of three MoE layers),
    24-token chunks, prefix caching on: HF's tokens batched (two requests sharing a cached prefix
    among them) and alone. V3 at PP=2 through the engine: the auto-partition test below."""
    from zpp import LLM
    model_dir, ref = model_of("v3")
    with LLM(model_dir, pipeline_parallel_size=3, pp_layer_partition=(1, 3, 1), kv_cache_memory="16MiB",
             max_num_batched_tokens=24, enable_prefix_caching=True) as llm:
        _check(_generate(llm, prompts + shared_prefix), ref, "v3 PP=3 (1, 3, 1) batched")
        _check(_generate(llm, prompts[:2], one_by_one=True), ref, "v3 PP=3 (1, 3, 1) alone")


@pytest.mark.slow
@pytest.mark.parametrize("name,splits", [("v3", [(3, 2), (1, 3, 1)]), ("v2-lite", [(4,), (3, 1), (2, 2)]),
                                         ("v2-qlora", [(3,), (1, 1, 1)])])
def test_pipeline_splits_in_process_match_hf(model_of, prompts, shared_prefix, name, splits):
    """Every variant's splits (PP=1 decoding token by token; PP=2 and 3 teacher-forced), each stage
    built as a worker builds it and chained in this process: HF's tokens for every prompt. The
    engine runs V3 at PP = 1, 2 and 3 in this module, V2-Lite on the decode-graph path and V2-qLoRA
    at TP=2."""
    from stage_chain import check_splits
    model_dir, ref = model_of(name)
    check_splits(model_dir, prompts + shared_prefix, ref, splits, label=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v2-qlora"])  # v2-lite's blocks are v3's and v2-qlora's (suite time)
def test_tensor_parallel_2_matches_hf(model_of, prompts, name):
    """TP=2: 2 of 4 heads per rank, the latent cache replicated, dense MLPs, shared and routed
    experts split (one all-reduce per MoE layer; v2-qlora: the MLP biases added once)."""
    from zpp import LLM
    model_dir, ref = model_of(name)
    with LLM(model_dir, tensor_parallel_size=2, kv_cache_memory="16MiB", max_num_batched_tokens=24) as llm:
        _check(_generate(llm, prompts), ref, f"{name} TP=2")


@pytest.mark.slow
@pytest.mark.parametrize("name,pp,async_on", [("v2-lite", 1, True), ("v3", 2, False)])
def test_decode_graph_path_on_cpu(model_of, prompts, tmp_path, monkeypatch, name, pp, async_on):
    """The model runner's decode-graph path (``ZPP_EAGER_GRAPHS`` stand-in for CUDA graphs) over the
    latent cache, on every stage -- MoE layers included (V2-Lite with async scheduling: the previous
    step's tokens fed on the device; V3 at PP=2: a dense and two MoE layers, then two MoE layers)."""
    from zpp import LLM
    model_dir, ref = model_of(name)
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    with LLM(model_dir, pipeline_parallel_size=pp, async_scheduling=async_on, kv_cache_memory="16MiB",
             max_num_seqs=8) as llm:
        _check(_generate(llm, prompts), ref, f"{name} PP={pp} graph path")
    assert replays.exists(), "the graph path did not run"
    stages = [int(line.split()[1]) for line in replays.read_text().splitlines()]
    for s in range(pp):
        assert stages.count(s) >= MAX_NEW - 2, f"stage {s} did not take the graph path"


@pytest.mark.slow
def test_auto_partition_times_dense_and_moe_layers(model_of, prompts, shared_prefix, caplog):
    """``--pp-layer-partition auto`` at PP=2 on V3 (layer 0 dense, 1-4 MoE): each stage times a
    dense and an MoE layer, the engine logs both costs per stage and picks the best split for
    them; the output is HF's, with 24-token chunks and prefix caching on (batched, two requests
    sharing a cached prefix among them, and alone)."""
    import logging
    import re

    from zpp import LLM
    model_dir, ref = model_of("v3")
    with caplog.at_level(logging.INFO, logger="zpp.engine.executor"):
        with LLM(model_dir, pipeline_parallel_size=2, pp_layer_partition="auto", kv_cache_memory="16MiB",
                 max_num_seqs=8, max_num_batched_tokens=24, enable_prefix_caching=True) as llm:
            _check(_generate(llm, prompts + shared_prefix), ref, "auto partition PP=2 batched")
            _check(_generate(llm, prompts[:2], one_by_one=True), ref, "auto partition PP=2 alone")
    lines = [r.getMessage() for r in caplog.records if "pp layer partition auto" in r.getMessage()]
    assert len(lines) == 1, lines
    m = re.search(r"auto: (\d+),(\d+) \(even 3,2\).*layer ms dense ([\d.]+),([\d.]+); moe ([\d.]+),([\d.]+), "
                  r"embedding / LM head \+ sampling ms ([\d.]+),([\d.]+)", lines[0])
    assert m, lines[0]
    sizes = [int(m[1]), int(m[2])]
    dense, moe, extra = [float(m[3]), float(m[4])], [float(m[5]), float(m[6])], [float(m[7]), float(m[8])]
    assert sum(sizes) == 5 and min(sizes) >= 1 and all(x > 0 for x in dense + moe)
    kinds = ["dense", "moe", "moe", "moe", "moe"]

    def slowest(split):
        times, start = [], 0
        for s, n in enumerate(split):
            times.append(sum((dense if k == "dense" else moe)[s] for k in kinds[start:start + n]) + extra[s])
            start += n
        return max(times)
    assert slowest(sizes) <= min(slowest((a, 5 - a)) for a in range(1, 5)) + 5e-3  # logged costs: rounded to 1 us


@pytest.mark.slow
def test_llama_yarn_matches_hf(tmp_path, demo_model, prompts):
    """YaRN is not DeepSeek's alone: a LLaMA with rope_scaling yarn (attention factor from factor
    alone) equals HF too (its stage built as a worker builds it, decoding in this process: the
    rope is the model's, the engine path is the other tests')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stage_chain import greedy_in_process

    def llama(**kw):
        return LlamaForCausalLM, LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
            eos_token_id=2, rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32})
    model_dir = _save(llama, str(tmp_path), demo_model)
    ref = hf_greedy(model_dir, prompts, MAX_NEW)
    _check(greedy_in_process(model_dir, (2,), prompts, MAX_NEW), ref, "llama yarn")


# --- in-process: cache layout, routers, rope, loading -------------------------------------------
def _config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _stage(model_dir: str, pp_rank: int = 0, pp_size: int = 1, tp_rank: int = 0, tp_size: int = 1, layers=None):
    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.partition import partition_layers
    cfg = _config(model_dir)
    start, end = layers or partition_layers(cfg["num_hidden_layers"], pp_size)[pp_rank]
    return load_stage_model(model_dir, cfg, StageInfo(pp_rank, pp_size, start, end, tp_rank, tp_size),
                            torch.float32, torch.device("cpu"), 256)


@pytest.fixture(scope="module")
def v3_dir(model_of):
    return model_of("v3")[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [("v3", {"rope_interleave": False}), ("v3", {"q_lora_rank": None}),
                                     ("v3", {"norm_topk_prob": False, "rope_scaling": None}),
                                     ("v2-lite", {"topk_method": "greedy", "q_lora_rank": 24}),
                                     ("v2-qlora", {"rope_scaling": {"type": "linear", "factor": 2.0}})])
def test_variants_logits_match_hf(tmp_path, name, kw):
    """Options the engine runs above do not cover (V3's rotate-half RoPE, V3 without q LoRA, ...),
    in-process: a 30-token prefill and a 14-token chunk over the latent cache give HF's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from zpp.models.layers.attention import build_attention_metadata
    d = str(tmp_path)
    cls, cfg = CONFIGS[name](**kw)
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    model.save_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (44,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    stage = _stage(d)
    kv = [torch.zeros(stage.kv_cache_shape(4, 16)) for _ in range(cfg.num_hidden_layers)]
    got = []
    for start, n in ((0, 30), (30, 14)):
        meta = build_attention_metadata([start], [n], [[2, 0, 3]], 16, torch.device("cpu"))
        with torch.no_grad():
            h = stage(ids[start:start + n], torch.arange(start, start + n), None, kv, meta)
            got.append(stage.compute_logits(h))
    got = torch.cat(got)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-4 * ref.abs().max().item())


@pytest.mark.slow
def test_kv_cache_holds_latent_rows(v3_dir, v3_pp1_llm):
    """Bytes per block = layers x block_size x (kv_lora_rank + qk_rope_head_dim) x 4 (fp32), one
    tensor per layer of ``[blocks, block_size, 1, kv_lora_rank + rope]``; the engine's block count
    for a memory budget is that budget over those bytes -- 2 x heads x (qk_head_dim + v_head_dim) /
    2 / (kv_lora_rank + rope) times the count a full K/V cache would get."""
    import torch

    from zpp.workers.model_runner import ModelRunner
    cfg = _config(v3_dir)
    layers, bs = cfg["num_hidden_layers"], 16
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    runner = ModelRunner(_stage(v3_dir), torch.device("cpu"), torch.float32, bs, None, set())
    assert runner.kv_bytes_per_block() == layers * bs * row * 4
    runner.init_kv_cache(3)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(4, bs, 1, row)] * layers
    budget = 16 << 20  # v3_pp1_llm's kv_cache_memory, its block_size bs
    blocks = v3_pp1_llm.engine.client.num_kv_blocks
    assert blocks == budget // (layers * bs * row * 4)
    heads = cfg["num_attention_heads"]
    full_kv = layers * bs * heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) * 4
    assert blocks > 3 * (budget // full_kv)


def test_routers_match_hf():
    """The three routing methods against HF's router modules on the same weights: the same experts
    (as sets) and weights per token."""
    import torch
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from zpp.models.deepseek import DeepseekRouter
    torch.manual_seed(0)
    x = torch.randn(50, 64)
    cases = [(_v3, DeepseekV3TopkRouter, "noaux_tc", {}),
             (_v3, DeepseekV3TopkRouter, "noaux_tc", {"norm_topk_prob": False}),
             (_v2_lite, DeepseekV2TopkRouter, "group_limited_greedy", {}),
             (_v2_qlora, DeepseekV2TopkRouter, "greedy", {"routed_scaling_factor": 0.5})]
    for maker, hf_cls, method, kw in cases:
        _, cfg = maker(**kw)
        hf = hf_cls(cfg)
        torch.nn.init.normal_(hf.weight, std=0.5)
        ours = DeepseekRouter(64, cfg.n_routed_experts, cfg.num_experts_per_tok, method, cfg.n_group or 1,
                              cfg.topk_group or 1, bool(cfg.norm_topk_prob) and method == "noaux_tc",
                              cfg.routed_scaling_factor)
        ours.weight.data.copy_(hf.weight)
        if method == "noaux_tc":
            hf.e_score_correction_bias.normal_(0.0, 0.5)
            ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
        _, w_hf, ids_hf = hf(x)
        w, ids = ours(x)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        o_hf, o = ids_hf.sort(-1), ids.sort(-1)
        assert torch.equal(o.values, o_hf.values), (method, kw)
        torch.testing.assert_close(w.gather(1, o.indices), w_hf.gather(1, o_hf.indices), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},                               # DeepSeek-V3
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
     "mscale_all_dim": 0.707},                                           # DeepSeek-V2
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "mscale": 1.0,
     "mscale_all_dim": 0.5, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},     # Qwen-style
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024, "attention_factor": 0.9}])
def test_yarn_tables_match_hf(scaling):
    """cos/sin tables (inverse frequencies times the attention factor) and DeepSeek's softmax scale
    equal HF's for several YaRN settings."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from zpp.models.layers.rotary import RotaryEmbedding, rope_params, yarn_softmax_scale
    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64, qk_nope_head_dim=128,
                              max_position_embeddings=163840, rope_parameters={**scaling, "rope_theta": 10000.0})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    theta, ours = rope_params({"max_position_embeddings": 163840, "rope_theta": 10000.0, "rope_scaling": scaling})
    rope = RotaryEmbedding(64, 300, theta, ours)
    freqs = torch.arange(300).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    assert torch.equal(rope.cos, emb.cos() * factor) and torch.equal(rope.sin, emb.sin() * factor)
    assert yarn_softmax_scale(ours, 192 ** -0.5) == yarn_apply_mscale(hf_cfg.rope_parameters, 192 ** -0.5)
    if scaling.get("mscale_all_dim"):
        assert yarn_softmax_scale(ours, 1.0) != 1.0


@pytest.mark.slow
def test_mtp_layer_and_fused_experts_load(v3_dir, tmp_path):
    """V3's released checkpoints carry a multi-token-prediction module as layer num_hidden_layers
    (``model.layers.61.*`` for 61 layers): skipped, not reported as unexpected. HF 5.x's fused expert
    tensors load into the same parameters as the per-expert ones save_pretrained writes."""
    import torch
    from safetensors.torch import load_file, save_file
    src = load_file(os.path.join(v3_dir, "model.safetensors"))
    n = _config(v3_dir)["num_hidden_layers"]
    mtp = {k.replace("model.layers.1.", f"model.layers.{n}."): v.clone()
           for k, v in src.items() if "model.layers.1." in k}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    mtp[f"model.layers.{n}.shared_head.head.weight"] = torch.zeros(VOCAB, 64)
    fused = {k: v for k, v in src.items() if ".mlp.experts." not in k}
    for layer in range(1, n):
        p = f"model.layers.{layer}.mlp.experts"
        w = lambda e, part: src[f"{p}.{e}.{part}.weight"]
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([w(e, "down_proj") for e in range(8)])
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(os.path.join(v3_dir, "config.json"), d)
    save_file({**fused, **mtp}, str(d / "model.safetensors"))
    for rank, size in ((0, 1), (1, 2)):
        a, b = _stage(v3_dir, rank, size).state_dict(), _stage(str(d), rank, size).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    bogus = dict(src, **{"model.layers.1.mlp.experts.9.up_proj.weight": torch.zeros(32, 64)})
    save_file(bogus, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensors.*experts\.9\.up_proj"):
        _stage(str(d))


@pytest.mark.slow
def test_tensor_parallel_slices_rebuild_the_weights(v3_dir):
    """TP=2: each rank's attention / MLP slices put back together are the TP=1 weights; each rank
    holds half of every routed expert's intermediate dim (gate rows, up rows, down columns); the
    latent projections, norms and router are whole on both ranks."""
    import torch
    full = _stage(v3_dir).state_dict()
    r0, r1 = _stage(v3_dir, tp_rank=0, tp_size=2).state_dict(), _stage(v3_dir, tp_rank=1, tp_size=2).state_dict()
    inter, experts = _config(v3_dir)["moe_intermediate_size"], _config(v3_dir)["n_routed_experts"]
    kinds = {"column": 0, "row": 0, "merged": 0, "experts": 0, "whole": 0}
    for k, v in full.items():
        routed = ".mlp.experts." in k
        if routed:
            kinds["experts"] += 1
            if k.endswith("gate_up_proj"):  # [E, 2I, H]: [gate; up] per expert, each split
                assert r0[k].shape == r1[k].shape == (experts, 2 * (inter // 2), 64), k
                (g0, u0), (g1, u1) = r0[k].chunk(2, dim=1), r1[k].chunk(2, dim=1)
                assert torch.equal(torch.cat([g0, g1, u0, u1], dim=1), v), k
            else:                           # down_proj [E, H, I]
                assert k.endswith("down_proj") and r0[k].shape == (experts, 64, inter // 2), k
                assert torch.equal(torch.cat([r0[k], r1[k]], dim=2), v), k
        elif k.endswith(("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight")):
            kinds["column"] += 1
            assert torch.equal(torch.cat([r0[k], r1[k]]), v), k
        elif k.endswith("gate_up_proj.weight") and not routed:  # [gate; up], each split
            kinds["merged"] += 1
            (g0, u0), (g1, u1) = r0[k].chunk(2), r1[k].chunk(2)
            assert torch.equal(torch.cat([g0, g1, u0, u1]), v), k
        elif k.endswith(("o_proj.weight", "down_proj.weight")) and not routed:
            kinds["row"] += 1
            assert torch.equal(torch.cat([r0[k], r1[k]], 1), v), k
        else:
            kinds["whole"] += 1
            assert torch.equal(r0[k], v) and torch.equal(r1[k], v), k
    assert kinds == {"column": 10, "row": 10, "merged": 5, "experts": 8, "whole": kinds["whole"]}, kinds


# --- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit,word", [
    ({"quantization_config": {"quant_method": "hqq"}}, "hqq"),  # FP8 / 4-bit load (test_fp8.py, test_w4.py)
    ({"topk_method": "noaux_tc", "architectures": ["DeepseekV2ForCausalLM"]}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"n_group": 3}, "n_group")])
def test_unsupported_options_refused(tmp_path, edit, word):
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class
    _, cfg = _v3()
    d = cfg.to_dict()
    d.pop("rope_parameters", None)
    d.update({"architectures": ["DeepseekV3ForCausalLM"], **edit})
    with pytest.raises(ConfigError) as info:
        resolve_model_class(d)
    assert "\n" not in str(info.value) and word in str(info.value)


def test_tensor_parallel_refused_when_heads_do_not_split():
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class
    _, cfg = _v3()
    d = {**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    resolve_model_class(d, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 does not divide the model's num_attention_heads"):
        resolve_model_class(d, tensor_parallel_size=3)


@pytest.mark.slow
def test_cuda_graphs_on_moe_stages(v3_dir):
    """Every stage is captured in CUDA graphs, MoE layers included: the CUDA experts are grouped
    Triton GEMMs without a host sync, and the routers neither read a device value on the host nor
    make a shape from data -- checked here by running them on the meta device, where ``.item()``,
    ``.tolist()``, ``nonzero`` or ``bincount`` raise."""
    import torch

    from zpp.models.deepseek import DeepseekRouter, DeepseekV3ForCausalLM
    cfg = _config(v3_dir)
    assert cfg["first_k_dense_replace"] == 1
    assert _stage(v3_dir).supports_cuda_graphs
    assert _stage(v3_dir, 0, 2, layers=(0, 1)).supports_cuda_graphs
    assert _stage(v3_dir, 1, 2, layers=(1, 5)).supports_cuda_graphs
    assert math.prod(_stage(v3_dir).kv_cache_shape(1, 16)) == 16 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    for method in ("noaux_tc", "group_limited_greedy", "greedy"):
        router = DeepseekRouter(64, 8, 3, method, 4, 2, True, 2.5).to("meta")
        weights, ids = router(torch.empty(7, 64, device="meta"))
        assert weights.shape == ids.shape == (7, 3) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    with pytest.raises(Exception):  # the check can fail: a host read on the meta device raises
        torch.empty(3, device="meta").sum().item()
    assert DeepseekV3ForCausalLM.layer_kinds(cfg) == ["dense"] + ["moe"] * 4
    assert DeepseekV3ForCausalLM.layer_kinds({"num_hidden_layers": 5}) == ["dense"] * 3 + ["moe"] * 2  # HF default 3
