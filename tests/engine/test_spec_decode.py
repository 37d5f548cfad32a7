"""Speculative decoding (n-gram drafts, ``--speculative-config``): outputs equal those without it
token for token, greedy and seeded, at PP = 1, 2, 3 on the real demo model, also with forced
preemption, prefix caching, small chunks and across a stage restart; structured outputs (JSON
schema, regex) with drafts walked by the grammar and cut where it refuses one; drafts are accepted
(acceptance is tested, not only exactness); ``disable_by_batch_size`` and ``min_acceptance_rate``
step speculation aside; the scheduler's rollback on its own; bad configurations refused in one line.

One engine per configuration for the whole module (their starts are most of its time): ``base``
(PP=1, no speculation) gives the reference outputs; ``spec1`` (PP=1, ``disable_by_batch_size`` 4),
``spec2`` (PP=2, prefix caching, a KV cache small enough to preempt, 24-token micro-batches) and
``spec3`` (PP=3, ``min_acceptance_rate`` 0.9) speculate."""
from __future__ import annotations

import json
import logging
import math
import signal
import threading
import time

import msgspec
import numpy as np
import pytest

from zpp import LLM, SamplingParams, StructuredOutputsParams as SO
from zpp.args import engine_config
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.engine.spec_decode import BACKOFF_STEPS, SpecDecoder, propose_ngram
from zpp.errors import ConfigError
from zpp.spec_config import SpeculativeConfig
from zpp.transport import messages as m

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
SPEC1 = {**NGRAM, "disable_by_batch_size": 4}
SPEC3 = {**NGRAM, "min_acceptance_rate": 0.9}

CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}}, "required": ["name", "age", "city"]}
# Constrained, copy-heavy: drafts from the prompt that the grammar accepts, and (the last) drafts
# it refuses ("dog" where it wants "cat"): the draft is cut there.
CONSTRAINED = [
    ('Repeat this JSON exactly: {"name": "Anna", "age": 31, "city": "Paris"}\nJSON: ',
     SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(json=PERSON))),
    (CODE, SamplingParams(temperature=0, max_tokens=28, structured_outputs=SO(
        regex=r"    return a \* b\n\n(def [a-z]+\(a, b\):\n    return a [-+*/] b\n\n){1}"))),
    (CODE, SamplingParams(temperature=0.8, seed=3, max_tokens=28, structured_outputs=SO(
        regex=r"    return a \* b\n\n(def [a-z]+\(a, b\):\n    return a [-+*/] b\n\n){1}"))),
    (TEXT, SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(
        regex=r" brown fox jumps over the lazy cat\. The [a-z]+ [a-z]+ fox"))),
]
LOW_ACCEPTANCE = "red, green, blue, red, green, blue, yellow, red, green,"  # drafts proposed, nearly all rejected


def _requests():
    """Copy-heavy prompts (long drafts accepted) and others, in every sampling mode that speculates:
    greedy, greedy with logprobs and a stop string, seeded temperature / top-p with logprobs,
    seeded min_tokens with n = 2, a tiny max_tokens; one with penalties (never speculates); then the
    constrained ones (``CONSTRAINED``)."""
    prompts = [TEXT, CODE, CODE, "The capital of France is", TEXT, "1, 2, 3, 1, 2, 3, 1, 2,", TEXT]
    params = [SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0, max_tokens=16, logprobs=2),
              SamplingParams(temperature=0, max_tokens=24, stop=["mul"]),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, logprobs=1),
              SamplingParams(temperature=1.0, seed=11, max_tokens=16, min_tokens=12, n=2),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.2)]
    return prompts + [p for p, _ in CONSTRAINED], params + [sp for _, sp in CONSTRAINED]


# The other tests' requests, whose reference outputs the base engine computes with _requests()'.
LOCKSTEP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LOW = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


