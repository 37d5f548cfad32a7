"""Qwen3 and Qwen3-MoE (and Mixtral's tensor parallelism) on small random-weight checkpoints written
by HF transformers' ``save_pretrained``: greedy tokens equal HF's (fp32, CPU) at PP = 1, 2, 3, an
uneven split, batched and alone, with chunked prefill and prefix caching, at TP = 2; tied and
untied embeddings; checkpoints with a tensor missing are named; unsupported options are refused in
one line; ``--pp-layer-partition auto`` balances dense and MoE layers by their own costs."""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import pytest

from helpers import alive, descendants, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

MAX_NEW = 12
VOCAB = 49152  # SmolLM2's tokenizer
PROMPT_LENS = (3, 17, 40)


def _qwen3():  # head_dim 32 != hidden / heads (16), untied
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM, Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=256, tie_word_embeddings=False,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _qwen3_tied():  # tied embeddings, biases on q/k/v/o (attention_bias), no GQA
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM, Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                         attention_bias=True, max_position_embeddings=256, tie_word_embeddings=True,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _qwen3_moe():  # layer 1 dense (mlp_only_layers), the rest top-2 of 8 experts, no renormalisation
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2)


def _qwen3_moe_step2():  # every second layer sparse (decoder_sparse_step 2), top-3 of 6, renormalised
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
        decoder_sparse_step=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2,
                                             max_position_embeddings=256, initializer_range=0.3,
                                             bos_token_id=1, eos_token_id=2)


FAMILIES = {"qwen3": _qwen3, "qwen3-tied": _qwen3_tied, "qwen3-moe": _qwen3_moe, "qwen3-moe-step2": _qwen3_moe_step2,
            "mixtral": _mixtral}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory, demo_model):
    """family -> checkpoint directory (random weights, HF ``save_pretrained``, SmolLM2's tokenizer)."""
    import torch
    dirs: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in dirs:
            cls, cfg = FAMILIES[family]()
            torch.manual_seed(0)
            out = str(tmp_path_factory.mktemp(family))
            cls(cfg).to(torch.float32).eval().save_pretrained(out)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if os.path.exists(os.path.join(demo_model, f)):
                    shutil.copy(os.path.join(demo_model, f), out)
            dirs[family] = out
        return dirs[family]
    return get


def _greedy(llm, prompts, n=MAX_NEW):
    from zpp import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


SPLITS = {"qwen3": [(5,), (3, 2), (2, 2, 1), (1, 4)], "qwen3-tied": [(4,), (2, 2), (3, 1)],
          "qwen3-moe": [(5,), (3, 2), (2, 2, 1), (1, 4)], "qwen3-moe-step2": [(4,), (2, 2), (1, 2, 1)]}


def _shared(prompts) -> list[int]:
    """A prompt sharing prompts[2]'s first 32 tokens (two 16-token blocks)."""
    return prompts[2][:32] + [11, 12, 13, 14, 15]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(SPLITS))
def test_stages_in_process_match_hf(model_dir_of, prompts, family):
    """PP = 1 (decoding token by token), 2, 3 and uneven splits, each stage built as a worker builds
    it (only its layers' tensors; tied embeddings: the last stage's LM head from the embedding) and
    chained in this process: HF's greedy tokens, every prompt. The engine runs Qwen3 at PP=3 and
    Qwen3-MoE at PP=2 below, every family at TP=2."""
    from stage_chain import check_splits
    model_dir = model_dir_of(family)
    every = prompts + [_shared(prompts)]
    check_splits(model_dir, every, hf_greedy(model_dir, every, MAX_NEW), SPLITS[family], label=family)


@pytest.mark.slow
def test_engine_uneven_pp3_chunked_prefill_prefix_caching(model_dir_of, prompts):
    """The engine on Qwen3 at PP=3 with ``--pp-layer-partition 1,3,1``, prompts cut into chunks of at
    most 16 tokens, prefix caching on: HF's tokens batched and each prompt alone, and a request
    sharing 32 tokens (two blocks) with an earlier one reads them from the cache."""
    from zpp import LLM
    model_dir = model_dir_of("qwen3")
    shared = _shared(prompts)
    reference = hf_greedy(model_dir, prompts + [shared], MAX_NEW)
    with LLM(model_dir, pipeline_parallel_size=3, pp_layer_partition=(1, 3, 1), max_num_batched_tokens=16,
             enable_prefix_caching=True, block_size=16, kv_cache_memory="32MiB") as llm:
        batched = _greedy(llm, prompts)
        alone = [_greedy(llm, [p])[0] for p in prompts]
        hits = llm.engine.kv.prefix_hits
        batched.append(_greedy(llm, [shared])[0])
        assert llm.engine.kv.prefix_hits - hits == 32, "the shared prefix was not read from the cache"
    for i, ref in enumerate(reference):
        assert batched[i] == ref, f"qwen3 PP=3 (1, 3, 1) batched, prompt {i}"
    for i, ref in enumerate(reference[:len(prompts)]):
        assert alone[i] == ref, f"qwen3 PP=3 (1, 3, 1) alone, prompt {i} ({len(prompts[i])} tokens)"


