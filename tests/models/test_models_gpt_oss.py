"""gpt-oss (``GptOssForCausalLM``) on small random-weight checkpoints written by HF transformers:
greedy tokens equal HF's (fp32, CPU) with attention sinks, sliding-window layers (window 8)
alternating with full ones, YaRN RoPE and the biased, clamped-SwiGLU experts, prompts of up to 60
tokens and 20 generated, at PP = 1, 2, 3 (uneven split), TP = 2 and TP = 2 x PP = 2, batched and
alone, with chunked prefill (chunks of 6, smaller than the window, of 10 and of 16, crossing it), KV
blocks of 4 tokens and prefix caching, and through the model runner's decode-graph path on the CPU
(``ZPP_EAGER_GRAPHS``). Refused in one line: an MXFP4 block size other than the release's (MXFP4
as released loads: test_w4.py), a tensor-parallel size that does not divide the heads."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from helpers import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # tiny in-process ops (conftest.py)

VOCAB = 49152  # SmolLM2's tokenizer
WINDOW = 8
MAX_NEW = 20
PROMPT_LENS = (3, 17, 45, 60)


def _config(**kw):
    from transformers import GptOssConfig
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=WINDOW, max_position_embeddings=256,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0},
                initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return GptOssConfig(**base)


def _randomize(model):
    """HF initialises norms to 1 and the experts' biases to 0; random values instead, and sinks
    large enough to take a real share of the softmax."""
    import torch
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("_bias") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2)


def _copy_tokenizer(src: str, dst: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory, demo_model):
    import torch
    from transformers import GptOssForCausalLM
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).eval()
    _randomize(model)
    out = str(tmp_path_factory.mktemp("gpt-oss"))
    model.save_pretrained(out)
    _copy_tokenizer(demo_model, out)
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(4321)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    ps.append(ps[2][:40] + [rng.randrange(3, VOCAB) for _ in range(9)])  # shares 40 tokens with prompt 2
    return ps


@pytest.fixture(scope="module")
def reference(oss_dir, prompts):
    return hf_greedy(oss_dir, prompts, MAX_NEW)


def _variant(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), dst)
    if edit_config:
        cfg = json.load(open(os.path.join(src, "config.json")))
        edit_config(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if edit_tensors:
        t = load_file(os.path.join(src, "model.safetensors"))
        edit_tensors(t)
        save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_hf_reference_depends_on_window_and_sinks(oss_dir, prompts, reference, tmp_path):
    """Without the window (all layers full) or without the sinks (logit -1e4), HF's tokens differ,
    so the parity tests below check both."""
    def no_window(cfg):
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]

    def no_sinks(t):
        for k in t:
            if k.endswith("sinks"):
                t[k].fill_(-1e4)

    a = _variant(oss_dir, tmp_path / "a", edit_config=no_window)
    b = _variant(oss_dir, tmp_path / "b", edit_tensors=no_sinks)
    assert hf_greedy(a, prompts[2:4], MAX_NEW) != reference[2:4]
    assert hf_greedy(b, prompts[2:4], MAX_NEW) != reference[2:4]


ENGINES = {  # PP=1 and plain splits: test_stages_in_process_match_hf
    "pp2-chunks6-blocks4-prefix-graphpath": dict(pipeline_parallel_size=2, max_num_batched_tokens=6, block_size=4,
                                                 enable_prefix_caching=True),
    "pp3-uneven-chunks16-prefix": dict(pipeline_parallel_size=3, pp_layer_partition=(1, 3, 1),
                                       max_num_batched_tokens=16, enable_prefix_caching=True),
    "tp2-chunks10-blocks4-prefix-graphpath": dict(tensor_parallel_size=2, max_num_batched_tokens=10, block_size=4,
                                                  enable_prefix_caching=True),
    "tp2-pp2-uneven": dict(tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition=(3, 2),
                           max_num_batched_tokens=16),
}


def test_stages_in_process_match_hf(oss_dir, prompts, reference):
    """PP=1 (decoding token by token), an even PP=2 and a one-layer-first PP=2, each stage built as a
    worker builds it and chained in this process: HF's greedy tokens for every prompt (the windows
    are the layers' own). The engine's runs (PP = 2, 3, TP, chunks, prefix caching, the graph
    path) follow."""
    from stage_chain import check_splits, pp_splits
    check_splits(oss_dir, prompts, reference, pp_splits(oss_dir, 2), label="gpt-oss")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_matches_hf(oss_dir, prompts, reference, engine, tmp_path, monkeypatch):
    from zpp import LLM, SamplingParams
    kw = ENGINES[engine]
    replays = tmp_path / "replays"
    if "graphpath" in engine:  # the decode-graph path of the model runner, on the CPU
        monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(oss_dir, kv_cache_memory="16MiB", **kw) as llm:
        alone = llm.generate([prompts[2]], sp, use_tqdm=False)[0].outputs[0].token_ids
        hits = llm.engine.kv.prefix_hits
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        hits = llm.engine.kv.prefix_hits - hits
    assert list(alone) == reference[2], f"{engine}: prompt 2 alone"
    for i, ref in enumerate(reference):
        assert list(batched[i]) == ref, f"{engine}: prompt {i} ({len(prompts[i])} tokens) batched"
    if kw.get("enable_prefix_caching"):
        assert hits >= 40 // kw.get("block_size", 16) * kw.get("block_size", 16), f"prefix cache hits: {hits}"
    if "graphpath" in engine:
        assert replays.exists() and len(replays.read_text().split()) >= MAX_NEW, "the graph path did not run"


@pytest.mark.parametrize("case", ["mxfp4", "tp3"])
def test_refused_in_one_line(oss_dir, tmp_path, case):
    from zpp import LLM
    from zpp.errors import ConfigError
    kw = {}
    if case == "mxfp4":
        cfg = json.load(open(os.path.join(oss_dir, "config.json")))
        cfg["quantization_config"] = {"quant_method": "mxfp4", "block_size": 16,  # as released it loads: test_w4.py
                                      "modules_to_not_convert": ["model.layers.*.self_attn"]}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        model, word = str(tmp_path), "mxfp4"
    else:
        model, word, kw = oss_dir, "--tensor-parallel-size 3 does not divide the model's num_attention_heads (4)", \
            dict(tensor_parallel_size=3)
    with pytest.raises(ConfigError) as info:
        LLM(model, **kw)
    msg = str(info.value)
    assert "\n" not in msg and word in msg
    if case == "mxfp4":
        assert "GptOssForCausalLM" in msg
