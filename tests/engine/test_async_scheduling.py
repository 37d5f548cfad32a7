"""Async scheduling (the engine schedules a request's next decode before its sampled token is
back; the worker feeds that token from the device): outputs equal synchronous scheduling token for
token, on the CPU (turned on explicitly there) with the real demo model, for every sampling mode;
and the scheduler's bookkeeping on its own."""
from __future__ import annotations

import pytest

from helpers import ROOT
from zpp import LLM, SamplingParams
from zpp.engine.kv_cache_manager import KVCacheManager
from zpp.engine.request import Request
from zpp.engine.scheduler import Scheduler
from zpp.transport import messages as m


def _count_async_chunks(llm) -> list[int]:
    """Wrap the engine's scheduler so that the returned list's one entry counts ``from_prev``
    chunks scheduled from now on."""
    sched = llm.engine.scheduler
    counter = [0]
    orig = sched.schedule

    def schedule():
        out = orig()
        if out is not None:
            counter[0] += sum(1 for c in out.chunks if c.from_prev)
        return out

    sched.schedule = schedule
    return counter


# --- end to end on the CPU ------------------------------------------------------------------------

def _run(model, prompts, params, async_on: bool, **kw):
    with LLM(model, device="cpu", async_scheduling=async_on, **kw) as llm:
        n_async = _count_async_chunks(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks, "blocks leaked"
    return outs, n_async[0]


@pytest.mark.slow
def test_async_equals_sync_every_sampling_mode(demo_model, tokenizer):
    """One batch mixing greedy (EOS allowed, so some stop early and drop their extra step),
    max_tokens 1 and 2, logprobs, seeded temperature / top-k / top-p / min-p, min_tokens,
    penalties (which fall back to synchronous steps), stop token ids and stop strings: the same
    tokens, logprobs and finish reasons with async scheduling on and off."""
    texts = ["The capital of France is", "Once upon a time", "List three colors:", "1, 2, 3, 4,",
             "def fibonacci(n):", "Hello! How are you", "The quick brown fox", "Water boils at"]
    prompts = [tokenizer.encode(t) for t in texts]
    params = [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=2, logprobs=3),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=24, logprobs=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=24, min_tokens=12),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=30, stop=[" the"], stop_token_ids=[13]),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, presence_penalty=0.4),
    ]
    sync, n0 = _run(demo_model, prompts, params, False)
    asyn, n1 = _run(demo_model, prompts, params, True)
    assert n0 == 0 and n1 > 0, "async scheduling did not run"
    for i, (a, b) in enumerate(zip(sync, asyn)):
        oa, ob = a.outputs[0], b.outputs[0]
        assert ob.token_ids == oa.token_ids, f"request {i}: tokens differ"
        assert ob.text == oa.text and ob.finish_reason == oa.finish_reason, f"request {i}"
        if oa.logprobs is not None:
            assert [sorted(d) for d in ob.logprobs] == [sorted(d) for d in oa.logprobs], f"request {i}"


@pytest.mark.slow
def test_async_equals_sync_with_n_preemption_and_chunked_prefill(tiny_llama, tokenizer):
    """n > 1 with seeds, a prompt longer than the token budget (chunked prefill), and a KV cache
    small enough to preempt: the same outputs either way (on the session's tiny random-weight
    Llama: only the scheduling differs between the two runs)."""
    prompts = [tokenizer.encode("alpha bravo charlie delta echo " * k) for k in (1, 2, 9, 3)]
    params = [SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)]
    kw = dict(num_kv_blocks=12, block_size=16, max_num_batched_tokens=32)
    sync, _ = _run(tiny_llama, prompts, params, False, **kw)
    asyn, n1 = _run(tiny_llama, prompts, params, True, **kw)
    assert n1 > 0
    for a, b in zip(sync, asyn):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]


# --- scheduler only -------------------------------------------------------------------------------

def _req(rid: str, n_prompt: int, max_tokens: int, **sp) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(temperature=0, max_tokens=max_tokens, **sp),
                   max_tokens, {0})


def _result(sched, tokens: dict[str, int]) -> m.StepResult:
    return m.StepResult(sched.batch.batch_id, m.pack_int32([tokens[c.req_id] for c in sched.chunks if c.sample]))


