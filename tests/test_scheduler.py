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
    """Mirrors what the workers keep (token lists, block tables) and checks every batch against it."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.state: dict[str, tuple[list[int], list[int]]] = {}

    def run(self, batch: m.ExecuteBatch) -> m.StepResult:
        for rid in batch.finished_req_ids:
            self.state.pop(rid, None)
        for r in batch.new_reqs:
            self.state[r.req_id] = (list(r.token_ids), list(r.block_ids))
        for c in batch.cached_reqs:
            toks, blocks = self.state[c.req_id]
            toks.extend(c.new_token_ids)
            blocks.extend(c.new_block_ids)
        sampled = []
        for c in batch.chunks:
            toks, blocks = self.state[c.req_id]
            assert c.start + c.num_tokens <= len(toks)
            assert len(blocks) * self.kv.block_size >= c.start + c.num_tokens, "KV slots missing"
            if c.sample:
                assert c.start + c.num_tokens == len(toks)
                sampled.append(m.SampledOutput(c.req_id, fake_token(toks)))
        return m.StepResult(batch.batch_id, sampled)


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks))
    return toks[len(prompt):]


def drive(sched: Scheduler, workers: SimWorkers, depth: int, max_steps: int = 100000):
    inflight = []
    steps = 0
    while sched.has_work() or inflight:
        while len(inflight) < depth:
            b = sched.schedule()
            if b is None:
                break
            # a request is in at most one in-flight batch
            ids = [r.req_id for b2 in inflight for r in b2.reqs]
            assert not set(ids) & {r.req_id for r in b.reqs}
            assert b.num_tokens <= sched.max_num_batched_tokens
            inflight.append(b)
        assert inflight, "livelock: work left but nothing schedulable"
        b = inflight.pop(0)
        res = workers.run(b.batch)
        updates = sched.update(b, res)
        sched.release_finished([r for r, _ in updates])
        steps += 1
        assert steps < max_steps
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
    drive(sched, SimWorkers(kv), depth)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 60)
    assert kv.num_free_blocks == num_blocks, "blocks leaked"
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
    sched.update(b, m.StepResult(b.batch.batch_id, [m.SampledOutput("a", 5)]))
    assert kv.num_free_blocks == 20
    b2 = sched.schedule()
    assert b2 is None and sched._finished_ids == ["a"]


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


def test_kv_refuses_without_side_effects():
    kv = KVCacheManager(4, 16)
    r = Request("x", list(range(70)), SamplingParams(), 1, set())
    assert kv.allocate_slots(r, 70) is None
    assert kv.num_free_blocks == 4 and kv.blocks_of(r) == []
