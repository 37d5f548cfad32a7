"""Scheduler and block manager in-process (no workers): a simulated model returns a deterministic
token per position, so every request's output is known and preemption / chunking / pipelining
must not change it."""
from __future__ import annotations

import random

import pytest

from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request, RequestStatus
from zpp.engine.scheduler import Scheduler
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m


def fake_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 31 + len(tokens)) % 1000 + 10


class SimWorkers:
    """Mirrors what the workers keep (token lists, block tables, by slot) from the encoded messages
    alone and checks every batch against it."""

    def __init__(self, kv: KVCacheManager, max_slots: int = 1 << 20):
        self.kv = kv
        self.max_slots = max_slots
        self.state: dict[int, tuple[list[int], list[int]]] = {}
        self.computed: dict[int, int] = {}  # positions with KV, once known (not after a prefix hit)

    def run(self, batch: m.ExecuteBatch) -> m.StepResult:
        batch = m.to_worker_decoder.decode(m.encode(batch))
        for slot in m.int32s(batch.freed_slots).tolist():
            assert slot in self.state, "a freed slot that holds no request"
            del self.state[slot]
            self.computed.pop(slot, None)
        for r in batch.new_reqs:
            assert r.slot not in self.state, "a new request in a slot still held"
            assert 0 <= r.slot < self.max_slots, "slot past max_num_seqs"
            self.state[r.slot] = (m.int32s(r.token_ids).tolist(), m.int32s(r.block_ids).tolist())
        sampled = []
        chunks = m.chunks_of(batch)
        assert len({c.slot for c in chunks}) == len(chunks), "a request twice in one batch"
        for c in chunks:
            toks, blocks = self.state[c.slot]
            toks.extend(c.new_token_ids)
            blocks.extend(c.new_block_ids)
            assert c.start + c.num_tokens <= len(toks)
            assert len(blocks) * self.kv.block_size >= c.start + c.num_tokens, "KV slots missing"
            assert self.computed.get(c.slot, c.start) == c.start, "a chunk does not follow the last one"
            self.computed[c.slot] = c.start + c.num_tokens
            if c.sample:
                assert c.start + c.num_tokens == len(toks)
                sampled.append(fake_token(toks))
        return m.StepResult(batch.batch_id, m.pack_int32(sampled))


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks))
    return toks[len(prompt):]


def drive(sched: Scheduler, workers: SimWorkers, depth: int, max_steps: int = 100000,
          arrivals: list[tuple[int, Request]] = ()) -> int:
    """Run the engine's loop without workers: keep up to ``depth`` micro-batches in flight (results
    held back until ``depth`` batches are out, as the pipeline does), apply the oldest, repeat.
    ``arrivals`` are (step, request) pairs added once that many batches have come back. Returns
    the number of batches applied; fails on a livelock or after ``max_steps``."""
    inflight = []
    steps = 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while sched.has_work() or inflight or pending:
        while pending and (pending[0][0] <= steps or not (sched.has_work() or inflight)):
            sched.add_request(pending.pop(0)[1])
        while len(inflight) < depth:
            b = sched.schedule()
            if b is None:
                break
            # a request is in several in-flight batches only for consecutive prefill chunks, of
            # which only the last may sample (a decode waits for its previous token)
            ends = {c.req_id: (c.start + c.num_tokens, c.sample) for b2 in inflight for c in b2.chunks}
            for c in b.chunks:
                if c.req_id in ends:
                    assert c.start == ends[c.req_id][0] and not ends[c.req_id][1], (c, ends[c.req_id])
            assert b.num_tokens <= sched.max_num_batched_tokens
            inflight.append(b)
        assert inflight, "livelock: work left but nothing schedulable"
        b = inflight.pop(0)
        res = workers.run(b.batch)
        updates = sched.update(b, res)
        sched.release_finished([r for r, _, _ in updates])
        steps += 1
        assert steps < max_steps, f"no finish within {max_steps} steps ({sched.stats.num_preemptions} preemptions)"
    return steps


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_blocks", [12, 40])
@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_survive_preemption_and_chunking(depth, num_blocks, chunked):
    bs = 16
    kv = KVCacheManager(num_blocks, bs)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64 if chunked else 256, max_model_len=256,
                      enable_chunked_prefill=chunked, depth=depth)
    rng = random.Random(depth * 100 + num_blocks)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randrange(5, 100))]
        r = Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), 60, set(),
                    arrival=float(i))
        reqs.append(r)
        sched.add_request(r)
    drive(sched, SimWorkers(kv, 8), depth)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 60)
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    if num_blocks == 12:
        assert sched.stats.num_preemptions > 0


