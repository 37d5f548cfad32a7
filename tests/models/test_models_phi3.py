"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``) on small random-weight checkpoints written by HF
transformers: greedy tokens equal HF's ``generate`` (fp32, CPU) at PP = 1, 2, 3 (and an uneven
split), TP = 2, batched and alone, with chunked prefill and prefix caching; LongRoPE with a short
``original_max_position_embeddings`` (32) so that prompts stay short, cross it while decoding (HF
recomputes the sequence with the long factors there, and so does zpp) or start longer; partial
rotary (Phi-4-mini's 0.75); fused ``qkv_proj`` / ``gate_up_proj`` tensors split per TP rank; the
config forms HF reads and the ones zpp refuses; a sliding window (Phi-3-mini-4k's) as HF masks it."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from helpers import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

VOCAB = 49152  # SmolLM2's tokenizer
MAX_NEW = 16
ORIG = 32  # original_max_position_embeddings of the LongRoPE model
# Prompt lengths: 5 stays short (5 + 16 <= 32); 25 crosses 32 while decoding; 40 is long from the start.
PROMPT_LENS = (5, 25, 40)


def _longrope_cfg():
    """Phi-4-mini's shape in small: partial rotary 0.75 (head_dim 16, 12 rotated), LongRoPE, tied
    embeddings, grouped-query attention."""
    from transformers import Phi3Config
    half = 6
    return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      original_max_position_embeddings=ORIG, partial_rotary_factor=0.75,
                      rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                    "long_factor": [2.0 + 0.5 * i for i in range(half)]},
                      tie_word_embeddings=True, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)


def _mini_cfg():
    """Phi-3-mini-4k's shape in small: full rotary over head_dim 24 (half 12, no power of two),
    no rope scaling, untied head, and a sliding window (Phi-3-mini-4k's 2047, here 12: the 25- and
    40-token prompts attend to their last 12 keys only, on every layer, as HF masks them)."""
    from transformers import Phi3Config
    return Phi3Config(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      sliding_window=12, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)


CONFIGS = {"longrope": _longrope_cfg, "mini": _mini_cfg}
_DIRS: dict[str, str] = {}
_REFS: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def _save(name: str, out_dir: str, demo_model: str) -> str:
    import torch
    from transformers import Phi3ForCausalLM
    torch.manual_seed(0)
    Phi3ForCausalLM(CONFIGS[name]()).to(torch.float32).eval().save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(demo_model, f), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_model):
    def get(name: str) -> str:
        if name not in _DIRS:
            _DIRS[name] = _save(name, str(tmp_path_factory.mktemp(f"phi3-{name}")), demo_model)
        return _DIRS[name]
    return get


def hf_generate(model_dir: str, prompts: list[list[int]], n: int = MAX_NEW) -> list[list[int]]:
    """HF's own inference path: ``generate`` (greedy, EOS ignored), fp32 on the CPU. For Phi-3 it
    differs from a plain forward loop over a KV cache: ``Phi3ForCausalLM.prepare_inputs_for_generation``
    drops the cache and recomputes the sequence when it grows past original_max_position_embeddings."""
    import torch
    from transformers import AutoModelForCausalLM
    todo = [p for p in prompts if (model_dir, tuple(p), n) not in _REFS]
    if todo:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.inference_mode():
            for p in todo:
                out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
                _REFS[(model_dir, tuple(p), n)] = out[0, len(p):].tolist()
    return [_REFS[(model_dir, tuple(p), n)] for p in prompts]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def shared_prefix(prompts) -> list[int]:
    """A prompt sharing the crossing prompt's first 20 tokens (one full 16-token block)."""
    rng = random.Random(99)
    return prompts[1][:20] + [rng.randrange(3, VOCAB) for _ in range(3)]


def _generate(llm, prompts, n=MAX_NEW):
    from zpp import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def _check(got, ref, what):
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g == r, f"{what}, prompt {i}"


# --- HF parity ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_reference_recomputes_at_the_switch(model_dir, prompts):
    """The references exercise the switch: for the prompt that crosses 32 tokens while decoding,
    HF's generate (which recomputes there) differs from a forward loop that keeps the short-factor
    cache, so an engine that skipped the recompute would fail the parity tests below."""
    d = model_dir("longrope")
    ref = hf_generate(d, prompts)
    plain = hf_greedy(d, prompts, MAX_NEW)
    assert ref[0] == plain[0] and ref[2] == plain[2]
    assert ref[1] != plain[1]


