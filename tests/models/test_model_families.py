"""Every supported model family, on small random-weight checkpoints written by HF transformers'
``save_pretrained``: greedy tokens equal HF's (fp32, CPU) at PP = 1, 2 and 3 and an uneven split,
the stages chained in this process (``stage_chain``), and through the engine at PP = 3;
unsupported architectures and options are refused at start-up in one line, leaving no worker."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import alive, descendants, hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

MAX_NEW = 16
VOCAB = 49152  # SmolLM2's tokenizer
PROMPT_LENS = (3, 17, 40)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=5, n_head=4, n_positions=256,
                                       initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _opt():  # pre-LayerNorm, no projection (OPT-125m and most sizes)
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM, OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=7,
                                     num_attention_heads=4, max_position_embeddings=256, init_std=0.3,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _opt_350m_style():  # post-LayerNorm, project_in / project_out (OPT-350m)
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM, OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=5,
                                     num_attention_heads=4, word_embed_proj_dim=32, do_layer_norm_before=False,
                                     max_position_embeddings=256, init_std=0.1,  # larger collapses post-LN
                                     bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM, LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, initializer_range=0.3,
                                         bos_token_id=1, eos_token_id=2)


def _qwen2():  # qkv bias, grouped-query attention, tied embeddings
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, tie_word_embeddings=True,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _mixtral():  # top-2 of 8 experts
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=8, num_experts_per_tok=2,
                                             max_position_embeddings=256, initializer_range=0.3,
                                             bos_token_id=1, eos_token_id=2)


FAMILIES = {"gpt2": _gpt2, "opt": _opt, "opt-350m-style": _opt_350m_style, "llama": _llama, "qwen2": _qwen2,
            "mixtral": _mixtral}


def _copy_tokenizer(src: str, dst: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), dst)


def _save_random_model(family: str, out_dir: str, demo_model: str) -> str:
    import torch
    cls, cfg = FAMILIES[family]()
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    _copy_tokenizer(demo_model, out_dir)
    return out_dir


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    import random
    rng = random.Random(1234)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


_DIRS: dict[str, str] = {}
_REFERENCES: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory, demo_model):
    """family -> checkpoint directory, each written once."""
    def get(family: str) -> str:
        if family not in _DIRS:
            _DIRS[family] = _save_random_model(family, str(tmp_path_factory.mktemp(family)), demo_model)
        return _DIRS[family]
    return get


@pytest.fixture
def family_model(request, model_dir_of, prompts):
    """(model dir, HF greedy reference), built once per family."""
    family = request.param
    if family not in _REFERENCES:
        _REFERENCES[family] = hf_greedy(model_dir_of(family), prompts, MAX_NEW)
    return model_dir_of(family), _REFERENCES[family]


@pytest.mark.slow
@pytest.mark.parametrize("family_model", list(FAMILIES), indirect=True)
def test_stages_in_process_match_hf(family_model, prompts):
    """PP = 1 (decoding token by token), 2 and 3 (the engine's default splits) and an uneven PP = 2
    (one layer first), each stage built as a worker builds it and chained in this process: HF's
    greedy tokens, every prompt. The engine itself runs each family once, at PP = 3, below."""
    from stage_chain import check_splits, pp_splits
    model_dir, reference = family_model
    check_splits(model_dir, prompts, reference, pp_splits(model_dir, 2, 3), label=os.path.basename(model_dir))


@pytest.mark.slow
@pytest.mark.parametrize("family_model", list(FAMILIES), indirect=True)
def test_engine_pp3_matches_hf(family_model, prompts):
    """The engine (three worker processes, a middle stage receiving and sending this family's
    activations) at PP = 3: HF's greedy tokens, the three prompts batched."""
    from zpp import LLM, SamplingParams
    model_dir, reference = family_model
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model_dir, pipeline_parallel_size=3, kv_cache_memory="32MiB") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    for i, ref in enumerate(reference):
        assert list(got[i]) == ref, f"PP=3, prompt {i} ({len(prompts[i])} tokens)"


# --- loading ------------------------------------------------------------------------------------
def _load(model_dir: str, pp_rank: int = 0, pp_size: int = 1):
    import json

    import torch

    from zpp.models.base import StageInfo
    from zpp.models.loader import load_stage_model
    from zpp.models.partition import partition_layers
    from zpp.models.registry import resolve_model_class
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    start, end = partition_layers(resolve_model_class(cfg).num_layers_of(cfg), pp_size)[pp_rank]
    return load_stage_model(model_dir, cfg, StageInfo(pp_rank, pp_size, start, end), torch.float32,
                            torch.device("cpu"), 64)