class _StartLog(logging.Handler):
    """The INFO lines ``zpp.engine.core`` logs while an engine starts (its level raised to INFO
    meanwhile)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _llm(model, **kw):
    """An LLM on the CPU; ``llm.start_log``: what the engine core logged while it started."""
    core_log, handler = logging.getLogger("zpp.engine.core"), _StartLog()
    level = core_log.level
    core_log.setLevel(logging.INFO)
    core_log.addHandler(handler)
    try:
        llm = LLM(model, device="cpu", max_model_len=512, **kw)
    finally:
        core_log.removeHandler(handler)
        core_log.setLevel(level)
    llm.start_log = handler.lines
    return llm


@pytest.fixture(scope="module")
def base(demo_model):
    with _llm(demo_model) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec1(demo_model):
    with _llm(demo_model, speculative_config=SPEC1) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec2(demo_model):
    with _llm(demo_model, pipeline_parallel_size=2, speculative_config=NGRAM, enable_prefix_caching=True,
              num_kv_blocks=10, block_size=16, max_num_batched_tokens=24) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec3(demo_model):
    with _llm(demo_model, pipeline_parallel_size=3, speculative_config=SPEC3) as llm:
        yield llm


@pytest.fixture(scope="module")
def base_all(base):
    """The reference outputs of every test, in one batch: ``_requests()``, then TEXT with
    ``LOCKSTEP`` and LOW_ACCEPTANCE with ``LOW``."""
    prompts, params = _requests()
    return base.generate(prompts + [TEXT, LOW_ACCEPTANCE], params + [LOCKSTEP, LOW], use_tqdm=False)


@pytest.fixture(scope="module")
def base_outputs(base_all):
    return base_all[:-2]


class _Delta:
    """The change of an engine's speculative-decoding counters over a block."""

    def __init__(self, llm):
        self.llm = llm

    def __enter__(self):
        self.s0 = self.llm.engine.stats()
        return self

    def __exit__(self, *exc):
        s = self.llm.engine.stats()
        self.drafts = s.spec_num_drafts - self.s0.spec_num_drafts
        self.draft_tokens = s.spec_num_draft_tokens - self.s0.spec_num_draft_tokens
        self.accepted = s.spec_num_accepted_tokens - self.s0.spec_num_accepted_tokens
        self.stats = s