@pytest.mark.slow
def test_pp1_chunked_prefill_prefix_caching_batched_and_alone(model_dir, prompts, shared_prefix):
    """PP=1 with 8-token chunks and prefix caching: the three prompts batched, then each alone (the
    cache now holds their blocks: short-factor blocks of the crossing prompt must not serve its
    long-factor recompute, nor the long prompt's), then a prompt sharing a prefix."""
    from zpp import LLM
    d = model_dir("longrope")
    ref = hf_generate(d, prompts + [shared_prefix])
    with LLM(d, kv_cache_memory="16MiB", max_num_batched_tokens=8, enable_prefix_caching=True) as llm:
        _check(_generate(llm, prompts), ref, "batched")
        assert llm.engine.scheduler.stats.num_rope_recomputes == 1  # the 25-token prompt, at 33 tokens
        assert llm.engine.scheduler.stats.num_preemptions == 0
        for i, p in enumerate(prompts):
            assert _generate(llm, [p]) == [ref[i]], f"alone, prompt {i}"
        hits = llm.engine.kv.prefix_hits
        assert _generate(llm, [shared_prefix]) == [ref[3]], "shared prefix"
        assert llm.engine.kv.prefix_hits - hits == 16, "the shared block was not served from the cache"


@pytest.mark.slow
@pytest.mark.parametrize("pp, partition", [(2, None), (3, (1, 3, 1))])
def test_pipeline_parallel(model_dir, prompts, pp, partition):
    from zpp import LLM
    d = model_dir("longrope")
    ref = hf_generate(d, prompts)
    with LLM(d, pipeline_parallel_size=pp, pp_layer_partition=partition, kv_cache_memory="16MiB",
             max_num_batched_tokens=16) as llm:
        _check(_generate(llm, prompts), ref, f"PP={pp} {partition}")


@pytest.mark.slow
def test_tensor_parallel(model_dir, prompts):
    """TP=2: the fused qkv_proj is split by the q, k and v widths (4 heads, 2 KV heads of 16)."""
    from zpp import LLM
    d = model_dir("longrope")
    ref = hf_generate(d, prompts)
    with LLM(d, tensor_parallel_size=2, kv_cache_memory="16MiB") as llm:
        _check(_generate(llm, prompts), ref, "TP=2")


@pytest.mark.slow
def test_phi3_mini_shape_pp2_tp2(model_dir, prompts):
    """Full rotary over a head size of 24, no rope scaling, untied head, sliding window 12: TP=2 x
    PP=2 and batched, chunked prefill; the window matters (HF without it differs)."""
    from zpp import LLM
    d = model_dir("mini")
    ref = hf_generate(d, prompts)
    with LLM(d, pipeline_parallel_size=2, tensor_parallel_size=2, kv_cache_memory="16MiB",
             max_num_batched_tokens=16) as llm:
        _check(_generate(llm, prompts), ref, "mini TP=2 PP=2")
    import torch
    from transformers import AutoModelForCausalLM
    full = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    full.config.sliding_window = None  # the same weights without the window
    with torch.inference_mode():
        out = full.generate(torch.tensor([prompts[2]]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[0, len(prompts[2]):].tolist() != ref[2], "the window made no difference: the test shows nothing"


# --- pieces ---------------------------------------------------------------------------------------
def test_rotary_table_matches_hf(model_dir):
    """zpp's cos/sin rows equal HF's Phi3RotaryEmbedding for a short sequence (short factors) and a
    long one (long factors, every position), attention factor included; partial rotary width 12."""
    import torch
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from zpp.models.phi3 import Phi3ForCausalLM, _rope_settings, phi3_config
    from zpp.models.layers.rotary import RotaryEmbedding
    d = model_dir("longrope")
    hf_cfg = AutoConfig.from_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        cfg = phi3_config(json.load(f))
    head_dim, rotary_dim, theta, scaling = _rope_settings(cfg)
    assert (head_dim, rotary_dim) == (16, 12)
    assert Phi3ForCausalLM.rope_switch_length(cfg) == ORIG
    ours = RotaryEmbedding(head_dim, 128, theta, scaling, rotary_dim)
    hf = Phi3RotaryEmbedding(hf_cfg)
    x = torch.zeros(1, dtype=torch.float32)
    assert hf.attention_scaling > 1.0
    for n, long in ((20, False), (ORIG, False), (ORIG + 1, True), (100, True)):
        pos = torch.arange(n)
        cos, sin = hf(x, pos[None])
        rows = ours.rope_rows(pos, torch.full((n,), int(long)))
        torch.testing.assert_close(ours.cos[rows], cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin[rows], sin[0], rtol=0, atol=1e-6)
    # Without flags, a position's row is long exactly from the switch on (decode steps).
    assert ours.rope_rows(torch.tensor([0, 31, 32, 99])).tolist() == [0, 31, 64, 131]


def test_fused_tensors_split_per_tp_rank(model_dir):
    """Each TP rank's qkv_proj holds its heads' rows of q, of k and of v (widths from the head counts),
    gate_up_proj its rows of gate and of up; o_proj / down_proj their input columns."""
    import torch
    from safetensors.torch import load_file

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    d = model_dir("longrope")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    ckpt = load_file(os.path.join(d, "model.safetensors"))
    n = cfg["num_hidden_layers"]
    # state_dict(): dense weights (a float32 CPU stage packs its linears for oneDNN; see cpu_linear)
    ranks = [load_stage_model(d, cfg, StageInfo(0, 1, 0, n, r, 2), torch.float32, torch.device("cpu"),
                              64).state_dict() for r in range(2)]
    q, kv = 4 * 16, 2 * 16
    for i in range(n):
        p = f"model.layers.{i}"
        full = ckpt[f"{p}.self_attn.qkv_proj.weight"]
        fq, fk, fv = full.split([q, kv, kv])
        gate, up = ckpt[f"{p}.mlp.gate_up_proj.weight"].chunk(2)
        for r, params in enumerate(ranks):
            mine = params[f"{p}.self_attn.qkv_proj.weight"].detach()
            want = torch.cat([fq.chunk(2)[r], fk.chunk(2)[r], fv.chunk(2)[r]])
            assert torch.equal(mine, want), (i, r)
            gu = params[f"{p}.mlp.gate_up_proj.weight"].detach()
            assert torch.equal(gu, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])), (i, r)
            o = params[f"{p}.self_attn.o_proj.weight"].detach()
            assert torch.equal(o, ckpt[f"{p}.self_attn.o_proj.weight"].chunk(2, dim=1)[r]), (i, r)