def test_abort_in_flight_frees_after_return():
    kv = KVCacheManager(20, 16)
    sched = Scheduler(kv, 8, 64, 256, depth=2)
    r = Request("a", list(range(10, 40)), SamplingParams(max_tokens=10), 10, set())
    sched.add_request(r)
    b = sched.schedule()
    assert r.in_flight and kv.num_free_blocks < 20
    sched.abort("a")
    assert kv.num_free_blocks < 20, "blocks freed while a batch in flight still writes them"
    sched.update(b, m.StepResult(b.batch.batch_id, m.pack_int32([5])))
    assert kv.num_free_blocks == 20
    b2 = sched.schedule()
    assert b2 is None and sched._freed_slots == [0]  # told to the workers with the next batch


def test_prefix_cache_hits_and_eviction():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks usable
    a = Request("a", prompt, SamplingParams(), 1, set())
    blocks, n = kv.get_computed_blocks(a)
    assert (blocks, n) == ([], 0)
    assert kv.allocate_slots(a, 17) is not None
    a.num_computed_tokens = 17
    kv.cache_full_blocks(a)
    kv.free(a)
    b = Request("b", prompt + [5], SamplingParams(), 1, set())
    blocks, n = kv.get_computed_blocks(b)
    assert n == 16 and len(blocks) == 4
    added = kv.allocate_slots(b, 18, blocks)
    assert added[:4] == blocks
    # every other block can still be allocated: cached-but-free blocks are evictable
    c = Request("c", list(range(500, 520)), SamplingParams(), 1, set())
    assert kv.allocate_slots(c, 3 * 4) is not None
    assert kv.num_free_blocks == 0