@pytest.mark.slow
@pytest.mark.parametrize("family, tp, pp", [("qwen3", 2, 1), ("qwen3-moe", 2, 2), ("qwen3-moe-step2", 2, 1),
                                            ("mixtral", 2, 1)])
def test_tensor_parallel_matches_hf(model_dir_of, prompts, family, tp, pp):
    """Heads split 2 ways (Qwen3's per-head QK norm on each rank's heads); every expert's
    intermediate dim split 2 ways with one all-reduce per MoE block."""
    from zpp import LLM
    model_dir = model_dir_of(family)
    reference = hf_greedy(model_dir, prompts, MAX_NEW)
    with LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_memory="16MiB") as llm:
        got = _greedy(llm, prompts)
    for i, ref in enumerate(reference):
        assert got[i] == ref, f"{family} TP={tp} x PP={pp}, prompt {i} ({len(prompts[i])} tokens)"


# --- loading ------------------------------------------------------------------------------------
def _cfg(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def _load(model_dir: str, pp_rank: int = 0, pp_size: int = 1, tp_rank: int = 0, tp_size: int = 1):
    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.partition import partition_layers
    from zpp.models.registry import resolve_model_class
    cfg = _cfg(model_dir)
    start, end = partition_layers(resolve_model_class(cfg).num_layers_of(cfg), pp_size)[pp_rank]
    return load_stage_model(model_dir, cfg, StageInfo(pp_rank, pp_size, start, end, tp_rank, tp_size), torch.float32,
                            torch.device("cpu"), 64)


def _rewrite_checkpoint(src: str, dst: str, edit) -> str:
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(edit(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return dst


def test_checkpoint_names(model_dir_of):
    """What HF 5.24's save_pretrained writes for Qwen3 / Qwen3-MoE, which the loader expects: QK
    norms; per-expert gate/up/down and the router for sparse layers, a plain MLP for dense ones."""
    from safetensors import safe_open
    with safe_open(os.path.join(model_dir_of("qwen3-moe"), "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_norm.weight" in names and "model.layers.0.self_attn.k_norm.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names
    assert {f"model.layers.0.mlp.experts.7.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")} <= names
    assert "model.layers.1.mlp.gate_proj.weight" in names and not any(".layers.1.mlp.experts" in n for n in names)
    with safe_open(os.path.join(model_dir_of("qwen3-tied"), "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert _load(model_dir_of("qwen3-tied")).tie_embeddings


@pytest.mark.parametrize("family, drop, word", [
    ("qwen3-moe", "model.layers.2.mlp.experts.3.up_proj.weight", r"layers\.2\.mlp\.experts\.gate_up_proj \(shards 7 of 16\)"),
    ("qwen3-moe", "model.layers.1.mlp.up_proj.weight", r"layers\.1\.mlp\.gate_up_proj\.weight \(shards 1 of 2\)"),
    ("qwen3", "model.layers.3.self_attn.k_norm.weight", r"layers\.3\.self_attn\.k_norm\.weight"),
])
def test_missing_tensor_is_named(model_dir_of, tmp_path, family, drop, word):
    src = model_dir_of(family)
    missing = _rewrite_checkpoint(src, str(tmp_path / "missing"), lambda t: {k: v for k, v in t.items() if k != drop})
    with pytest.raises(ValueError, match=r"missing tensors: .*" + word):
        _load(missing)


@pytest.mark.parametrize("family, t0, extras", [
    ("qwen3-moe", "model.layers.0.mlp.experts.0.gate_proj.weight",
     ("model.layers.0.mlp.experts.8.gate_proj.weight", "model.layers.0.mlp.experts.8.down_proj.weight",
      "model.layers.1.mlp.experts.0.gate_proj.weight")),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1.weight",
     ("model.layers.0.block_sparse_moe.experts.4.w1.weight", "model.layers.2.block_sparse_moe.experts.9.w2.weight"))])
def test_unexpected_expert_is_named(model_dir_of, tmp_path, family, t0, extras):
    """An expert past the layer's expert count (any of its tensors), or experts in a dense
    (mlp_only) layer, are reported as unexpected tensors by name (the shared expert loader never
    sees an expert id it does not hold)."""
    src = model_dir_of(family)
    for j, extra in enumerate(extras):
        bad = _rewrite_checkpoint(src, str(tmp_path / str(j)), lambda t: {**t, extra: t[t0].clone()})
        with pytest.raises(ValueError, match=r"unexpected checkpoint tensors for this model: " + re.escape(extra)):
            _load(bad)


def test_fused_expert_checkpoint_loads(model_dir_of, tmp_path):
    """HF's in-memory layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
    ``[E, H, I]``) loads into the same parameters as the per-expert names, at TP = 1 and on each of
    two TP ranks."""
    import torch
    src = model_dir_of("qwen3-moe")

    def fuse(t):
        out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
        for layer in sorted({int(m.group(1)) for k in t if (m := re.search(r"layers\.(\d+)\.mlp\.experts\.", k))}):
            p = f"model.layers.{layer}.mlp.experts"
            w = lambda e, name: t[f"{p}.{e}.{name}.weight"]
            out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in range(8)])
            out[f"{p}.down_proj"] = torch.stack([w(e, "down_proj") for e in range(8)])
        return out

    fused = _rewrite_checkpoint(src, str(tmp_path / "fused"), fuse)
    for kw in (dict(), dict(pp_rank=1, pp_size=2), dict(tp_rank=1, tp_size=2)):
        a, b = _load(src, **kw).state_dict(), _load(fused, **kw).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (kw, k)


def test_expert_tp_slices_reassemble(model_dir_of):
    """Each rank's experts hold its half of every expert's gate rows, up rows (gate_up_proj) and
    down columns; attention heads and QK norms as LLaMA's split (norms replicated)."""
    import torch
    src = model_dir_of("qwen3-moe")
    full = dict(_load(src).named_parameters())
    parts = [dict(_load(src, tp_rank=r, tp_size=2).named_parameters()) for r in range(2)]
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    halves = [p[gu].detach().chunk(2, dim=1) for p in parts]                      # (gate, up) per rank
    assert torch.equal(torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1),
                       full[gu].detach())
    dn = "model.layers.0.mlp.experts.down_proj"
    assert torch.equal(torch.cat([p[dn].detach() for p in parts], dim=2), full[dn].detach())
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate.weight"):
        assert all(torch.equal(p[name], full[name]) for p in parts), name


# --- refusals -------------------------------------------------------------------------------------
def _live_descendants() -> set[int]:
    return {p for p in descendants(os.getpid()) if alive(p)}


BASE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": VOCAB, "max_position_embeddings": 256}
MOE = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 48}
REFUSALS = {
    "sliding-window": ({**BASE, "use_sliding_window": True, "sliding_window": 64}, {}, "use_sliding_window"),
    "sliding-layer-types": ({**BASE, "layer_types": ["full_attention", "sliding_attention"]}, {}, "layer_types"),
    "moe-sliding-window": ({**MOE, "use_sliding_window": True}, {}, "use_sliding_window"),
    "moe-top-k": ({**MOE, "num_experts_per_tok": 5}, {}, "num_experts_per_tok=5"),
    "moe-dynamic-rope": ({**MOE, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, {}, "dynamic"),
    "moe-tp-intermediate": ({**MOE, "moe_intermediate_size": 51}, {"tensor_parallel_size": 2},
                            "--tensor-parallel-size 2 does not divide the model's moe_intermediate_size (51)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_option_is_refused(tmp_path, case):
    from zpp import LLM
    from zpp.errors import ConfigError
    cfg, kw, word = REFUSALS[case]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    before = _live_descendants()
    with pytest.raises(ConfigError) as info:
        LLM(str(tmp_path), pipeline_parallel_size=2, **kw)
    msg = str(info.value)
    assert "\n" not in msg and word in msg, msg
    assert kw or cfg["architectures"][0] in msg, msg  # config options name the architecture
    assert _live_descendants() <= before, "a process was left running"


def test_registry_lists_qwen3():
    from zpp.models.registry import supported_architectures, tensor_parallel_architectures
    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        assert arch in supported_architectures() and arch in tensor_parallel_architectures()


# --- --pp-layer-partition auto with dense and MoE layers ---------------------------------------------
def test_layer_kinds():
    from zpp.models.llama import LlamaForCausalLM
    from zpp.models.qwen3_moe import Qwen3MoeForCausalLM
    assert Qwen3MoeForCausalLM.layer_kinds({**MOE, "num_hidden_layers": 5, "mlp_only_layers": [0, 3]}) == \
        ["dense", "moe", "moe", "dense", "moe"]
    assert Qwen3MoeForCausalLM.layer_kinds({**MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2}) == \
        ["dense", "moe", "dense", "moe"]
    assert LlamaForCausalLM.layer_kinds(BASE) == ["decoder", "decoder"]


def test_balanced_partition_per_layer_costs():
    """Dense layers cheap, MoE layers dear: the split balances time, not layer counts; brute force
    over every split agrees (smallest slowest stage, then nearest the even split)."""
    from zpp.models.partition import balanced_partition, even_sizes, stage_times
    dense, moe = 1.0, 4.0
    cost = [dense] * 6 + [moe] * 6                                     # 6 dense layers first (DeepSeek-like)
    sizes = balanced_partition(12, [cost, cost], [0.0, 0.0])
    assert sizes == (8, 4) and stage_times(sizes, [cost, cost], [0, 0]) == [14.0, 16.0]
    assert balanced_partition(12, [dense * 2.5] * 2, [0.0, 0.0]) == (6, 6)  # one kind: even
    mixed = [moe if i % 3 else dense for i in range(9)]                      # dense every third layer
    assert balanced_partition(9, [mixed] * 3, [0.0, 0.0, 0.0]) == (3, 3, 3)
    rng = random.Random(0)
    for _ in range(200):
        pp = rng.randint(1, 4)
        n = rng.randint(pp, 10)
        kinds = [rng.random() < 0.5 for _ in range(n)]
        costs = [[rng.uniform(2, 5) if k else 1.0 for k in kinds] if rng.random() < 0.8 else rng.uniform(0.5, 2)
                 for _ in range(pp)]
        extra = [rng.choice([0.0, rng.uniform(0, 6)]) for _ in range(pp)]
        sizes = balanced_partition(n, costs, extra)
        assert len(sizes) == pp and sum(sizes) == n and min(sizes) >= 1
        splits = list(_compositions(n, pp))
        best = min(max(stage_times(c, costs, extra)) for c in splits)
        assert max(stage_times(sizes, costs, extra)) == pytest.approx(best, rel=1e-9)
        even = even_sizes(n, pp)
        nearest = min(sum(abs(a - b) for a, b in zip(c, even)) for c in splits
                      if max(stage_times(c, costs, extra)) <= best * (1 + 1e-9))
        assert sum(abs(a - b) for a, b in zip(sizes, even)) == nearest


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first,) + rest


@pytest.mark.slow
def test_auto_partition_times_dense_and_moe_layers(model_dir_of, prompts, caplog):
    """A real ``auto`` run at PP=2 on Qwen3-MoE with a dense layer (mlp_only_layers): each stage
    times a dense and an MoE layer; the engine logs both costs per stage and picks the split that
    is best for them, layer by layer; the output is HF's, with prompts cut into chunks of at most 16
    tokens and prefix caching on (a request sharing two blocks with an earlier one reads them from
    the cache)."""
    import logging

    from zpp import LLM
    model_dir = model_dir_of("qwen3-moe")
    shared = _shared(prompts)
    reference = hf_greedy(model_dir, prompts + [shared], MAX_NEW)
    with caplog.at_level(logging.INFO, logger="zpp.engine.executor"):
        with LLM(model_dir, pipeline_parallel_size=2, pp_layer_partition="auto", kv_cache_memory="32MiB",
                 max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True, block_size=16) as llm:
            got = _greedy(llm, prompts)
            hits = llm.engine.kv.prefix_hits
            got.append(_greedy(llm, [shared])[0])
            assert llm.engine.kv.prefix_hits - hits == 32, "the shared prefix was not read from the cache"
    for i, ref in enumerate(reference):
        assert got[i] == ref, f"qwen3-moe PP=2 auto, prompt {i}"
    lines = [r.getMessage() for r in caplog.records if "pp layer partition auto" in r.getMessage()]
    assert len(lines) == 1, lines
    m = re.search(r"auto: (\d+),(\d+) \(even 3,2\).*layer ms moe ([\d.]+),([\d.]+); dense ([\d.]+),([\d.]+), "
                  r"embedding / LM head \+ sampling ms ([\d.]+),([\d.]+)", lines[0])
    assert m, lines[0]
    sizes = [int(m[1]), int(m[2])]
    moe, dense, extra = [float(m[3]), float(m[4])], [float(m[5]), float(m[6])], [float(m[7]), float(m[8])]
    assert sum(sizes) == 5 and min(sizes) >= 1 and all(x > 0 for x in moe + dense)
    kinds = ["moe", "dense", "moe", "moe", "moe"]

    def times(split):
        out, start = [], 0
        for s, n in enumerate(split):
            out.append(sum((moe if k == "moe" else dense)[s] for k in kinds[start:start + n]) + extra[s])
            start += n
        return out
    best = min(max(times((a, 5 - a))) for a in range(1, 5))
    assert max(times(sizes)) <= best + 5e-3  # the logged costs are rounded to the microsecond (5 layers, 2 splits)
