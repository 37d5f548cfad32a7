"""The step cost model (zpp.engine.step_cost) and the prompt chunks it sizes (issue 28, item 1), in
process: the fit recovers known per-stage coefficients from noisy step times and keeps them
non-negative; the scheduler, fed the step times of a simulated pipeline, cuts prompt chunks so the
slowest stage's step stays at the target while streams decode (smaller with a slower stage) and
gives prompts whole chunks when nothing decodes. No workers, a second or two."""
from __future__ import annotations

import numpy as np
import pytest

from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.engine.step_cost import (FEATURES, MIN_PROMPT_CHUNK, StepCostModel, StepFeatures, StepTarget, _nnls,
                                  chunk_pairs, prior_coefficients)
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m

TRUE = (0.01, 0.004, 0.003, 2e-6, 1e-6)  # a CPU stage of the demo model, roughly (s per unit)


def _random_steps(rng, n):
    """``n`` feature vectors of plausible micro-batches: decodes at various contexts, half of them
    with a prompt chunk somewhere in a long prompt."""
    out = []
    for _ in range(n):
        rows = int(rng.integers(1, 32))
        chunk = int(rng.integers(1, 512)) if rng.random() < 0.5 else 0
        start = int(rng.integers(0, 6000))
        ctx = rows * int(rng.integers(16, 2000))
        out.append(StepFeatures(1.0, rows, chunk, chunk_pairs(start, chunk) if chunk else 0, ctx))
    return out


def _cost(coef, x) -> float:
    return sum(c * v for c, v in zip(coef, x))


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_fit_recovers_known_coefficients_from_noisy_step_times(noise):
    """Samples of a known model with multiplicative noise: every coefficient within 10% (5% noise)
    whatever the prior (here 3x too slow on one stage, 3x too fast on the other); predictions of
    unseen steps within a few percent; a stage is fitted from its own samples only."""
    rng = np.random.default_rng(7)
    model = StepCostModel([[3 * c for c in TRUE], [c / 3 for c in TRUE]])
    slow = [2 * c for c in TRUE]
    for x in _random_steps(rng, 400):
        model.add_sample(0, x, _cost(TRUE, x) * (1 + noise * rng.standard_normal()))
        model.add_sample(1, x, _cost(slow, x) * (1 + noise * rng.standard_normal()))
    for stage, want in ((0, TRUE), (1, slow)):
        got = model.coefficients(stage)
        for name, g, w in zip(FEATURES, got, want):
            assert abs(g / w - 1) < (0.03 if noise == 0 else 0.1), (stage, name, got, want)
    for x in _random_steps(rng, 50):
        assert model.predict(x) == pytest.approx(_cost(slow, x), rel=0.05)
        assert model.stage_times(x)[0] == pytest.approx(_cost(TRUE, x), rel=0.05)


def test_fit_is_non_negative_where_least_squares_is_not():
    """Data from a model with no per-step cost and no decode-row cost, plus noise: plain least
    squares gives negative coefficients; the model's are >= 0 and satisfy the optimality conditions
    of the constrained problem (zero gradient on the positive ones, no descent into the zero ones)."""
    rng = np.random.default_rng(3)
    true = (0.0, 0.0, 0.003, 2e-6, 1e-6)
    xs = _random_steps(rng, 300)
    ts = [_cost(true, x) * (1 + 0.2 * rng.standard_normal()) for x in xs]
    w = 1 / np.asarray(ts)  # the model's relative weighting
    X = np.asarray(xs) * w[:, None]
    plain = np.linalg.lstsq(X, np.asarray(ts) * w, rcond=None)[0]
    assert plain.min() < 0, plain  # the test would not show anything otherwise
    model = StepCostModel([[1e-3, 1e-3, 1e-3, 1e-6, 1e-6]], prior_weight=1e-9, forget=1.0)
    for x, t in zip(xs, ts):
        model.add_sample(0, x, t)
    got = np.asarray(model.coefficients(0))
    assert (got >= 0).all() and (got == 0).any(), got
    # KKT of min |Xb - y|^2, b >= 0, in the columns' scale
    s = np.linalg.norm(X, axis=0)
    grad = (X / s).T @ (X / s @ (got * s) - np.asarray(ts) * w)
    assert np.all(np.abs(grad[got > 0]) < 1e-6 * len(ts)), grad
    assert np.all(grad[got == 0] >= -1e-6 * len(ts)), grad
    # _nnls itself on a small case with a known answer
    G = np.array([[2.0, 1.0], [1.0, 2.0]])
    assert _nnls(G, np.array([-1.0, 2.0])) == pytest.approx([0.0, 1.0])
    assert _nnls(G, np.array([3.0, 3.0])) == pytest.approx([1.0, 1.0])


