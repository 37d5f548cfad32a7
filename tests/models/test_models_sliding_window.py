"""Sliding-window attention in the LLaMA family as HF's configs ask for it: Mistral (every layer),
Qwen2 with ``use_sliding_window`` (the layers from ``max_window_layers`` on) and Mixtral, on small
random-weight checkpoints with a window of 8 tokens: greedy tokens equal HF's (fp32, CPU) for
prompts of up to 60 tokens + 16 generated, with chunked prefill crossing the window, KV blocks of 4,
prefix caching, PP = 2 and TP = 2."""
from __future__ import annotations

import os
import random
import shutil

import pytest

from helpers import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny in-process ops (conftest.py)

VOCAB = 49152
WINDOW = 8
MAX_NEW = 16


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM, MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, sliding_window=WINDOW,
                                             initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _qwen2():  # layers 2..4 sliding, 0..1 full
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM, Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=2, tie_word_embeddings=True,
                                         initializer_range=0.3, bos_token_id=1, eos_token_id=2)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                             max_position_embeddings=256, initializer_range=0.3,
                                             bos_token_id=1, eos_token_id=2)


FAMILIES = {"mistral": _mistral, "qwen2": _qwen2, "mixtral": _mixtral}
ENGINES = {  # family -> engine settings
    "mistral": dict(pipeline_parallel_size=2, max_num_batched_tokens=6, block_size=4, enable_prefix_caching=True),
    "qwen2": dict(tensor_parallel_size=2, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True),
    "mixtral": dict(pipeline_parallel_size=1, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(99)
    ps = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 30, 60)]
    ps.append(ps[2][:40] + [rng.randrange(3, VOCAB) for _ in range(7)])
    return ps


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory, demo_model):
    import torch
    dirs = {}

    def get(family):
        if family not in dirs:
            cls, cfg = FAMILIES[family]()
            torch.manual_seed(0)
            out = str(tmp_path_factory.mktemp(family))
            cls(cfg).eval().save_pretrained(out)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if os.path.exists(os.path.join(demo_model, f)):
                    shutil.copy(os.path.join(demo_model, f), out)
            dirs[family] = out
        return dirs[family]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sliding_window_matches_hf(model_dir_of, prompts, family):
    from zpp import LLM, SamplingParams
    from zpp.models.llama import layer_windows
    import json
    model_dir = model_dir_of(family)
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert WINDOW in layer_windows(cfg), "the checkpoint has no sliding-window layer"
    reference = hf_greedy(model_dir, prompts, MAX_NEW)
    kw = ENGINES[family]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(model_dir, kv_cache_memory="16MiB", **kw) as llm:
        alone = llm.generate([prompts[2]], sp, use_tqdm=False)[0].outputs[0].token_ids
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert list(alone) == reference[2]
    for i, ref in enumerate(reference):
        assert list(got[i]) == ref, f"{family}: prompt {i} ({len(prompts[i])} tokens)"


def test_layer_windows_follow_hf_configs():
    """Which layers slide, read from raw config.json dicts as HF reads them."""
    from transformers import MistralConfig, Qwen2Config

    from zpp.models.llama import layer_windows
    assert layer_windows({"model_type": "mistral", "num_hidden_layers": 2}) == [4096, 4096] \
        == [MistralConfig().sliding_window] * 2
    assert layer_windows({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None}) == [None, None]
    raw = {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 32,
           "max_window_layers": 1}
    hf = Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert layer_windows(raw) == [32 if t == "sliding_attention" else None for t in hf.layer_types] \
        == [None, 32, 32, 32]
    assert layer_windows({**raw, "use_sliding_window": False}) == [None] * 4
    assert layer_windows({"model_type": "llama", "num_hidden_layers": 3, "sliding_window": 8}) == [None] * 3
