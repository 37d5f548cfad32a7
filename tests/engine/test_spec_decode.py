"""Speculative decoding (n-gram drafts, ``--speculative-config``): outputs equal those without it
token for token, greedy and seeded, at PP = 1, 2, 3 on the real demo model, also with forced
preemption, prefix caching and small chunks; drafts are accepted (acceptance is tested, not only
exactness); the scheduler's rollback on its own; bad configurations refused in one line."""
from __future__ import annotations

import pytest

from zpp import LLM, SamplingParams
from zpp.args import engine_config
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.engine.spec_decode import SpecDecoder, propose_ngram
from zpp.errors import ConfigError
from zpp.spec_config import SpeculativeConfig
from zpp.transport import messages as m

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


def _requests():
    """Copy-heavy prompts (long drafts accepted) and others, in every sampling mode that speculates:
    greedy, greedy with logprobs and a stop string, seeded temperature / top-p with logprobs,
    seeded min_tokens with n = 2, a tiny max_tokens; and one with penalties (never speculates)."""
    prompts = [TEXT, CODE, CODE, "The capital of France is", TEXT, "1, 2, 3, 1, 2, 3, 1, 2,", TEXT]
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, stop=["mul"]),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, logprobs=1),
              SamplingParams(temperature=1.0, seed=11, max_tokens=16, min_tokens=12, n=2),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2)]
    return prompts, params


def _generate(model, prompts, params, **kw):
    with LLM(model, device="cpu", max_model_len=512, **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"
    return outs, stats


def _same(base, outs, label):
    for i, (a, b) in enumerate(zip(base, outs)):
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.token_ids == ca.token_ids, f"{label}: request {i} differs"
            assert cb.text == ca.text and cb.finish_reason == ca.finish_reason, f"{label}: request {i}"
            if ca.logprobs is not None:
                assert [sorted(d) for d in cb.logprobs] == [sorted(d) for d in ca.logprobs], f"{label}: request {i}"
                assert [d[t].logprob for d, t in zip(cb.logprobs, cb.token_ids)] == pytest.approx(
                    [d[t].logprob for d, t in zip(ca.logprobs, ca.token_ids)], abs=1e-4), f"{label}: request {i}"


@pytest.mark.slow
def test_ngram_outputs_equal_without_at_pp_1_2_3(demo_model):
    """The same tokens, text, logprobs and finish reasons with and without n-gram speculation at
    PP = 1, 2, 3 (greedy and seeded alike: a verify row draws exactly what plain decoding draws);
    at PP=2 also with prefix caching, a KV cache small enough to preempt and 24-token micro-batches
    (chunked prompts, drafts cut to the budget). Drafts were accepted in every run."""
    prompts, params = _requests()
    base, _ = _generate(demo_model, prompts, params)
    for pp, kw in ((1, {}), (3, {}), (2, dict(enable_prefix_caching=True, num_kv_blocks=10, block_size=16,
                                              max_num_batched_tokens=24))):
        outs, st = _generate(demo_model, prompts, params, pipeline_parallel_size=pp, speculative_config=NGRAM, **kw)
        _same(base, outs, f"PP={pp}")
        # drafts were accepted: a mean acceptance length of at least 1.5 (about 2 in these runs)
        assert st.spec_num_drafts > 0 and 2 * st.spec_num_accepted_tokens >= st.spec_num_drafts, (pp, st)
        assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
        if kw:
            assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st


# --- the scheduler's bookkeeping on its own --------------------------------------------------------

def _sched(num_blocks=16, k=3, prefix=False):
    kv = KVCacheManager(num_blocks, 4, prefix)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=1))
    return Scheduler(kv, 8, 64, 64, spec=spec), kv, spec


