"""Scheduler features: preemption, chunked prefill, seeded sampling, prefix caching, request limits.
Outputs are compared with the same request run alone / at PP=1. Where only the engine is under test
(zpp against zpp) the model is the session's tiny random-weight Llama (``tiny_llama``: SmolLM2's
tokenizer, 4 layers); where the text matters (stop strings, chat, EOS, the HF prompt logprobs) it
is the real SmolLM2."""
from __future__ import annotations

import asyncio

import pytest

from zpp import LLM, SamplingParams
from zpp.errors import RequestError, SamplingParamsError

pytestmark = pytest.mark.slow

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _prompt(tokenizer, i: int, n_words: int) -> list[int]:
    return tokenizer.encode(" ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words)))


async def _stream_checked(engine, prompt, sp):
    """Consume a request's stream; assert no token is ever delivered twice or taken back."""
    prev: list[int] = []
    final = None
    async for out in engine.generate(prompt, sp):
        ids = out.outputs[0].token_ids
        assert ids[: len(prev)] == prev, "stream changed tokens it already delivered"
        prev = list(ids)
        final = out
    return final


# --- tests that need an engine of their own (its preemption count, free blocks, settings) ---------
@pytest.mark.parametrize("pp", [1, 2])
def test_preemption_keeps_outputs(tiny_llama, tokenizer, pp):
    """Four 20-token prompts, 30 tokens each: 4 blocks a request, 16 for all four in a cache of 8,
    so some are preempted (at the latest when their third block is due, token 33) and recomputed,
    then decode on for over a dozen tokens."""
    prompts = [_prompt(tokenizer, i * 3, 18)[:20] for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_llama, pipeline_parallel_size=pp, num_kv_blocks=8, block_size=16) as llm:
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
        engine = llm.engine
        before = engine.scheduler.stats.num_preemptions

        async def together():
            return await asyncio.gather(*(_stream_checked(engine, p, sp) for p in prompts))

        outs = llm._call(together())
        assert engine.scheduler.stats.num_preemptions > before, "the test did not force preemption"
        assert engine.kv.num_free_blocks == 8
    for i, o in enumerate(outs):
        assert len(o.outputs[0].token_ids) == 30
        assert o.outputs[0].token_ids == alone[i], f"request {i} changed by preemption"


def test_preemption_forward_progress_pp2_case(tiny_llama):
    """shared/cases/preemption-livelock-pp.md, scaled down (6 blocks, 58 tokens; the same stall
    in the earlier scheduler): two requests start, two more join while the first two micro-batches
    are in flight. Every request finishes with the tokens it gets alone, with few preemptions.
    On the session's tiny Llama: the scheduler before babbbe9 (ededb62) piles up preemptions past
    the bound here too (44 and 45 in two runs; the current one: 6)."""
    prompts = [f"Story number {k}: Once upon a time" for k in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=58, ignore_eos=True)
    with LLM(tiny_llama, pipeline_parallel_size=2, num_kv_blocks=6, block_size=16,
             max_num_batched_tokens=32) as llm:
        engine = llm.engine
        alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
        before = engine.scheduler.stats.num_preemptions

        async def together():
            async def one(p):
                out = None
                async for out in engine.generate(p, sp, stream=False):
                    pass
                return out.outputs[0].token_ids

            tasks = [asyncio.create_task(one(p)) for p in prompts[:2]]
            while len(engine.core.inflight) < 2:  # both first micro-batches in flight, none returned
                await asyncio.sleep(0.001)
            tasks += [asyncio.create_task(one(p)) for p in prompts[2:]]
            try:
                while not all(t.done() for t in tasks):
                    # A livelock shows as preemptions piling up (the old policy: hundreds): fail, never hang.
                    assert engine.scheduler.stats.num_preemptions - before <= 40, "requests keep preempting each other"
                    await asyncio.sleep(0.05)
                return [t.result() for t in tasks]
            finally:
                for t in tasks:
                    t.cancel()

        outs = llm._call(together())
        assert engine.kv.num_free_blocks == 6
    assert outs == alone


def _prompt_logprob_runs(llm, p48: list[int], x25: list[int], other: list[int]) -> dict:
    """The prefix-cache paths of shared/cases/prefix-cache-prompt-logprobs.md, in order: a first
    request (fills the cache), the same again (full hit), a partial hit, hits ending at a block
    boundary, then a preemption: ``other`` (older, long) forces the newest request out and back."""
    plp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for name, prompt in [("first", p48), ("full_hit", p48), ("partial_hit", p48[:40] + x25),
                         ("boundary_32", p48[:32]), ("boundary_33", p48[:33])]:
        runs[name] = llm.generate([prompt], plp)[0]
    hits = llm.engine.kv.prefix_hits
    runs["plain"] = llm.generate([p48], SamplingParams(temperature=0, max_tokens=1))[0]
    runs["plain_hit_tokens"] = llm.engine.kv.prefix_hits - hits
    engine = llm.engine
    before = engine.scheduler.stats.num_preemptions

    async def preempted():
        async def one(p, sp):
            out = None
            async for out in engine.generate(p, sp, stream=False):
                pass
            return out

        a = asyncio.create_task(one(other, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)  # ``other`` arrives first
        b = asyncio.create_task(one(p48, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        prompt_logprobs=1, logprobs=1)))
        return await a, await b

    runs["other"], runs["after_preemption"] = llm._call(preempted())
    runs["preemptions"] = engine.scheduler.stats.num_preemptions - before
    return runs


def test_prompt_logprobs_never_from_prefix_cache(tiny_llama, tokenizer, monkeypatch):
    """Prompt logprobs (and echo + logprobs, which the server maps to them) on every prefix-cache
    path equal those with prefix caching off: a request that must score prompt positions does not
    reuse cached blocks (cached blocks hold KV, not logits). Chunked prefill (budget 20) everywhere."""
    p48 = _prompt(tokenizer, 1, 60)[:48]
    x25 = _prompt(tokenizer, 11, 30)[:25]
    other = _prompt(tokenizer, 17, 60)[:48]
    assert len(p48) == 48 and len(x25) == 25 and len(other) == 48
    kw = dict(pipeline_parallel_size=2, block_size=16, num_kv_blocks=6, max_num_batched_tokens=20)
    with LLM(tiny_llama, **kw) as llm:
        off = _prompt_logprob_runs(llm, p48, x25, other)
    with LLM(tiny_llama, enable_prefix_caching=True, **kw) as llm:
        on = _prompt_logprob_runs(llm, p48, x25, other)
        # Were the rule broken, the request would fail, never answer null.
        from zpp.engine.request import Request
        monkeypatch.setattr(Request, "skip_prefix_cache", property(lambda self: False))
        with pytest.raises(RuntimeError, match="prompt logprobs were not computed"):
            llm.generate([p48], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
        monkeypatch.undo()
        assert llm.generate([p48], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids
    assert on["plain_hit_tokens"] == 32, "the cache did not hold the prompt: the hits were not exercised"
    assert on["preemptions"] > 0 and off["preemptions"] > 0, "the last request was not preempted"
    for name in ("first", "full_hit", "partial_hit", "boundary_32", "boundary_33", "after_preemption"):
        a, b = off[name], on[name]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
        assert b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == len(b.prompt_token_ids), name
        for j in range(1, len(b.prompt_token_ids)):
            assert b.prompt_logprobs[j] is not None, f"{name}: position {j} is null"
            assert b.prompt_logprobs[j].keys() == a.prompt_logprobs[j].keys(), (name, j)
            for t, v in a.prompt_logprobs[j].items():
                assert b.prompt_logprobs[j][t].logprob == pytest.approx(v.logprob, abs=1e-4), (name, j)
    assert on["other"].outputs[0].token_ids == off["other"].outputs[0].token_ids
    # The same prompt scores the same whatever path it took.
    for name in ("full_hit", "after_preemption"):
        for j in range(1, 48):
            t = p48[j]
            assert on[name].prompt_logprobs[j][t].logprob == pytest.approx(on["first"].prompt_logprobs[j][t].logprob,
                                                                           abs=1e-4)


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_below_1_is_a_value_error(value):
    """``SamplingParams(max_tokens=0)`` (or less) raises ValueError naming the field, as vLLM's
    does (it was accepted and gave an empty output); 1 and None (the room left) are accepted."""
    with pytest.raises(ValueError) as e:
        SamplingParams(max_tokens=value)
    assert isinstance(e.value, SamplingParamsError) and e.value.param == "max_tokens"
    assert str(e.value) == f"max_tokens must be at least 1, got {value}"
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        SamplingParams().clone(max_tokens=0)
    assert SamplingParams(max_tokens=1).max_tokens == 1 and SamplingParams(max_tokens=None).max_tokens is None


def test_limits_and_invalid_params(tiny_llama):
    with LLM(tiny_llama, max_model_len=64, kv_cache_memory="32MiB") as llm:
        cases = [
            ([], SamplingParams(), "empty"),
            ([1] * 64, SamplingParams(max_tokens=1), "64 tokens"),
            ([1] * 40, SamplingParams(max_tokens=30), "70"),
            ([1, 49152], SamplingParams(), "49152"),
            ([-1], SamplingParams(), "-1"),
        ]
        for prompt, sp, needle in cases:
            with pytest.raises(RequestError) as e:
                llm.generate([prompt], sp)
            assert needle in str(e.value)
        for kwargs, param in [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
                              ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k"),
                              ({"min_p": 2.0}, "min_p"), ({"max_tokens": -1}, "max_tokens"),
                              ({"repetition_penalty": 0.0}, "repetition_penalty"),
                              ({"presence_penalty": 3.0}, "presence_penalty"),
                              ({"logprobs": 50}, "logprobs"), ({"stop": [""]}, "stop"),
                              ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]:
            with pytest.raises(SamplingParamsError) as e:
                SamplingParams(**kwargs)
            assert e.value.param == param
        # max_tokens omitted -> the remaining room
        out = llm.generate([[1] * 60], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 4
        # still serving
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 3


def test_prompt_logprobs_match_hf_with_chunking(demo_model, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.")
    hf = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    with LLM(demo_model, pipeline_parallel_size=2, max_num_batched_tokens=8, kv_cache_memory="32MiB") as llm:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        assert ids[j] in plp[j]
        assert plp[j][ids[j]].logprob == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-3)
        top3 = ref[j - 1].topk(3).indices.tolist()
        assert all(t in plp[j] for t in top3)


# --- tests on shared engines -------------------------------------------------------------------
class _Engines:
    """Engines shared by the tests of this module that need no fresh one: ``get(**settings)`` returns
    the engine started with those settings, starting it if needed. At most two stay up (the least
    recently used is shut down first), so tests that use the same settings come one after another.
    Tests that count on a fresh engine's state (preemption counts, free blocks) use settings no
    other test uses."""

    def __init__(self, model: str, keep: int = 2):
        self.model, self.keep = model, keep
        self.live: dict[tuple, LLM] = {}

    def get(self, **settings) -> LLM:
        key = tuple(sorted(settings.items()))
        llm = self.live.pop(key, None)
        if llm is None:
            while len(self.live) >= self.keep:
                self.live.pop(next(iter(self.live))).shutdown()
            llm = LLM(self.model, **settings)
        self.live[key] = llm  # most recently used last
        return llm

    def close(self) -> None:
        while self.live:
            self.live.popitem()[1].shutdown()


@pytest.fixture(scope="module")
def engines(demo_model):
    """Shared engines on the real SmolLM2 (tests whose checks need real text)."""
    e = _Engines(demo_model)
    yield e
    e.close()


@pytest.fixture(scope="module")
def tiny_engines(tiny_llama):
    """Shared engines on the tiny random-weight Llama (tests of the scheduler alone)."""
    e = _Engines(tiny_llama)
    yield e
    e.close()


# The shared engines. PP=1 without chunked prefill: each prompt computed in one step (the reference
# of the chunked-prefill test; the other tests' prompts are far below the budget either way).
PP1 = dict(pipeline_parallel_size=1, enable_chunked_prefill=False, kv_cache_memory="128MiB")
# PP=2 with a small token budget (the CPU server's until issue 28): prompts of more than 32 tokens are chunked.
PP2 = dict(pipeline_parallel_size=2, max_num_batched_tokens=32, kv_cache_memory="128MiB")


def test_stop_string_spanning_tokens_and_n(engines, tokenizer):
    prompt = "Once upon a time"
    llm = engines.get(**PP1)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    text, toks = full.outputs[0].text, full.outputs[0].token_ids
    pieces = [tokenizer.decode(toks[:k]) for k in range(len(toks) + 1)]
    # a stop string that starts inside one token and ends inside a later one
    bounds = {len(p) for p in pieces}
    cut = next(c for c in range(1, len(text) - 4) if c not in bounds and c + 4 not in bounds
               and any(c < b < c + 4 for b in bounds) and text.find(text[c:c + 4]) == c)
    stop = text[cut:cut + 4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == text[:text.find(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    multi = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1


def test_llm_chat(engines, tokenizer):
    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a color."}]]
    sp = SamplingParams(temperature=0, max_tokens=20)
    llm = engines.get(**PP1)
    outs = llm.chat(convs, sp)
    ids = tokenizer.apply_chat_template(convs[1], add_generation_prompt=True, tokenize=False)
    ref = llm.generate([tokenizer.encode(ids, add_special_tokens=False)], sp)[0]
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].prompt_token_ids == ref.prompt_token_ids
    assert outs[1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert outs[1].prompt == ids  # as vLLM: the rendered conversation


def test_chunked_prefill_long_prompt(tiny_engines, tokenizer):
    """A 300-token prompt chunked 32 tokens at a time at PP=2 while three short requests decode:
    the same tokens as each computed in one step at PP=1 (no chunked prefill), and the short
    requests make progress during the long prefill."""
    long_prompt = _prompt(tokenizer, 0, 160)[:300]
    assert len(long_prompt) >= 280
    shorts = [_prompt(tokenizer, i, 4) for i in (5, 9, 13)]
    sp_long = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sp_short = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engines = tiny_engines
    llm = engines.get(**PP1)
    assert not llm.engine.scheduler.chunked
    ref_long = llm.generate([long_prompt], sp_long)[0].outputs[0].token_ids
    ref_short = [o.outputs[0].token_ids for o in llm.generate(shorts, sp_short)]

    llm = engines.get(**PP2)
    engine = llm.engine
    progress_at_first_long_token: list[int] = []

    async def run():
        short_tasks = []
        counts = [0, 0, 0]

        async def short(i):
            out = None
            async for out in engine.generate(shorts[i], sp_short):
                counts[i] = len(out.outputs[0].token_ids)
            return out.outputs[0].token_ids

        for i in range(3):
            short_tasks.append(asyncio.create_task(short(i)))
        while min(counts) < 1:
            await asyncio.sleep(0.001)
        long_out = None
        async for out in engine.generate(long_prompt, sp_long):
            if not progress_at_first_long_token and out.outputs[0].token_ids:
                progress_at_first_long_token.extend(counts)
            long_out = out
        return long_out.outputs[0].token_ids, await asyncio.gather(*short_tasks), list(counts)

    got_long, got_short, _ = llm._call(run())
    assert got_long == ref_long
    assert got_short == ref_short
    # 300 tokens at 32 per batch take ~10 batches; the short requests decode during them.
    assert min(progress_at_first_long_token) >= 5, progress_at_first_long_token


def test_seeded_sampling_same_at_any_pp_and_batch(tiny_engines, tokenizer):
    prompts = [_prompt(tokenizer, i, 6) for i in range(3)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    texts = {}
    for pp, settings in ((1, PP1), (2, PP2)):
        llm = tiny_engines.get(**settings)
        alone = [llm.generate([p], sp)[0].outputs[0].text for p in prompts]
        mixed = llm.generate(prompts + [_prompt(tokenizer, 20, 9)] * 3, [sp] * 3 + [noise] * 3)
        texts[pp] = (alone, [o.outputs[0].text for o in mixed[:3]])
    assert texts[1][0] == texts[1][1] == texts[2][0] == texts[2][1]
    assert len(set(texts[1][0])) == 3  # different prompts, different samples


def test_finish_precedence_on_the_same_token(engines, tokenizer):
    """Finish conditions met on one token: stop string, then stop token, then EOS, then length
    (as vLLM); the same streamed and not, with ``stop_reason`` set."""
    prompt = "Once upon a time"
    llm = engines.get(**PP2)
    engine = llm.engine

    def both(p, sp):
        """(final non-streamed output, final streamed output, concatenated streamed text)."""
        async def streamed():
            sent, final = "", None
            async for out in engine.generate(p, sp):
                t = out.outputs[0].text
                assert t.startswith(sent), "streamed text taken back"
                sent, final = t, out
            return final, sent
        return (llm.generate([p], sp)[0],) + llm._call(streamed())

    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    toks, text = full.token_ids, full.text
    pieces = [tokenizer.decode(toks[:k]) for k in range(len(toks) + 1)]
    assert all(text.startswith(p) for p in pieces)
    # A stop string that is completed by token k (first seen there), for k = max_tokens.
    k, stop = next((k, pieces[k][-4:]) for k in range(6, len(toks)) if len(pieces[k]) > len(pieces[k - 1])
                   and text.find(pieces[k][-4:]) == len(pieces[k]) - 4)
    for max_tokens in (k, k + 5):  # stop string on the length token / before it
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop=[stop])
        for o in both(prompt, sp)[:2]:
            c = o.outputs[0]
            assert (c.finish_reason, c.stop_reason) == ("stop", stop), max_tokens
            assert c.token_ids == toks[:k] and c.text == pieces[k][:-4]
        assert both(prompt, sp)[2] == pieces[k][:-4]
    # A stop token on the length token: "stop", the token id; its text is not returned.
    k = next(k for k in range(4, len(toks)) if toks[k - 1] not in toks[:k - 1])
    sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, stop_token_ids=[toks[k - 1]])
    for o in both(prompt, sp)[:2]:
        c = o.outputs[0]
        assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", toks[k - 1], toks[:k])
        assert c.text == pieces[k - 1]
    # EOS on the length token: "stop"; an EOS that is also a stop token: the stop token's id.
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(chat, add_special_tokens=False)
    ans = llm.generate([ids], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert ans.finish_reason == "stop" and ans.stop_reason is None, "the answer did not end with EOS"
    eos, n = ans.token_ids[-1], len(ans.token_ids)
    for sp, reason in [(SamplingParams(temperature=0, max_tokens=n), None),
                       (SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[eos]), eos)]:
        for o in both(ids, sp)[:2]:
            c = o.outputs[0]
            assert (c.finish_reason, c.stop_reason, c.token_ids, c.text) == ("stop", reason, ans.token_ids,
                                                                             ans.text)


def test_prefix_caching_same_output_and_hits(tiny_engines, tokenizer):
    base = _prompt(tokenizer, 2, 70)
    prompts = [base + _prompt(tokenizer, i, 3) for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = tiny_engines.get(**PP1)
    off = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    llm = tiny_engines.get(pipeline_parallel_size=2, kv_cache_memory="64MiB", enable_prefix_caching=True)
    hits = llm.engine.kv.prefix_hits
    on = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    again = llm.generate([prompts[0]], sp)[0].outputs[0].token_ids
    hits = llm.engine.kv.prefix_hits - hits
    assert on == off
    assert again == off[0]
    assert hits >= 2 * (len(base) // 16) * 16, hits
