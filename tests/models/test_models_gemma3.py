"""Gemma 3 text (``Gemma3ForCausalLM``) on small random-weight checkpoints written by HF
transformers: greedy tokens equal HF's (fp32, CPU) with sliding-window layers (window 8) interleaved
with global ones, prompts of up to 60 tokens and 20 generated (so every sequence outgrows the
window), at PP = 1, 2, 3 (uneven split), TP = 2, batched and alone, with chunked prefill (chunks
of 6 tokens, smaller than the window, and of 16, crossing it), KV blocks of 4 tokens (windows
spanning several blocks, blocks wholly outside them), prefix caching, and the decode-graph path
run on the CPU. Also: the language model of a ``Gemma3ForConditionalGeneration`` checkpoint, HF's
old config keys, and one-line refusals."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from helpers import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

VOCAB = 49152  # SmolLM2's tokenizer
WINDOW = 8
MAX_NEW = 20
PROMPT_LENS = (3, 17, 45, 60)


def _text_config(**kw):
    from transformers import Gemma3TextConfig
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
                sliding_window_pattern=3,                      # layers 2 and 5 global, the rest sliding
                rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=100.0,
                query_pre_attn_scalar=24, final_logit_softcapping=3.0, initializer_range=0.3,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return Gemma3TextConfig(**base)


def _randomize_norms(model):
    """HF initialises Gemma's norm weights to 0 (a scale of 1): random offsets, so a norm that
    multiplies by ``weight`` instead of ``1 + weight`` cannot pass."""
    import torch
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _copy_tokenizer(src: str, dst: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, demo_model):
    import torch
    from transformers import Gemma3ForCausalLM
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(_text_config()).eval()
    _randomize_norms(model)
    out = str(tmp_path_factory.mktemp("gemma3"))
    model.save_pretrained(out)
    _copy_tokenizer(demo_model, out)
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1234)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    ps.append(ps[2][:40] + [rng.randrange(3, VOCAB) for _ in range(9)])  # shares 40 tokens with prompt 2
    return ps


@pytest.fixture(scope="module")
def reference(gemma_dir, prompts):
    return hf_greedy(gemma_dir, prompts, MAX_NEW)


@pytest.mark.slow
def test_hf_reference_depends_on_the_window(gemma_dir, prompts, reference, tmp_path):
    """The checkpoint's window matters for these prompts: without it (all layers global) HF's tokens
    differ, so the parity tests below do check the window."""
    cfg = json.load(open(os.path.join(gemma_dir, "config.json")))
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    for f in os.listdir(gemma_dir):
        shutil.copy(os.path.join(gemma_dir, f), tmp_path)
    json.dump(cfg, open(tmp_path / "config.json", "w"))
    assert hf_greedy(str(tmp_path), prompts[2:4], MAX_NEW) != reference[2:4]


ENGINES = {  # PP=1 and plain splits: test_stages_in_process_match_hf
    "pp2-chunks6-blocks4-prefix-graphpath": dict(pipeline_parallel_size=2, max_num_batched_tokens=6, block_size=4,
                                                 enable_prefix_caching=True),
    "pp3-uneven-chunks16-prefix": dict(pipeline_parallel_size=3, pp_layer_partition=(1, 3, 2),
                                       max_num_batched_tokens=16, enable_prefix_caching=True),
    "tp2-chunks10-blocks4-prefix": dict(tensor_parallel_size=2, max_num_batched_tokens=10, block_size=4,
                                        enable_prefix_caching=True),
}


@pytest.mark.slow
def test_stages_in_process_match_hf(gemma_dir, prompts, reference):
    """PP=1 (decoding token by token), an even PP=2 and a one-layer-first PP=2, each stage built as a
    worker builds it and chained in this process: HF's greedy tokens for every prompt (the windows
    are the layers' own). The engine's runs (PP = 2, 3, TP, chunks, prefix caching, the graph
    path) follow."""
    from stage_chain import check_splits, pp_splits
    check_splits(gemma_dir, prompts, reference, pp_splits(gemma_dir, 2), label="Gemma 3")


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_matches_hf(gemma_dir, prompts, reference, engine, tmp_path, monkeypatch):
    from zpp import LLM, SamplingParams
    kw = ENGINES[engine]
    replays = tmp_path / "replays"
    if "graphpath" in engine:  # the decode-graph path of the model runner, on the CPU
        monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(gemma_dir, kv_cache_memory="16MiB", **kw) as llm:
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


@pytest.mark.slow
def test_multimodal_checkpoint_serves_its_language_model(demo_model, prompts, tmp_path):
    """``Gemma3ForConditionalGeneration``: ``text_config`` nested, ``language_model.`` names, a
    vision tower that is never read; text prompts give HF's tokens (HF runs the whole model)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from zpp import LLM, SamplingParams
    text = _text_config(num_hidden_layers=3, sliding_window_pattern=2, final_logit_softcapping=None).to_dict()
    cfg = Gemma3Config(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                             num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                       eoi_token_index=VOCAB - 2)
    torch.manual_seed(1)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    _randomize_norms(model)
    model.save_pretrained(tmp_path)
    _copy_tokenizer(demo_model, str(tmp_path))
    saved = json.load(open(tmp_path / "config.json"))
    assert "text_config" in saved and "vocab_size" not in saved
    ps = [prompts[1], prompts[3]]
    ref = hf_greedy(str(tmp_path), ps, 12)
    with LLM(str(tmp_path), pipeline_parallel_size=2, kv_cache_memory="16MiB", max_num_batched_tokens=16) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ps, SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True), use_tqdm=False)]
    assert [list(g) for g in got] == ref


def test_old_config_keys_read_as_hf_reads_them():
    """Hub configs of Gemma 3 predate ``layer_types`` and nested ``rope_parameters``:
    ``sliding_window_pattern``, ``rope_theta`` + ``rope_scaling`` (global layers only) and
    ``rope_local_base_freq`` give the layer types and RoPE HF derives from them."""
    from transformers import Gemma3TextConfig

    from zpp.models.gemma3 import Gemma3ForCausalLM, layer_types, rope_by_layer_type
    old = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 8,
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "sliding_window_pattern": 4, "rope_theta": 500000.0, "rope_local_base_freq": 1000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    hf = Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"})
    cfg = Gemma3ForCausalLM.normalize_config(old)
    assert layer_types(cfg) == hf.layer_types
    ropes = rope_by_layer_type(cfg)
    for kind, (theta, scaling) in ropes.items():
        assert theta == hf.rope_parameters[kind]["rope_theta"]
        assert scaling["rope_type"] == hf.rope_parameters[kind]["rope_type"]
        assert scaling.get("factor") == hf.rope_parameters[kind].get("factor")
    assert cfg["vocab_size"] == hf.vocab_size and cfg["query_pre_attn_scalar"] == hf.query_pre_attn_scalar


@pytest.mark.parametrize("key,value,word", [("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
                                            ("use_bidirectional_attention", True, "use_bidirectional_attention"),
                                            ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "dynamic")])
def test_unsupported_options_refused_in_one_line(tmp_path, key, value, word):
    from zpp import LLM
    from zpp.errors import ConfigError
    cfg = _text_config().to_dict()
    cfg.pop("rope_parameters")
    cfg.update({"architectures": ["Gemma3ForCausalLM"], key: value})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        LLM(str(tmp_path), pipeline_parallel_size=2)
    msg = str(info.value)
    assert "\n" not in msg and word in msg and "Gemma3ForCausalLM" in msg