def test_scheduler_rolls_back_rejected_drafts():
    """A decode with drafts is one chunk of 1 + k tokens; with 1 of 3 drafts accepted the request
    counts 2 more positions computed (the last token's and the draft's), gains 2 tokens, and is not
    scheduled again while the chunk is in flight; its rejected positions' KV slots are reused. A
    block holding a rejected position is not registered in the prefix cache."""
    s, kv, spec = _sched(prefix=True)
    req = Request("a", [5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=20), 20, {0})
    s.add_request(req)
    b0 = s.schedule()
    s.update(b0, m.StepResult(b0.batch.batch_id, m.pack_int32([7])))  # prompt done; tokens ...5 6 7
    b1 = s.schedule()
    (c,) = b1.chunks
    assert c.start == 5 and c.num_tokens == 4 and c.draft_token_ids == [5, 6, 7] and c.sample  # after "6 7": "5 6 7"
    assert s.schedule() is None  # in flight: its next step needs the accepted count
    out = s.update(b1, m.StepResult(b1.batch.batch_id, m.pack_int32([5, 9]), token_counts=m.pack_int32([2])))
    assert [t for _, _, t in out] == [5, 9]
    assert req.token_ids == [5, 6, 7, 5, 6, 7, 5, 9] and req.num_computed_tokens == 7
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, spec.accepted_per_pos) == (1, 3, 1,
                                                                                                         [1, 0, 0])
    assert len(kv.blocks_of(req)) == 3  # positions up to 8 were written; blocks kept, not re-allocated
    cached = {b for b in kv.blocks_of(req) if kv.block_hash[b] is not None}
    assert cached == set(kv.blocks_of(req)[:1])  # block 1 (positions 4-7) holds accepted tokens only once 7 is
    b2 = s.schedule()
    (c,) = b2.chunks
    assert c.start == 7 and c.new_token_ids == [5, 9] and not c.draft_token_ids  # the accepted tokens overwrite the drafts on the workers


def test_scheduler_drafts_respect_limits_and_stop_tokens():
    """Drafts never run past max_tokens (a chunk's tokens all fit it) and stop at the token budget
    left; tokens after one that ends the request (EOS) are dropped; disable_by_batch_size turns
    drafts off for a step with more decoding requests."""
    s, kv, spec = _sched(k=4)
    req = Request("a", [1, 2, 1, 2], SamplingParams(temperature=0, max_tokens=3), 3, {2})
    s.add_request(req)
    b0 = s.schedule()
    s.update(b0, m.StepResult(b0.batch.batch_id, m.pack_int32([1])))
    b1 = s.schedule()
    assert b1.chunks[0].draft_token_ids == [2]  # 2 output tokens left: 1 draft + the token after it
    out = s.update(b1, m.StepResult(b1.batch.batch_id, m.pack_int32([2, 5]), token_counts=m.pack_int32([2])))
    assert [t for _, _, t in out] == [2] and req.status.finished  # the draft accepted is EOS: the 5 is dropped
    spec.config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1,
                                    disable_by_batch_size=1)
    for rid in "bc":
        s.add_request(Request(rid, [1, 2, 1, 2], SamplingParams(temperature=0, max_tokens=9), 9, {0}))
    b2 = s.schedule()
    s.update(b2, m.StepResult(b2.batch.batch_id, m.pack_int32([1, 1])))
    assert all(not c.draft_token_ids for c in s.schedule().chunks)  # 2 decoding > 1


def test_propose_ngram_takes_the_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3]
    assert propose_ngram(seq, 2, 1, 3) == [8, 7]  # "2 3" (no "7 2 3" earlier): its latest earlier match
    assert propose_ngram(seq, 5, 3, 3) == []  # "7 2 3" never occurred before
    assert propose_ngram([4, 4, 4], 3, 1, 2) == [4]  # the latest match of "4 4" is at 0: one token follows


@pytest.mark.parametrize("spec, msg", [
    ('{"method": "eagle", "num_speculative_tokens": 1}', "method 'eagle' is not supported"),
    ('{"method": "ngram", "model": "/x/draft"}', "a draft model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "foo": 1}', "unknown key(s) foo"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "is larger than"),
    ("ngram", "not valid JSON"),
])
def test_bad_speculative_config_is_refused_in_one_line(demo_model, spec, msg):
    with pytest.raises(ConfigError) as e:
        engine_config(demo_model, streaming=False, speculative_config=spec)
    assert msg in str(e.value) and "\n" not in str(e.value) and "--speculative-config" in str(e.value)


def test_speculative_config_keys_follow_vllm(demo_model):
    c = engine_config(demo_model, streaming=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                        "prompt_lookup_max": 3})
    assert c.speculative_config == SpeculativeConfig("ngram", 2, 3, 3)  # a missing bound is the other one
    assert not c.async_scheduling
    with pytest.raises(ConfigError, match="--speculative-config"):
        engine_config(demo_model, streaming=False, speculative_config=NGRAM, async_scheduling=True).validate()