def test_prior_until_data_then_recent_data_wins():
    """No samples: the prior. Decode-only samples leave the prompt coefficients at the prior (the
    data says nothing about them). After the machine gets twice as slow, the recent samples win."""
    prior = prior_coefficients({"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                                "intermediate_size": 1536, "vocab_size": 49152}, 15, "cpu", last=True)
    assert all(p > 0 for p in prior) and prior[1] > prior[2]  # the LM head per decode row
    model = StepCostModel([prior])
    assert model.coefficients(0) == pytest.approx(prior)
    rng = np.random.default_rng(1)
    for _ in range(200):
        rows, ctx = int(rng.integers(1, 32)), int(rng.integers(16, 2000))
        x = StepFeatures(1.0, rows, 0, 0, rows * ctx)
        model.add_sample(0, x, _cost(TRUE, x))
    got = model.coefficients(0)
    assert got[2] == pytest.approx(prior[2], rel=0.05) and got[3] == pytest.approx(prior[3], rel=0.05)
    x = StepFeatures(1.0, 16, 0, 0, 16 * 1000)
    assert model.predict(x) == pytest.approx(_cost(TRUE, x), rel=0.05)
    for _ in range(1500):
        rows, ctx = int(rng.integers(1, 32)), int(rng.integers(16, 2000))
        y = StepFeatures(1.0, rows, 0, 0, rows * ctx)
        model.add_sample(0, y, 2 * _cost(TRUE, y))
    assert model.predict(x) == pytest.approx(2 * _cost(TRUE, x), rel=0.05)


def test_max_chunk_is_the_largest_that_fits_on_every_stage():
    model = StepCostModel([TRUE, [2 * c for c in TRUE]])
    for start in (0, 100, 3000, 6000):
        for left in ([0.3, 0.3], [0.05, 1.0], [1.0, 0.05]):
            n = model.max_chunk(left, start)
            fits = lambda k: all(t <= lt + 1e-12 for t, lt in zip(model.chunk_times(start, k), left))
            assert (n == 0 or fits(n)) and not fits(n + 1), (start, left, n)
    a, b = model.chunk_times(0, 30), model.chunk_times(30, 50)  # chunks add up
    assert [x + y for x, y in zip(a, b)] == pytest.approx(model.chunk_times(0, 80))
    assert model.max_chunk([-0.1, 1.0], 0) == 0
    assert StepCostModel([[0.01, 0.001, 0, 0, 0]]).max_chunk([0.1], 0) is None  # prompt tokens are free


def test_observe_matches_times_to_recorded_batches():
    model = StepCostModel([TRUE, TRUE])
    x = StepFeatures(1.0, 4, 100, chunk_pairs(0, 100), 4 * 50)
    model.record(7, x)
    model.observe(0, [6, 7], [5.0, 0.9])  # 6 was never recorded: ignored
    assert model.num_samples == [1, 0]
    model.observe(1, [7], [0.9])
    assert model.num_samples == [1, 1] and 7 not in model._batches  # every stage reported it


# --- the scheduler's chunks follow the model ----------------------------------------------------------

def _run(stage_factors, target=0.8, depth=2, long_len=3000, stream_tokens=16, budget=2048, overhead=0.0):
    """A pipeline of ``len(stage_factors)`` simulated stages, stage ``k`` costing ``TRUE`` times its
    factor, behind a scheduler with ``target`` (seconds between a stream's tokens) and a cost model
    whose prior is 3x too optimistic; the stages' times are fed back as the engine does, and the
    engine's clock advances by the slowest stage's time plus ``overhead`` per micro-batch. Four
    streams decode ``stream_tokens`` tokens; a ``long_len``-token prompt arrives once they decode.
    Returns (per micro-batch with a chunk of the long prompt: (its start, its tokens, whether any
    stream was decoding when it was scheduled, the slowest stage's true seconds); the streams'
    gaps between tokens while the long prompt was prefilled; the scheduler's StepTarget)."""
    model = StepCostModel([[c / 3 for c in TRUE]] * len(stage_factors))
    kv = KVCacheManager(2000, 16)
    step_target = StepTarget(model, target, depth)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=8192, depth=depth,
                      target=step_target)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    streams = [Request(f"s{i}", list(range(10 + i, 42 + i)), sp(stream_tokens), stream_tokens, set(), arrival=float(i))
               for i in range(4)]
    long = Request("long", [(7 * i) % 900 + 10 for i in range(long_len)], sp(1), 1, set(), arrival=10.0)
    for r in streams:
        sched.add_request(r)
    inflight, out, gaps, clock = [], [], [], 0.0
    while not long.status.finished:
        if long.req_id not in sched.requests and all(r.num_output_tokens >= 2 for r in streams):
            sched.add_request(long)
        while len(inflight) < depth:
            b = sched.schedule()
            if b is None:
                break
            inflight.append((b, any(r.num_output_tokens and not r.status.finished for r in streams)))
        b, decoding = inflight.pop(0)
        x = model._batches[b.batch.batch_id][0]
        times = [f * _cost(TRUE, x) for f in stage_factors]
        for k, t in enumerate(times):
            model.observe(k, [b.batch.batch_id], [t])
        clock += max(times) + overhead
        for c in b.chunks:
            if c.req_id == "long" and c.num_tokens > 1:
                out.append((c.start, c.num_tokens, decoding, max(times)))
        before = {r.req_id: r.last_token_at for r in streams}
        toks = m.pack_int32([11] * b.num_sampled)
        sched.release_finished([r for r, _, _ in sched.update(b, m.StepResult(b.batch.batch_id, toks), clock)])
        if long.req_id in sched.requests and long.num_computed_tokens < long_len:
            gaps += [clock - before[r.req_id] for r in streams if before[r.req_id] is not None
                     and r.last_token_at == clock]
    assert sum(n for _, n, _, _ in out) == long_len
    return out, gaps, step_target


def test_chunks_follow_the_cost_model_smaller_for_a_slow_stage_full_when_nothing_decodes():
    """While streams decode, each chunk of the long prompt is the largest the model predicts within
    the step target (0.8 s / depth 2 = 0.4 s): once the model has learnt (a few batches), the
    slowest stage's true step stays within 5% of the target unless the minimum chunk binds; chunks shrink
    as the context grows; a stage twice as slow gets chunks about half as large. Once no stream
    decodes, the prompt takes whole chunks of the token budget (its half of the remainder at depth 2)."""
    even = _run([1.0, 1.0])[0]
    slow = _run([1.0, 2.0])[0]
    for run in (even, slow):
        during = [(s, n, t) for s, n, dec, t in run if dec]
        assert len(during) > 10
        for i, (s, n, t) in enumerate(during):  # learning (the prior is 3-6x optimistic), then on target
            assert t <= 0.4 * (1.1 if i < 8 else 1.05) or n == MIN_PROMPT_CHUNK, (i, s, n, t)
        assert max(t for _, _, t in during[8:]) > 0.4 * 0.95  # and not far below it
        assert during[-1][1] < 0.7 * during[0][1]  # the context costs
        after = [(s, n) for s, n, dec, _ in run if not dec]
        assert after and all(n >= min(1000, 3000 - s) for s, n in after), after
    mean = lambda run: np.mean([n for s, n, dec, _ in run if dec and 500 <= s < 1500])
    assert 0.35 < mean(slow) / mean(even) < 0.65, (mean(slow), mean(even))


def test_measured_gap_overhead_is_taken_off_the_step_target():
    """The engine adds time the stages do not see (here 0.1 s per micro-batch, 0.2 s per stream gap
    at depth 2): the scheduler learns it from the streams' measured gaps and shrinks the steps, so
    the gaps themselves come back to the target; without it the steps fill the target alone."""
    _, plain_gaps, plain = _run([1.0, 1.0], stream_tokens=200)
    _, gaps, target = _run([1.0, 1.0], stream_tokens=200, overhead=0.1)
    assert abs(plain.overhead) < 0.04 and plain.step_s == pytest.approx(0.4, rel=0.05)
    assert target.overhead == pytest.approx(0.2, rel=0.15) and target.step_s == pytest.approx(0.3, rel=0.05)
    late = gaps[len(gaps) // 2:]
    assert np.mean(late) == pytest.approx(0.8, rel=0.05) and max(late) < 0.8 * 1.1, late
    assert np.mean(plain_gaps[len(plain_gaps) // 2:]) == pytest.approx(0.8, rel=0.05)
    # with no overhead taken off, the same engine's gaps would be 2 x 0.4 + 0.2 = 1.0 s


@pytest.mark.parametrize("decode_s", [0.05, 0.37])
def test_short_prompt_next_to_a_long_prefill_goes_whole_or_gets_the_floor(decode_s):
    """A 32-token request arriving during a long prefill while streams decode: with time to spare
    it goes whole in the next micro-batch; when the decodes take (nearly) the whole step target it
    still gets ``MIN_PROMPT_CHUNK`` tokens per micro-batch next to the long prompt's, instead of
    the scraps of the time left."""
    cost = StepCostModel([(decode_s, 0.0, 0.003, 2e-6, 0.0)])  # a fixed model: no observations
    kv = KVCacheManager(2000, 16)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=8192, depth=1,
                      target=StepTarget(cost, 0.4, 1))
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    streams = [Request(f"s{i}", list(range(10 + i, 42 + i)), sp(100), 100, set(), arrival=0.0) for i in range(3)]
    long = Request("long", list(range(10, 3010)), sp(1), 1, set(), arrival=1.0)
    short = Request("short", list(range(20, 52)), sp(1), 1, set(), arrival=2.0)

    def step():
        b = sched.schedule()
        sched.update(b, m.StepResult(b.batch.batch_id, m.pack_int32([11] * b.num_sampled)))
        return b

    for r in streams:
        sched.add_request(r)
    step()
    sched.add_request(long)
    for _ in range(3):
        step()
    sched.add_request(short)
    chunks = {c.req_id: c.num_tokens for c in step().chunks}
    if decode_s < 0.1:
        assert chunks["short"] == 32 and chunks["long"] > MIN_PROMPT_CHUNK, chunks  # 2 prompts, 3 streams
    else:
        assert chunks["short"] == MIN_PROMPT_CHUNK == chunks["long"], chunks
        assert {c.req_id: c.num_tokens for c in step().chunks}["short"] == MIN_PROMPT_CHUNK


def test_a_burst_of_waiting_prompts_outweighs_few_streams():
    """With more requests waiting for their first token than streams decoding, the step may grow in
    proportion (each stream's longer gap buys every waiting request an earlier first token): one
    stream next to one long prompt keeps the target's chunk; next to 20 new prompts the step takes
    them all, as without a target (the throughput of a burst served over HTTP)."""
    def first_prompt_tokens(prompts):
        cost = StepCostModel([(0.05, 0.0, 0.003, 0.0, 0.0)])
        sched = Scheduler(KVCacheManager(2000, 16), max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192,
                          depth=1, target=StepTarget(cost, 0.4, 1))
        sched.add_request(Request("s", list(range(10, 42)), SamplingParams(max_tokens=50, ignore_eos=True), 50, set(),
                                  arrival=0.0))
        b = sched.schedule()
        sched.update(b, m.StepResult(b.batch.batch_id, m.pack_int32([11])))
        for i, n in enumerate(prompts):
            sched.add_request(Request(f"p{i}", list(range(10, 10 + n)), SamplingParams(max_tokens=1), 1, set(),
                                      arrival=1.0 + i))
        return sched.schedule().num_prefill_tokens

    assert first_prompt_tokens([1000]) == int((0.4 - 0.05) / 0.003)
    assert first_prompt_tokens([64] * 20) == 20 * 64


def test_no_target_keeps_the_token_budget_and_offline_chunks_unchanged():
    """Without a target the scheduler records nothing and cuts nothing: the chunks are those of the
    token budget alone (the offline default)."""
    kv = KVCacheManager(2000, 16)
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=8192, depth=1)
    assert sched.cost is None and sched.target is None
    sched.add_request(Request("a", list(range(10, 3010)), SamplingParams(max_tokens=1), 1, set(), arrival=0.0))
    assert sched.schedule().num_tokens == 2048