def test_prefix_cache_counts_each_admitted_request_once():
    """Prefix-cache statistics count a request's prompt once, when it is first admitted: not each
    time a waiting request is looked at and does not fit, nor its recompute after a preemption (a
    newcomer saw queries rise 140x faster than prompt tokens with a small cache)."""
    bs = 16
    kv = KVCacheManager(12, bs, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, depth=2)
    shared = list(range(100, 132))
    reqs = [Request(f"r{i}", shared + [200 + i] * 8, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                    100, set(), arrival=float(i)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, SimWorkers(kv, 8), 2)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert sched.stats.num_preemptions > 0, "the cache was meant to be too small for all three"
    assert kv.prefix_queries == sum(len(r.prompt_token_ids) for r in reqs)
    assert 0 <= kv.prefix_hits <= kv.prefix_queries


def test_kv_refuses_without_side_effects():
    kv = KVCacheManager(4, 16)
    r = Request("x", list(range(70)), SamplingParams(), 1, set())
    assert kv.allocate_slots(r, 70) is None
    assert kv.num_free_blocks == 4 and kv.blocks_of(r) == []


def expected_until_stop(prompt: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
    toks = list(prompt)
    while len(toks) - len(prompt) < max_tokens:
        toks.append(fake_token(toks))
        if toks[-1] in stop_ids:
            break
    return toks[len(prompt):]


def _pressure_case(seed: int):
    """Property: with a small cache, a small budget and 1-3 micro-batches in flight, every request
    finishes within a bound on steps (no livelock, no starvation), with the tokens it gets alone.

    Bound: the oldest running request is never preempted by another and runs at least once every
    ``depth`` + 1 steps, and runs one chunk of its prompt or one decode each time; so the run takes
    at most (depth + 1) x sum over requests of (chunks of prompt + max_tokens) steps after the last
    arrival.
    """
    rng = random.Random(seed)
    depth = rng.randint(1, 3)
    bs = rng.choice([4, 8, 16])
    num_blocks = rng.randint(3, 12)
    cap = num_blocks * bs
    chunked = rng.random() < 0.75
    max_model_len = cap
    budget = rng.randint(max(1, bs // 2), 2 * bs) if chunked else max_model_len
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=rng.random() < 0.5)
    sched = Scheduler(kv, max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=budget,
                      max_model_len=max_model_len, enable_chunked_prefill=chunked, depth=depth)
    shared = [rng.randrange(10, 1000) for _ in range(rng.randint(0, cap // 2))]
    n = rng.randint(3, 6)
    steps_in = sorted([0] + [rng.randint(0, 4) for _ in range(n - 1)])
    reqs, arrivals, cost = [], [], 0
    for i in range(n):
        total = rng.randint(max(2, cap // 2), cap)  # prompt + max_tokens: most of the cache
        n_prompt = rng.randint(1, total - 1)
        prompt = (shared[:n_prompt] if rng.random() < 0.5 else []) + \
            [rng.randrange(10, 1000) for _ in range(n_prompt)]
        prompt = prompt[:n_prompt]
        max_tokens = total - n_prompt
        stop = {rng.randrange(10, 1010)} if rng.random() < 0.3 else set()
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=sorted(stop) or None)
        r = Request(f"r{i}", prompt, sp, max_tokens, set(), arrival=float(i))
        reqs.append((r, stop))
        arrivals.append((steps_in[i], r))
        cost += -(-total // budget) + max_tokens
    bound = steps_in[-1] + (depth + 1) * cost
    try:
        return drive(sched, SimWorkers(kv, sched.max_num_seqs), depth, max_steps=bound + 1, arrivals=arrivals), \
            bound, sched, kv, reqs
    except AssertionError as e:
        raise AssertionError(f"seed {seed}: {e}") from None


@pytest.mark.slow
def test_forward_progress_under_memory_pressure():
    # 300 random cases (~1 s); about 3% of them livelocked or starved with the earlier policy
    # (victims skipped when in flight, readmission on the first chunk).
    for seed in range(300):
        _, _, sched, kv, reqs = _pressure_case(seed)
        for r, stop in reqs:
            assert r.status.finished, seed
            assert r.output_token_ids == expected_until_stop(r.prompt_token_ids, r.max_tokens, stop), seed
        assert kv.num_free_blocks == kv.num_blocks, f"blocks leaked (seed {seed})"
        # Preemptions stay bounded: fewer than the blocks the requests need in all.
        assert sched.stats.num_preemptions <= sum(kv.blocks_needed(r.num_prompt_tokens + r.max_tokens)
                                                  for r, _ in reqs), seed


def test_check_stop_precedence():
    """On one token: stop token, then EOS, then length (stop strings, checked on the text by the
    engine, outrank all three)."""
    def last(token, **kw):
        r = Request("x", [1, 2], SamplingParams(max_tokens=3, **kw), 3, {7})
        r.token_ids += [5, 6, token]  # the third output token reaches max_tokens
        r.check_stop(max_model_len=100)
        return r.status, r.stop_reason

    assert last(9) == (RequestStatus.FINISHED_LENGTH, None)
    assert last(7) == (RequestStatus.FINISHED_STOPPED, None)                       # EOS over length
    assert last(7, ignore_eos=True) == (RequestStatus.FINISHED_LENGTH, None)
    assert last(7, stop_token_ids=[7]) == (RequestStatus.FINISHED_STOPPED, 7)      # stop token over EOS
    assert last(9, stop_token_ids=[9]) == (RequestStatus.FINISHED_STOPPED, 9)      # stop token over length


def _policy_run(shorts_every: int, depth: int, short_len: int = 20):
    """8 streams decode; a 1200-token prompt arrives, then short prompts (one after 5 batches, and
    three every ``shorts_every`` batches). Checks every micro-batch as it is scheduled and returns
    (per request: the batches after which it got tokens, the long prompt's chunks, steps)."""
    budget, bs = 64, 16
    kv = KVCacheManager(600, bs)
    sched = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=budget, max_model_len=2048, depth=depth)
    workers = SimWorkers(kv)
    rng = random.Random(7)
    toks = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    streams = [Request(f"s{i}", toks(8), sp(500), 500, set(), arrival=float(i)) for i in range(8)]
    for r in streams:
        sched.add_request(r)
    inflight: list = []
    token_steps: dict[str, list[int]] = {}
    step = 0

    def one_step():
        """Fill the pipeline (checking each new batch), apply the oldest batch."""
        nonlocal step
        while len(inflight) < depth:
            decoding = [r for r in sched.running if r.num_tokens - r.num_computed_tokens == 1]
            ready = {r.req_id for r in decoding if not r.in_flight}
            b = sched.schedule()
            if b is None:
                break
            chunks = b.chunks
            dec = [c for c in chunks if c.req_id in ready]
            assert b.num_tokens <= budget
            # decodes first: the batch's share of the ready decodes is in, listed first, and the
            # prefill chunks take only what the decodes leave of the budget
            assert len(dec) >= min(len(ready), -(-len(decoding) // depth)), (len(dec), ready, decoding)
            assert chunks[:len(dec)] == dec
            assert sum(c.num_tokens for c in chunks[len(dec):]) <= budget - len(dec)
            inflight.append(b)
        b = inflight.pop(0)
        for r, _, tok in sched.update(b, workers.run(b.batch)):
            if tok >= 0:
                token_steps.setdefault(r.req_id, []).append(step)
        sched.release_finished(list(b.reqs))
        step += 1
        return b

    while any(len(r.output_token_ids) < 3 for r in streams):
        one_step()
    long = Request("long", toks(1200), sp(2), 2, set(), arrival=100.0)
    sched.add_request(long)
    t_long = step
    shorts = {}
    long_chunks = []  # (chunk tokens, decodes in its batch, other prefill tokens in its batch)
    while "long" not in token_steps:
        if step == t_long + 5 or (shorts_every and step > t_long and step % shorts_every == 0):
            for j in range(1 if step == t_long + 5 else 3):
                n_out = 30 if step == t_long + 5 else 2
                r = Request(f"short{step}.{j}", toks(short_len), sp(n_out), n_out, set(), arrival=100.0 + step)
                sched.add_request(r)
                shorts[r.req_id] = (step, r)
        b = one_step()
        for c in b.chunks:
            if c.req_id == "long":
                n_dec = sum(1 for c2 in b.chunks if c2.req_id.startswith("s") and c2.num_tokens == 1
                            and c2.start >= 8)
                long_chunks.append((c.num_tokens, n_dec, b.num_tokens - c.num_tokens - n_dec))
    assert sum(n for n, _, _ in long_chunks) == 1200
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 1)
    return token_steps, shorts, long_chunks, t_long, budget, depth


@pytest.mark.parametrize("short_len", [20, 50])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_chunked_prefill_decodes_first_and_short_prompt_not_starved(depth, short_len):
    """vLLM's chunked-prefill policy plus fairness between prefills (issue 12, item 7): while a
    long prompt is prefilled in chunks, every micro-batch takes its share of the running decodes
    first and the chunk only what remains of the budget, so each stream gets a token every
    ``depth`` batches (also a stream newer than the long prompt); the long prompt's chunks are
    pipelined (one enters each micro-batch); a short prompt sent meanwhile gets its first token
    from the next micro-batches, not after the long prompt's last chunk."""
    token_steps, shorts, long_chunks, t_long, budget, depth = _policy_run(0, depth, short_len)
    t_done = token_steps["long"][0]
    assert t_done - t_long > 20  # 1200 tokens at < 64 per batch
    # its chunks follow each other down the pipeline: one per batch, not one per depth batches
    assert t_done - t_long <= len(long_chunks) + depth, (t_done - t_long, len(long_chunks))
    for i in range(8):
        during = [s for s in token_steps[f"s{i}"] if t_long <= s <= t_done]
        assert max(b - a for a, b in zip(during, during[1:])) <= depth, (i, during)
    (sent, short), = shorts.values()
    # its prefill ran in the next batches (in two chunks when it needs more than half the room)
    assert token_steps[short.req_id][0] - sent <= depth + 1 + (short_len > 30), (token_steps[short.req_id], sent)
    # and then it decodes like the other streams, although it is newer than the long prompt (its
    # first decode may wait for a micro-batch with room among the decodes: at most 2 x depth)
    during = [s for s in token_steps[short.req_id] if s <= t_done]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) >= 4 and gaps[0] <= 2 * depth and max(gaps[1:]) <= depth, during
    # the long prompt's chunks took all that the decodes (and the short prompt) left
    for n, n_dec, other in long_chunks[:-1]:
        assert n == budget - n_dec - other, long_chunks


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_long_prompt_keeps_half_while_short_prompts_arrive(depth):
    """Short prompts arriving faster than they can be served do not starve a long prefill: each
    of its chunks gets at least half of what the decodes leave."""
    token_steps, shorts, long_chunks, t_long, budget, depth = _policy_run(1, depth)
    assert len(shorts) > 10
    for n, n_dec, other in long_chunks[:-1]:
        assert n >= (budget - n_dec) // 2, long_chunks
    assert any(other for _, _, other in long_chunks)  # short prompts did share its batches
    assert sum(1 for rid in shorts if rid in token_steps) > 10  # and shorts were served meanwhile


@pytest.mark.parametrize("depth", [1, 2])
def test_attention_budget_shrinks_chunks_at_long_context_only(depth):
    """``prefill_attention_budget`` (issue 12, item 7): a prompt chunk's query-key pairs stay within
    the budget, so chunks keep the whole token budget at short contexts and shrink as the context
    grows; decodes are never cut; the long prompt still finishes with the right output; with a
    budget smaller than one token's pairs the oldest prompt still gets a token per batch; with no
    stream decoding, a prompt alone keeps full chunks."""
    from zpp.engine.step_cost import tokens_within_pairs as _tokens_within_pairs
    for start in (0, 1, 7, 100, 2047, 6000):
        for pairs in (0, 1, 5, 1000, 65536):
            c = _tokens_within_pairs(start, pairs)
            assert c * start + c * (c + 1) // 2 <= pairs < (c + 1) * start + (c + 1) * (c + 2) // 2
    alone = Scheduler(KVCacheManager(200, 16), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=2048,
                      depth=depth, prefill_attention_budget=10)
    lone = Request("lone", list(range(10, 910)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), 1,
                   set(), arrival=0.0)
    alone.add_request(lone)
    assert drive(alone, SimWorkers(alone.kv), depth) <= -(-900 // 32) + depth
    assert lone.output_token_ids == expected_output(lone.prompt_token_ids, 1)
    for budget_pairs, floor_only in ((32 * 256, False), (10, True)):
        bs = 16
        kv = KVCacheManager(200, bs)
        sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=32, max_model_len=2048, depth=depth,
                          prefill_attention_budget=budget_pairs)
        sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        streams = [Request(f"s{i}", list(range(10 + i, 18 + i)), sp(400), 400, set(), arrival=float(i))
                   for i in range(4)]
        long = Request("long", [(7 * i) % 900 + 10 for i in range(900 if not floor_only else 60)], sp(2), 2,
                       set(), arrival=10.0)
        for r in streams + [long]:
            sched.add_request(r)
        workers = SimWorkers(kv)
        inflight, chunks = [], []
        while not long.status.finished:
            while len(inflight) < depth:
                b = sched.schedule()
                if b is None:
                    break
                n_dec = sum(1 for c in b.chunks if c.num_tokens == 1 and c.req_id != "long")
                for c in b.chunks:
                    if c.req_id == "long" and not c.sample or (c.req_id == "long" and c.start < len(long.prompt_token_ids)):
                        chunks.append((c.start, c.num_tokens, n_dec))
                inflight.append(b)
            b = inflight.pop(0)
            sched.release_finished([r for r, _, _ in sched.update(b, workers.run(b.batch))])
        assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)
        assert sum(n for _, n, _ in chunks) == len(long.prompt_token_ids)
        for start, n, n_dec in chunks:
            assert n == 1 or not n_dec or n * start + n * (n + 1) // 2 <= budget_pairs, (start, n)
        # the streams kept decoding next to it (about a token every depth batches, after their prefill)
        assert all(len(r.output_token_ids) >= len(chunks) // depth - 8 for r in streams), \
            ([len(r.output_token_ids) for r in streams], len(chunks))
        if floor_only:
            assert all(n == 1 for s, n, _ in chunks if s >= 10), chunks  # one token per batch, never zero
            continue
        # full token budget (32 minus the decodes) while the context is short; small chunks late
        assert max(n for s, n, _ in chunks if s < 200) >= 32 - 4
        assert max(n for s, n, _ in chunks if s > 800) <= 10


def test_burst_arriving_behind_a_batch_in_flight_is_split_over_the_pipeline():
    """HTTP clients' prompts arrive one by one: the first is scheduled alone, the other 31 arrive
    while it is in flight. They must be spread over the two micro-batches (each ~half of all prompt
    tokens), not put in one micro-batch that crosses the stages alone; and the split counts what
    is in flight, so it is not halved again and again."""
    kv = KVCacheManager(1000, 16)
    sched = Scheduler(kv, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, depth=2)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = random.Random(3)
    mk = lambda i: Request(f"r{i}", [rng.randrange(10, 1000) for _ in range(64)], sp, 4, set(), arrival=float(i))
    sched.add_request(mk(0))
    first = sched.schedule()
    assert first.num_tokens == 64  # alone: nothing to share with
    for i in range(1, 32):
        sched.add_request(mk(i))
    second = sched.schedule()
    total = 32 * 64
    assert abs(second.num_tokens - total // 2) <= 64, second.num_tokens
    workers = SimWorkers(kv)
    sched.update(first, workers.run(first.batch))
    third = sched.schedule()  # depth 2: the next micro-batch once the first returns
    # The rest of the burst goes in the next micro-batch: two parts, not 1024 + 512 + 256 + ...
    assert second.num_tokens + third.num_tokens - 1 == 31 * 64, (second.num_tokens, third.num_tokens)