def test_scheduler_async_decode_while_in_flight():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, 8, 64, 256, depth=1, async_scheduling=True)
    a, p = _req("a", 5, 3), _req("p", 5, 10, repetition_penalty=1.2)
    s.add_request(a)
    s.add_request(p)
    b0 = s.schedule()  # both prompts, each sampling its first token
    assert [(c.req_id, c.start, c.num_tokens, c.sample, c.from_prev) for c in b0.chunks] == \
        [("a", 0, 5, True, False), ("p", 0, 5, True, False)]
    b1 = s.schedule()  # "a" again at once, for position 5, whose token is still in flight; "p" waits
    assert [(c.req_id, c.start, c.num_tokens, c.sample, c.from_prev) for c in b1.chunks] == \
        [("a", 5, 1, True, True)]
    b2 = s.schedule()  # and again (the engine's depth bounds this): position 6, sampled by b1
    assert [(c.req_id, c.start, c.from_prev) for c in b2.chunks] == [("a", 6, True)]
    assert s.schedule() is None  # b2 samples "a"'s third and last token (max_tokens 3): no extra step
    s.update(b0, _result(b0, {"a": 50, "p": 60}))
    assert a.token_ids[5:] == [50] and a.num_computed_tokens == 5
    b3 = s.schedule()  # "p" synchronously (penalties), with its first token
    assert {c.req_id: (c.start, c.from_prev) for c in b3.chunks} == {"p": (5, False)}
    assert [c.new_token_ids for c in b3.chunks] == [[60]]
    s.update(b1, _result(b1, {"a": 51}))
    out = s.update(b2, _result(b2, {"a": 52}))
    assert a.token_ids[5:] == [50, 51, 52] and a.status.finished
    s.release_finished([r for r, _, _ in out])
    assert "a" not in s.requests


def test_scheduler_async_drops_the_step_after_a_stop():
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, 8, 64, 256, depth=1, async_scheduling=True)
    a = _req("a", 3, 50)
    s.add_request(a)
    b0 = s.schedule()
    b1 = s.schedule()
    assert b1.chunks[0].from_prev
    out = s.update(b0, _result(b0, {"a": 0}))  # EOS: finished while b1 is in flight
    assert a.status.finished
    s.release_finished([r for r, _, _ in out])
    assert kv.num_free_blocks < 16, "freed while a micro-batch in flight still writes its blocks"
    assert s.update(b1, _result(b1, {"a": 9})) == []  # the extra step's token is dropped
    assert a.token_ids == [1, 2, 3, 0] and kv.num_free_blocks == 16 and not s.has_work()


def test_scheduler_async_every_request_in_every_batch():
    """Async at depth 2: once the prompts are done, every decoding request is in every
    micro-batch (synchronous: half of them in each, as each waits for its token)."""
    for async_on, want in ((False, 3), (True, 6)):
        kv = KVCacheManager(256, 16)
        s = Scheduler(kv, 16, 512, 2048, depth=2, async_scheduling=async_on)
        reqs = [_req(str(i), 4, 100) for i in range(6)]
        for r in reqs:
            s.add_request(r)
        inflight, sizes = [], []
        for _ in range(12):  # the engine's loop: keep 2 in flight, apply the oldest
            while len(inflight) < 2 and (b := s.schedule()) is not None:
                inflight.append(b)
                sizes.append(sum(1 for c in b.chunks if c.num_tokens == 1 and c.start >= 4))
            b = inflight.pop(0)
            s.update(b, _result(b, {c.req_id: 7 for c in b.chunks if c.sample}))
        assert sizes[-4:] == [want] * 4, sizes


def test_config_default_and_refusal(monkeypatch):
    """Default: on for CUDA at PP=1 / TP=1 only (the CPU here); forced on with PP > 1: refused
    before anything starts; ``ZPP_ASYNC_SCHEDULING`` overrides the default only."""
    import os

    from zpp.config import ConfigError, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    model = ModelConfig(os.path.join(ROOT, "scripts", "configs", "smollm2-135m"))
    monkeypatch.delenv("ZPP_ASYNC_SCHEDULING", raising=False)
    cpu = EngineConfig(model)
    assert not cpu.async_scheduling and cpu.pipeline_depth == 1
    forced = EngineConfig(model, scheduler=SchedulerConfig(async_scheduling=True))
    assert forced.async_scheduling and forced.pipeline_depth == 2
    pp2 = EngineConfig(model, parallel=ParallelConfig(pipeline_parallel_size=2))
    assert not pp2.async_scheduling
    with pytest.raises(ConfigError, match="--async-scheduling needs"):
        EngineConfig(model, parallel=ParallelConfig(pipeline_parallel_size=2),
                     scheduler=SchedulerConfig(async_scheduling=True)).validate()
    monkeypatch.setenv("ZPP_ASYNC_SCHEDULING", "1")
    assert EngineConfig(model).async_scheduling and not pp2.async_scheduling
    assert not EngineConfig(model, scheduler=SchedulerConfig(async_scheduling=False)).async_scheduling