def _generate(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"
    return outs


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
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_ngram_outputs_equal_without_at_pp_1_2_3(request, base_outputs, pp):
    """The same tokens, text, logprobs and finish reasons with and without n-gram speculation at
    PP = 1, 2, 3 (greedy and seeded alike: a verify row draws exactly what plain decoding draws);
    at PP=2 also with prefix caching, a KV cache small enough to preempt and 24-token micro-batches
    (chunked prompts, drafts cut to the budget); at PP=1 with drafts off while more than 4
    requests decode, at PP=3 paused after low acceptance. The constrained requests (JSON schema,
    regex, greedy and seeded) are among them at PP = 1, 2. Drafts were accepted in every run."""
    llm = request.getfixturevalue(f"spec{pp}")
    prompts, params = _requests()
    n = len(prompts) - (len(CONSTRAINED) if pp == 3 else 0)  # constrained: at PP = 1, 2 (and restart)
    with _Delta(llm) as d:
        outs = _generate(llm, prompts[:n], params[:n])
    _same(base_outputs[:n], outs, f"PP={pp}")
    st = d.stats
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    if pp < 3:  # drafts were accepted: a mean acceptance length of at least 1.5 (about 2 in these runs)
        assert d.drafts > 0 and 2 * d.accepted >= d.drafts, (pp, st)
    else:  # fewer drafts (disable_by_batch_size, min_acceptance_rate), still accepted
        assert d.drafts > 0 and d.accepted > 0, st
    if pp == 2:
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st


@pytest.mark.slow
def test_constrained_drafts_follow_the_grammar(base_outputs, spec1):
    """Structured outputs with speculation: JSON-schema and regex outputs (greedy and seeded) equal
    the outputs without it, token for token, with drafts proposed and accepted (the result rank's
    matcher walks each chunk's drafts for its 1 + k masks; a draft the grammar refuses is cut,
    here "dog" where the regex wants "cat"). (They are also among the requests of the PP = 1, 2,
    3 equality test, at PP=2 with preemption, and of the stage-restart test.)"""
    prompts, params = zip(*CONSTRAINED)
    with _Delta(spec1) as d:
        outs = _generate(spec1, list(prompts), list(params))
    _same(base_outputs[-len(CONSTRAINED):], outs, "constrained")
    assert json.loads(outs[0].outputs[0].text) == {"name": "Anna", "age": 31, "city": "Paris"}
    assert outs[3].outputs[0].text.startswith(" brown fox jumps over the lazy cat.")
    assert d.drafts > 0 and 2 * d.accepted >= d.drafts, vars(d)


@pytest.mark.slow
def test_disable_by_batch_size_runs_the_batch_without_drafts(base_all, spec1):
    """``disable_by_batch_size`` 4 (PP=1: one micro-batch a step): five greedy sequences decoding
    together (one prompt, n = 5, prefilled in one step, the same length to the end) get no draft at
    all, and the same prompt with n = 4 gets drafts; the tokens are those without speculation."""
    five, four = (msgspec.structs.replace(LOCKSTEP, n=n) for n in (5, 4))
    ref = [base_all[-2].outputs[0].token_ids] * 9  # greedy: every sequence is the one without n
    with _Delta(spec1) as d:
        outs = _generate(spec1, [TEXT], [five])
    assert (d.drafts, d.draft_tokens) == (0, 0)
    with _Delta(spec1) as d4:
        outs += _generate(spec1, [TEXT], [four])
    assert d4.drafts > 0 and d4.accepted > 0
    assert [c.token_ids for o in outs for c in o.outputs] == ref


@pytest.mark.slow
def test_min_acceptance_rate_pauses_drafts(base_all, spec1, spec3):
    """``min_acceptance_rate`` 0.9: a request whose drafts are nearly all rejected proposes after a
    rejected chunk none for ``BACKOFF_STEPS`` steps, so at most one draft chunk per 17 of its steps
    (without the floor: every step whose suffix recurs has one); the tokens are unchanged."""
    sp, ref = LOW, base_all[-1:]
    with _Delta(spec1) as free:
        _same(ref, _generate(spec1, [LOW_ACCEPTANCE], sp), "no floor")
    assert free.accepted < 0.9 * free.draft_tokens / 2  # well below the floor
    with _Delta(spec3) as floor:
        _same(ref, _generate(spec3, [LOW_ACCEPTANCE], sp), "floor")
    assert 0 < floor.drafts <= math.ceil(48 / (BACKOFF_STEPS + 1)) < free.drafts, (floor.drafts, free.drafts)


@pytest.mark.slow
def test_outputs_equal_across_a_stage_restart(base_outputs, spec2):
    """The last stage of the PP=2 engine is SIGKILLed mid-decode (verify chunks in flight): it is
    restarted in place, every request is recomputed from its prompt and the tokens it kept, and the
    outputs equal the run without speculation, token for token."""
    import os
    llm = spec2
    ex = llm.engine.executor
    victim = next(p for p in ex.procs if p.name == "zpp-worker-1")
    core = llm.engine.core
    gen0 = core.num_generation_tokens
    restarts0 = list(llm.engine.stats().stage_restarts)

    def kill():
        deadline = time.monotonic() + 120
        while core.num_generation_tokens < gen0 + 12 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(victim.pid, signal.SIGKILL)
    t = threading.Thread(target=kill, daemon=True)
    t.start()
    prompts, params = _requests()
    pick = [0, 1, 4, len(prompts) - 4, len(prompts) - 1]  # greedy, logprobs, seeded, JSON, a refused draft
    with _Delta(llm) as d:
        outs = _generate(llm, [prompts[i] for i in pick], [params[i] for i in pick])
    t.join()
    assert d.stats.stage_restarts == [restarts0[0], restarts0[1] + 1], d.stats.stage_restarts
    _same([base_outputs[i] for i in pick], outs, "stage restart")
    assert d.drafts > 0 and d.accepted > 0


def test_grammar_walks_drafts_and_cuts_at_a_refused_one(tokenizer):
    """The result rank's verify masks (SlotGrammars.fill_drafts): row j of a chunk is the mask after
    its first j drafts (as a matcher fed token by token gives it); the walk stops at the first draft
    the grammar refuses (the row before it disallows it; later rows all ones) and after a draft that
    completes the grammar; rollback restores the state before the walk."""
    import xgrammar as xgr
    from zpp.workers.grammar import SlotGrammars
    from zpp.workers.slots import SlotTable

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_regex(r"[0-9]{3}-[0-9]{4}")
    eos = tokenizer.eos_token_id
    table, g = SlotTable(4, 64, 16), SlotGrammars(4, len(tokenizer))
    b = m.BatchBuilder()
    for s in range(2):
        b.new_request(s, f"r{s}", [1], 1, [0], None)
    batch = b.build(0)
    batch.grammars = [m.GrammarInit(s, "k", [eos], compiled.serialize_json() if s == 0 else "") for s in range(2)]
    batch.grammar_tokenizer = info.serialize_json()
    table.apply(batch)
    g.apply(batch, table)
    tok = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    digits = tok("5551234")
    assert len(digits) == 7  # one token per digit
    dash = tok("-")
    drafts = [digits[:2] + tok("a") + digits[2:3],  # refused at its third draft
              digits[:3] + dash + digits[3:7] + [eos]]  # complete, then EOS ends it
    bitmask, walked = g.fill_drafts(np.array([0, 1]), np.array([0, 0]), drafts)
    bitmask = bitmask.copy()
    assert walked.tolist() == [2, 9]

    ref = xgr.GrammarMatcher(compiled, override_stop_tokens=[eos])
    want = xgr.allocate_token_bitmask(1, info.vocab_size).numpy()

    def mask_after(tokens):
        ref.reset()
        for t in tokens:
            assert ref.accept_token(t)
        ref.fill_next_token_bitmask(want, 0)
        return want[0].copy()
    rows0 = bitmask[:5]
    for j in range(3):
        assert (rows0[j] == mask_after(drafts[0][:j])).all(), j
    assert not (rows0[2][drafts[0][2] // 32] >> (drafts[0][2] % 32)) & 1  # the refused draft is disallowed
    assert (rows0[3:] == -1).all()
    rows1 = bitmask[5:]
    for j in range(9):
        assert (rows1[j] == mask_after(drafts[1][:j])).all(), j
    assert (rows1[9] == -1).all()  # after the completing EOS: never kept
    g.rollback(np.array([0, 1]), walked)
    assert g.num_accepted[:2].tolist() == [0, 0]
    assert (g.fill(np.array([0, 1]), np.array([0, 0])) == mask_after([])).all()
    # after the walk and the rollback, the matchers accept the chunk's tokens as usual
    assert g.accept(np.array([0]), digits[:1]) == ([], [])


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
    ('{"num_speculative_tokens": 3}', 'no "method" given'),
])
def test_bad_speculative_config_is_refused_in_one_line(demo_model, spec, msg):
    with pytest.raises(ConfigError) as e:
        engine_config(demo_model, streaming=False, speculative_config=spec)
    assert msg in str(e.value) and "\n" not in str(e.value) and "--speculative-config" in str(e.value)


@pytest.mark.slow
def test_engine_start_logs_the_speculative_config(base, spec1):
    """One INFO line at engine start says speculative decoding is on, with its method, draft
    length and lookup range (vLLM logs its speculative config); none without it."""
    said = [line for line in spec1.start_log if line.startswith("speculative decoding")]
    assert said == ["speculative decoding on: method=ngram, num_speculative_tokens=3, prompt_lookup_min=2, "
                    "prompt_lookup_max=4, disable_by_batch_size=4"], spec1.start_log
    assert any(line.startswith("engine ready in") for line in base.start_log), base.start_log
    assert not [line for line in base.start_log if "speculative" in line], base.start_log


def test_speculative_config_log_line_names_mtp_layers_and_backoff():
    mtp = SpeculativeConfig("mtp", 2, min_acceptance_rate=0.25)
    assert mtp.describe({"num_nextn_predict_layers": 1}) == \
        "speculative decoding on: method=mtp, num_speculative_tokens=2, mtp_layers=1, min_acceptance_rate=0.25"
    assert SpeculativeConfig().describe() == \
        "speculative decoding on: method=ngram, num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=5"


def test_speculative_config_keys_follow_vllm(demo_model):
    c = engine_config(demo_model, streaming=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                                        "prompt_lookup_max": 3})
    assert c.speculative_config == SpeculativeConfig("ngram", 2, 3, 3)  # a missing bound is the other one
    assert not c.async_scheduling
    with pytest.raises(ConfigError, match="--speculative-config"):
        engine_config(demo_model, streaming=False, speculative_config=NGRAM, async_scheduling=True).validate()