BASE = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 128}


def test_config_forms():
    """The forms HF's Phi3Config reads: old type names su / yarn are longrope, the top-level
    original_max_position_embeddings wins over the rope dict's (default 4096), partial_rotary_factor
    from the top level or the rope dict, rms_norm_eps 1e-5 by default."""
    from zpp.models.phi3 import Phi3ForCausalLM, _rope_settings, phi3_config
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for t in ("su", "yarn", "longrope"):
        cfg = {**BASE, "original_max_position_embeddings": 64, "rope_scaling": {"type": t, **factors,
                                                                               "original_max_position_embeddings": 8}}
        assert Phi3ForCausalLM.rope_switch_length(cfg) == 64, t
    assert Phi3ForCausalLM.rope_switch_length({**BASE, "rope_scaling": {"type": "longrope", **factors}}) == 4096
    assert Phi3ForCausalLM.rope_switch_length(BASE) is None
    half = {"short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    top = phi3_config({**BASE, "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", **half}})
    nested = phi3_config({**BASE, "rope_parameters": {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                                      "rope_theta": 10000.0, **half}})
    assert _rope_settings(top)[:2] == _rope_settings(nested)[:2] == (16, 12)
    assert phi3_config(BASE)["rms_norm_eps"] == 1e-5


@pytest.mark.parametrize("edit, word", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}}, "long_factor"),
    ({"hidden_act": "gelu_fast"}, "gelu_fast"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_unsupported_configs_refused(edit, word):
    from zpp.errors import ConfigError
    from zpp.models.registry import resolve_model_class
    with pytest.raises(ConfigError, match=word) as info:
        resolve_model_class({**BASE, **edit})
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("async_on", [False, True])
def test_decode_graph_path(model_dir, prompts, tmp_path, monkeypatch, async_on):
    """The runner's decode-graph path on the CPU (``ZPP_EAGER_GRAPHS``, see tests/workers/test_graph_path_cpu.py),
    where the model derives LongRoPE's rows from the positions: with a budget of 2 tokens per step,
    batches of one decode and one prompt token reach it, also a token of the 40-token prompt at a
    position below 32 (which needs the long rows: the runner sends such a batch down the eager path).
    With async scheduling, the crossing request is not decoded ahead past the switch."""
    from zpp import LLM
    d = model_dir("longrope")
    ref = hf_generate(d, prompts)
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    with LLM(d, device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=2,
             async_scheduling=async_on) as llm:
        _check(_generate(llm, prompts), ref, f"graph path, async {async_on}")
        assert llm.engine.scheduler.stats.num_rope_recomputes == 1
    assert replays.exists() and len(replays.read_text().split()) >= 20, "the graph path did not run"