def _rewrite_checkpoint(src: str, dst: str, edit) -> str:
    """Copy ``src``'s config into ``dst`` with its tensors passed through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(edit(load_file(os.path.join(src, "model.safetensors"))), os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_missing_and_unexpected_tensors_are_named(family, model_dir_of, tmp_path):
    import re
    src = model_dir_of(family)
    _load(src)  # the untouched checkpoint loads
    first = next(k for k in sorted(_tensor_names(src)) if re.search(r"\.(layers|h)\.1\.", k))
    missing = _rewrite_checkpoint(src, str(tmp_path / "missing"), lambda t: {k: v for k, v in t.items() if k != first})
    with pytest.raises(ValueError, match=r"missing tensors: .*\.1\."):
        _load(missing)
    extra = first.replace(".1.", ".0.", 1).rsplit(".", 2)[0] + ".bogus.weight"
    unexpected = _rewrite_checkpoint(src, str(tmp_path / "unexpected"), lambda t: {**t, extra: t[first].clone()})
    with pytest.raises(ValueError, match=re.escape(extra)):
        _load(unexpected)
    # A stage that does not own layer 0 never reads the bogus tensor.
    _load(unexpected, pp_rank=1, pp_size=2)


def _tensor_names(model_dir: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.mark.slow
def test_mixtral_fused_expert_checkpoint_loads(model_dir_of, tmp_path):
    """HF 5.x's in-memory layout (``mlp.gate``, fused ``mlp.experts.gate_up_proj`` / ``down_proj``)
    loads into the same parameters as the per-expert ``block_sparse_moe.experts.{e}.w1/w2/w3`` that
    ``save_pretrained`` writes."""
    import re

    import torch
    src = model_dir_of("mixtral")

    def fuse(t):
        out = {k: v for k, v in t.items() if ".block_sparse_moe." not in k}
        for layer in sorted({int(m.group(1)) for k in t if (m := re.search(r"layers\.(\d+)\.block_sparse_moe", k))}):
            p = f"model.layers.{layer}"
            n = sum(1 for k in t if k.startswith(f"{p}.block_sparse_moe.experts.") and k.endswith(".w1.weight"))
            w = lambda e, name: t[f"{p}.block_sparse_moe.experts.{e}.{name}.weight"]
            out[f"{p}.mlp.gate.weight"] = t[f"{p}.block_sparse_moe.gate.weight"]
            out[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w(e, "w1"), w(e, "w3")]) for e in range(n)])
            out[f"{p}.mlp.experts.down_proj"] = torch.stack([w(e, "w2") for e in range(n)])
        return out

    fused = _rewrite_checkpoint(src, str(tmp_path / "fused"), fuse)
    for rank, size in ((0, 1), (1, 2)):
        a, b = _load(src, rank, size).state_dict(), _load(fused, rank, size).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


# --- refusals -------------------------------------------------------------------------------------
def _config_only_dir(tmp_path, cfg: dict) -> str:
    import json
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


FALCON = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB}
LLAMA_DYNAMIC = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB,
                 "max_position_embeddings": 256, "rope_scaling": {"type": "dynamic", "factor": 4.0}}
REFUSALS = {"unsupported-architecture": (FALCON, "FalconForCausalLM"), "dynamic-rope": (LLAMA_DYNAMIC, "dynamic")}


def _live_descendants() -> set[int]:
    return {p for p in descendants(os.getpid()) if alive(p)}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_llm(tmp_path, case):
    from zpp import LLM
    from zpp.errors import ConfigError
    cfg, word = REFUSALS[case]
    model_dir = _config_only_dir(tmp_path, cfg)
    before = _live_descendants()
    with pytest.raises(ConfigError) as info:
        LLM(model_dir, pipeline_parallel_size=2)
    msg = str(info.value)
    assert "\n" not in msg and word in msg and "supported" in msg
    for arch in ("GPT2LMHeadModel", "OPTForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "LlamaForCausalLM"):
        assert arch in msg
    assert _live_descendants() <= before, "a process was left running"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_cli(tmp_path, case):
    cfg, word = REFUSALS[case]
    model_dir = _config_only_dir(tmp_path, cfg)
    proc = subprocess.Popen([sys.executable, "-m", "zpp.cli", "serve", model_dir, "-pp", "2", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("zpp: error: ") and word in lines[0], lines
    # Nothing of its session (workers inherit it) is still alive.
    leftovers = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == proc.pid and fields[0] != "Z":  # fields[3] = process group
                leftovers.append(int(d))
    assert not leftovers, f"processes left running: {leftovers}"
