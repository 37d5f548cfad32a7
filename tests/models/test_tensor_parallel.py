"""Tensor parallelism (Megatron-LM style, CPU / gloo): greedy tokens equal HF transformers' (fp32)
at TP = 3 on the real SmolLM2 (9 heads, 3 KV heads) and at TP = 2 x PP = 2 (four workers) on small
random-weight LLaMA / Qwen2 checkpoints (biases on q/k/v, o_proj and the MLP, tied embeddings); the
loaders' slices put back together are the TP = 1 weights; settings TP cannot serve are refused in
one line before any worker starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import alive, descendants, hf_greedy

MAX_NEW = 16
VOCAB = 49152  # SmolLM2's tokenizer
TEXTS = ["Paris", "The quick brown fox jumps over",
         "Write a short poem about the sea and the wind, in the style of an old sailor's song."]


def _llama_with_biases():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                         attention_bias=True, mlp_bias=True, max_position_embeddings=256,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _qwen2():  # q/k/v bias, tied embeddings
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


FAMILIES = {"llama-biases": _llama_with_biases, "qwen2": _qwen2}


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory, demo_model):
    """family -> checkpoint directory (random weights, HF ``save_pretrained``, SmolLM2's tokenizer)."""
    import shutil

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


@pytest.mark.slow
def test_tp3_smollm2_matches_hf(demo_model, tokenizer):
    """9 query heads and 3 KV heads split 3 ways: one KV head per rank; prompts batched."""
    from zpp import LLM, SamplingParams
    prompts = [tokenizer.encode(t) for t in TEXTS]
    reference = hf_greedy(demo_model, prompts, MAX_NEW)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(demo_model, tensor_parallel_size=3, kv_cache_memory="64MiB") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    for i, ref in enumerate(reference):
        assert list(got[i]) == ref, f"TP=3, prompt {i} ({len(prompts[i])} tokens)"


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_pp2_matches_hf(model_dir_of, family):
    import random

    from zpp import LLM, SamplingParams
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 40)]
    model_dir = model_dir_of(family)
    reference = hf_greedy(model_dir, prompts, MAX_NEW)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory="16MiB") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    for i, ref in enumerate(reference):
        assert list(got[i]) == ref, f"{family} TP=2 x PP=2, prompt {i} ({len(prompts[i])} tokens)"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp_slices_reassemble_the_full_weights(model_dir_of, family):
    """Column-parallel parameters are each checkpoint shard's output rows split in rank order,
    row-parallel weights the input columns; replicated parameters are equal on every rank."""
    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    model_dir = model_dir_of(family)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    # The weights as state_dict() gives them: dense (a float32 CPU stage packs its linears for oneDNN).
    load = lambda r, t: load_stage_model(model_dir, cfg, StageInfo(0, 1, 0, n, r, t), torch.float32,
                                         torch.device("cpu"), 64)
    models = [load(0, 1)] + [load(r, 2) for r in range(2)]
    full, *parts = [dict(m.state_dict()) for m in models]
    assert full.keys() == parts[0].keys() == parts[1].keys()
    for name, p in full.items():
        local = [q[name].detach() for q in parts]
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            owner = name.rsplit(".", 1)[0]
            sizes = [s * 2 for s in models[1].get_submodule(owner).output_sizes]
            pieces = [torch.cat([x.split([s // 2 for s in sizes])[i] for x in local]) for i in range(len(sizes))]
            assert torch.equal(torch.cat(pieces), p.detach()), name
        elif (".o_proj." in name or ".down_proj." in name) and name.endswith("weight"):
            assert torch.equal(torch.cat(local, dim=1), p.detach()), name
        else:
            assert all(torch.equal(x, p.detach()) for x in local), name


# --- refusals -------------------------------------------------------------------------------------
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
        "n_positions": 256, "vocab_size": VOCAB}


def _live_descendants() -> set[int]:
    return {p for p in descendants(os.getpid()) if alive(p)}


@pytest.mark.parametrize("tp, word", [(2, "num_attention_heads (9)"), (9, "num_key_value_heads (3)")])
def test_tp_not_dividing_heads_is_refused(demo_model, tp, word):
    from zpp import LLM
    from zpp.errors import ConfigError
    before = _live_descendants()
    with pytest.raises(ConfigError) as info:
        LLM(demo_model, tensor_parallel_size=tp)
    msg = str(info.value)
    assert "\n" not in msg and f"--tensor-parallel-size {tp}" in msg and word in msg, msg
    assert _live_descendants() <= before, "a process was left running"


@pytest.mark.parametrize("cfg", [GPT2], ids=["gpt2"])  # Mixtral / Qwen3-MoE: tests/models/test_models_qwen3.py
def test_tp_for_other_families_is_refused(tmp_path, cfg):
    from zpp import LLM
    from zpp.errors import ConfigError
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    before = _live_descendants()
    with pytest.raises(ConfigError) as info:
        LLM(str(tmp_path), tensor_parallel_size=2)
    msg = str(info.value)
    assert "\n" not in msg and "--tensor-parallel-size > 1 is supported for" in msg, msg
    assert cfg["architectures"][0] in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert arch in msg
    assert _live_descendants() <= before, "a process was left running"


def test_tp_below_one_is_refused(demo_model):
    from zpp import LLM
    from zpp.errors import ConfigError
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be >= 1"):
        LLM(demo_model, tensor_parallel_size=0)


@pytest.mark.slow
def test_tp_refused_by_cli(demo_model):
    proc = subprocess.run([sys.executable, "-m", "zpp.cli", "serve", demo_model, "-tp", "2", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zpp: error: ") and "--tensor-parallel-size 2" in lines[0], lines
