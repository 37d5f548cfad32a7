"""Greedy token-for-token parity with HF transformers (fp32, CPU) on the real SmolLM2 weights, at
PP = 1, 2, 3, 4, with prompts batched together and one at a time."""
from __future__ import annotations

import pytest

from conftest import hf_greedy

MAX_NEW = 32
TEXTS = [
    "Paris",
    "The quick brown fox jumps over",
    "Write a short poem about the sea and the wind, in the style of an old sailor's song.",
]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ps = [[tokenizer.bos_token_id or 1]]                      # 1 token
    ps += [tokenizer.encode(t) for t in TEXTS]                 # short / medium
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    ps.append(tokenizer.encode(chat, add_special_tokens=False))
    story = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
             "clockmaker who repaired every clock in the valley. ") * 8
    long = tokenizer.encode(story + "One morning, a stranger arrived with a broken watch and said")
    assert len(long) > 200
    ps.append(long)
    return ps


@pytest.fixture(scope="module")
def reference(demo_model, prompts):
    return hf_greedy(demo_model, prompts, MAX_NEW)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_greedy_matches_hf(demo_model, prompts, reference, pp):
    from zpp import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(demo_model, pipeline_parallel_size=pp, kv_cache_memory="256MiB") as llm:
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    for i, ref in enumerate(reference):
        assert batched[i] == ref, f"PP={pp} batched, prompt {i} ({len(prompts[i])} tokens)"
        assert alone[i] == ref, f"PP={pp} alone, prompt {i} ({len(prompts[i])} tokens)"
