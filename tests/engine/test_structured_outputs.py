"""Structured outputs and tool calls on the real SmolLM2 (CPU).

Offline (one engine per pipeline size, PP=1, 2, 3, all requests of a check in one generate call):
JSON-schema outputs parse and validate (nested objects, enums, arrays, numbers, required fields),
a choice returns one of the choices, a regex / EBNF output fullmatches, greedy and seeded sampling
(top-k/p, min-p) give the same tokens at every PP size, free requests next to constrained ones get
the tokens they get without them, a grammar dead end finishes with "abort", and the PP=2 engine's
tiny KV cache forces preemption (recompute) of constrained requests, which must not change them.
Compile errors, the size limit and the compile timeout are refused as RequestErrors.

Server (``zpp serve`` at PP=2 through the official ``openai`` client): ``chat.completions.parse``
with a pydantic model, ``tools`` with tool_choice "required" and a named function (non-stream and
stream), the vLLM fields on /v1/completions, and 400s naming the field for bad inputs.
"""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from zpp import LLM, SamplingParams, StructuredOutputsParams as SO
from zpp.errors import RequestError, SamplingParamsError
from zpp.server.tools import ToolStream, parse_output, parse_tools

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "city": {"type": "string", "enum": ["Paris", "London", "Rome"]}}, "required": ["name", "age", "city"]}
BOOK = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                "last": {"type": "string", "maxLength": 20}},
               "required": ["first", "last"]},
    "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, "required": ["title", "author", "year"]}
FLAG = {"type": "object", "properties": {"colors": {
    "type": "array", "items": {"type": "string", "enum": ["red", "green", "blue", "white", "yellow"]},
    "minItems": 1, "maxItems": 3}}, "required": ["colors"]}
WEATHER = {"type": "object", "properties": {
    "temperature": {"type": "number"}, "unit": {"type": "string", "enum": ["C", "F"]},
    "rain": {"type": "boolean"}}, "required": ["temperature", "unit", "rain"]}
PHONE = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
ANSWER = 'root ::= "The answer is " ("yes" | "no") "."'
SENTIMENTS = ["positive", "negative", "neutral"]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60, **kw)


# (question, sampling params, check of the output text); every check also needs finish "stop"
# unless given as a third element's "finish".
CASES = [
    ("Give me a JSON object describing a person named Anna, 31, from Paris.", _greedy(structured_outputs=SO(json=PERSON)),
     ("json", PERSON)),
    ("Describe the book 1984 by George Orwell as JSON.",
     _greedy(structured_outputs=SO(json=BOOK, disable_any_whitespace=True)), ("json", BOOK)),
    ("List the colors of the French flag as JSON.", _greedy(structured_outputs=SO(json=FLAG)), ("json", FLAG)),
    ("What is the weather in London today? Answer as JSON.",
     _greedy(structured_outputs=SO(json=WEATHER, disable_any_whitespace=True)), ("json", WEATHER)),
    ("Classify the sentiment: I love this movie!", _greedy(structured_outputs=SO(choice=SENTIMENTS)),
     ("choice", SENTIMENTS)),
    # A complete grammar ends the output even with ignore_eos.
    ("Write a phone number.", _greedy(ignore_eos=True, structured_outputs=SO(regex=PHONE)), ("regex", PHONE)),
    ("Is Paris in France?", _greedy(structured_outputs=SO(grammar=ANSWER)),
     ("regex", r"The answer is (yes|no)\.")),
    # Seeded sampling, with top-k + top-p and with min-p, constrained.
    ("Give me a JSON object describing a person named Anna, 31, from Paris.",
     SamplingParams(temperature=0.8, seed=1, top_k=40, top_p=0.95, max_tokens=60, structured_outputs=SO(json=PERSON)),
     ("json", PERSON)),
    ("What is the weather in London today? Answer as JSON.",
     SamplingParams(temperature=1.0, seed=7, min_p=0.05, max_tokens=60, structured_outputs=SO(json=WEATHER)),
     ("json", WEATHER)),
    # A dead end: after "yes" only EOS is allowed, and min_tokens suppresses it.
    ("Is Paris in France?", _greedy(min_tokens=3, structured_outputs=SO(choice=["yes", "no"])), ("abort", "yes")),
]
FREE = [("What is the capital of France?", SamplingParams(temperature=0, max_tokens=20)),
        ("Tell me a short story.", SamplingParams(temperature=0.9, seed=11, max_tokens=20)),
        ("Name three fruits.", SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=20))]
KV_BLOCKS_PP2 = 24  # the PP=2 engine's cache: far less than the batch needs, so it preempts

RESULTS: dict[int, list] = {}  # pp -> [(token ids, finish reason)] of the mixed batch


def _chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _check(text: str, finish: str, check) -> None:
    kind, arg = check
    if kind == "abort":
        assert (finish, text) == ("abort", arg)
        return
    assert finish == "stop", (finish, text)
    if kind == "json":
        jsonschema.validate(json.loads(text), arg)
    elif kind == "choice":
        assert text in arg
    else:
        assert re.fullmatch(arg, text), text


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda pp: f"pp{pp}")
def engine(request, demo_model):
    pp = request.param
    kv = {"num_kv_blocks": KV_BLOCKS_PP2} if pp == 2 else {"kv_cache_memory": "64MiB"}
    with LLM(demo_model, pipeline_parallel_size=pp, **kv) as llm:
        yield pp, llm


class _Order:
    """Records, on an in-process engine's executor, the order of micro-batches sent, token
    bitmasks sent and results taken, and checks the structured-output ordering
    (``EngineCore._apply_result``)."""

    def __init__(self, llm):
        from zpp.transport import messages as m
        self.m, self.ex, self.events = m, llm.engine.core.executor, []
        ex, ev = self.ex, self.events
        send, send_bitmask, next_result = ex.send, ex.send_grammar_bitmask, ex.next_result

        def sending(batch, grammar_rows=(), grammar_bitmask=b""):
            ev.append(("batch", batch.batch_id, m.BatchColumns(batch), list(grammar_rows), bool(grammar_bitmask)))
            return send(batch, grammar_rows, grammar_bitmask)

        def sending_bitmask(batch_id, bitmask):
            ev.append(("bitmask", batch_id, len(bitmask)))
            return send_bitmask(batch_id, bitmask)

        async def taking():
            item = await next_result()
            if isinstance(item, m.StepResult):
                ev.append(("result", item.batch_id))
            return item

        ex.send, ex.send_grammar_bitmask, ex.next_result = sending, sending_bitmask, taking
        self.store = llm.engine.core.grammars
        accept = self.store.accept_tokens

        def accepting(grammars, tokens):
            ev.append(("accept",))
            return accept(grammars, tokens)

        self.store.accept_tokens = accepting

    def close(self) -> None:
        del self.ex.send, self.ex.send_grammar_bitmask, self.ex.next_result, self.store.accept_tokens

    def check(self) -> dict:
        """Every batch with constrained rows went out without its bitmask, which followed once,
        after the results of the earlier batches that sampled those rows' sequences (by slot).
        Returns counts: constrained batches, those with a constrained FROM_PREV row, and those
        sent before the grammars accepted the tokens their bitmask depends on (off the critical
        path)."""
        sent_at, result_at, bitmask_at, accept_at = {}, {}, {}, {}
        last_sampled: dict[int, int] = {}  # slot -> the latest batch sampling it
        needs: dict[int, list[int]] = {}
        counts = {"constrained": 0, "from_prev": 0, "overlapped": 0}
        last_result = None
        for i, e in enumerate(self.events):
            if e[0] == "accept":
                accept_at.setdefault(last_result, i)
                continue
            if e[0] == "batch":
                _, bid, cols, rows, inline = e
                sent_at[bid] = i
                if rows:
                    assert not inline, f"batch {bid}: its bitmask went with it"
                    counts["constrained"] += 1
                    counts["from_prev"] += bool(cols.from_prev[rows].any())
                    needs[bid] = [last_sampled[s] for s in cols.slots[rows].tolist() if s in last_sampled]
                for s in cols.slots[cols.sample].tolist():
                    last_sampled[s] = bid
            elif e[0] == "bitmask":
                bid = e[1]
                assert bid in needs and bid not in bitmask_at, f"bitmask of batch {bid}: unexpected or twice"
                bitmask_at[bid] = i
                for dep in needs[bid]:
                    assert result_at.get(dep, i) < i, f"bitmask of batch {bid} sent before the result of batch {dep}"
            else:
                last_result = e[1]
                result_at[e[1]] = i
        assert sorted(bitmask_at) == sorted(needs), "a constrained batch never got its bitmask"
        counts["overlapped"] = sum(any(accept_at.get(d, -1) > sent_at[b] for d in deps) for b, deps in needs.items())
        return counts


@pytest.mark.slow
def test_constrained_and_free_in_one_batch(engine):
    """A mixed batch: every constrained output is valid; the same tokens at every PP size; the
    bitmasks follow their micro-batches in the order the ordering argument needs."""
    pp, llm = engine
    tok = llm.get_tokenizer()
    reqs = CASES + FREE
    before = llm.engine.scheduler.stats.num_preemptions
    order = _Order(llm)
    try:
        outs = llm.generate([_chat(tok, q) for q, *_ in reqs], [r[1] for r in reqs], use_tqdm=False)
    finally:
        order.close()
    counts = order.check()
    # Decoding constrained batches leave before the grammar work their bitmask needs.
    assert counts["overlapped"] > 0, counts
    for (q, _, check), o in zip(CASES, outs):
        _check(o.outputs[0].text, o.outputs[0].finish_reason, check)
    RESULTS[pp] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    if pp == 2:
        assert llm.engine.scheduler.stats.num_preemptions > before, "the small KV cache did not force preemption"
        assert llm.engine.kv.num_free_blocks == KV_BLOCKS_PP2
    if pp != 1 and 1 in RESULTS:  # greedy and seeded sampling: the same tokens at every PP size
        for i, (got, want) in enumerate(zip(RESULTS[pp], RESULTS[1])):
            assert got == want, f"request {i} differs between PP={pp} and PP=1"


@pytest.mark.slow
def test_free_requests_unchanged_by_constrained_neighbours(engine):
    pp, llm = engine
    assert pp in RESULTS, "runs after test_constrained_and_free_in_one_batch"
    tok = llm.get_tokenizer()
    alone = llm.generate([_chat(tok, q) for q, _ in FREE], [sp for _, sp in FREE], use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in alone] == RESULTS[pp][len(CASES):]


@pytest.mark.slow
def test_async_scheduling_constrained_mixed_batch(demo_model):
    """Async scheduling (PP=1, forced on the CPU): a constrained sequence is scheduled again
    while its previous token is still in flight (FROM_PREV), and its bitmask row follows once
    that token is back. Outputs valid, and the same tokens as without async scheduling."""
    with LLM(demo_model, async_scheduling=True, kv_cache_memory="64MiB") as llm:
        assert llm.engine.config.async_scheduling
        tok = llm.get_tokenizer()
        reqs = CASES + FREE
        order = _Order(llm)
        try:
            outs = llm.generate([_chat(tok, q) for q, *_ in reqs], [r[1] for r in reqs], use_tqdm=False)
        finally:
            order.close()
    counts = order.check()
    assert counts["from_prev"] > 0, counts
    for (q, _, check), o in zip(CASES, outs):
        _check(o.outputs[0].text, o.outputs[0].finish_reason, check)
    if 1 in RESULTS:
        for i, (o, want) in enumerate(zip(outs, RESULTS[1])):
            assert (o.outputs[0].token_ids, o.outputs[0].finish_reason) == want, f"request {i} differs"


@pytest.mark.slow
def test_compile_errors_size_limit_and_timeout(engine):
    pp, llm = engine
    if pp != 1:
        pytest.skip("front-end checks: once, at PP=1")
    e = llm.engine

    def refused(so: SO, match: str) -> None:
        with pytest.raises(RequestError, match=match) as info:
            llm.generate(["Hi"], SamplingParams(max_tokens=5, structured_outputs=so), use_tqdm=False)
        assert info.value.param == "structured_outputs"

    refused(SO(json={"type": "objec"}), 'could not be compiled: Unsupported type "objec"')
    refused(SO(json="{not json"), "could not be compiled")
    refused(SO(regex="(ab"), "could not be compiled: Regex parsing error")
    refused(SO(grammar="root ::= undefined_rule"), "could not be compiled")
    limit, timeout = e.grammar.max_spec_bytes, e.grammar.compile_timeout
    try:
        e.grammar.max_spec_bytes = 100
        refused(SO(json=PERSON), "at most 100")
        e.grammar.max_spec_bytes = limit
        e.grammar.compile_timeout = 0.5  # the slow schema takes tens of seconds
        refused(SO(json=slow_schema()), r"did not compile within 0.5 s \(--structured-outputs-compile-timeout\)")
    finally:
        e.grammar.max_spec_bytes, e.grammar.compile_timeout = limit, timeout
    with pytest.raises(SamplingParamsError):
        SO()
    with pytest.raises(SamplingParamsError):
        SO(regex="a", choice=["a"])
    with pytest.raises(SamplingParamsError):
        SO(choice=[])
    # Still serving, and the compile cache answers at once for a schema seen before.
    out = llm.generate(["Hi"], _greedy(structured_outputs=SO(choice=["ok"])), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ok", "stop")


# --- no engine: the last stage's mask, tool-call parsing ---------------------------------------------
def test_last_stage_mask_matches_xgrammar():
    """unpack_bitmask + apply_allowed give the logits xgrammar's own kernel gives, for every row
    or a subset of them (other rows untouched), including a vocabulary wider than the bitmask."""
    import numpy as np
    import torch
    import xgrammar as xgr
    from zpp.workers.sampler import apply_allowed, unpack_bitmask

    rng = np.random.default_rng(0)
    for n, rows, vocab in [(4, [0, 1, 2, 3], 1000), (6, [1, 4], 1000), (3, [0, 2], 1030)]:
        words = rng.integers(-2 ** 31, 2 ** 31, size=(len(rows), 32), dtype=np.int64).astype("<i4")
        logits = torch.randn(n, vocab)
        want = logits.clone()
        full = torch.full((n, 32), -1, dtype=torch.int32)
        full[rows] = torch.from_numpy(words.astype(np.int32))
        xgr.apply_token_bitmask_inplace(want[:, :1024], full, indices=rows)
        want[rows, 1024:] = float("-inf")  # beyond the bitmask: never allowed
        apply_allowed(logits, (torch.tensor(rows), unpack_bitmask(words.tobytes(), len(rows), vocab,
                                                                  torch.device("cpu"))))
        assert torch.equal(logits, want)


@pytest.mark.slow
def test_grammar_vocabulary_is_the_tokenizers_not_the_padded_one(tokenizer):
    """A model with more logits than tokens (padding): xgrammar is built for the tokenizer's tokens
    only (grammar_vocab_size), the core's bitmask is that narrow, and the last stage's mask is the
    one the padded vocabulary gives (every padding id disallowed), step after step."""
    import numpy as np
    import torch
    import xgrammar as xgr
    from zpp.engine.structured_output import GrammarStore
    from zpp.frontend.compile_host import grammar_vocab_size
    from zpp.transport.core_messages import GrammarSpec
    from zpp.workers.sampler import unpack_bitmask

    padded, stop = 49152 + 300, [tokenizer.eos_token_id]
    assert grammar_vocab_size(len(tokenizer), padded, stop) == len(tokenizer) == 49152
    assert grammar_vocab_size(len(tokenizer), padded, [49400]) == 49401  # a stop id past the tokenizer
    assert grammar_vocab_size(len(tokenizer), 40000, stop) == 40000  # never past the model's logits
    schema = json.dumps(PERSON)
    masks = {}
    for vocab in (padded, grammar_vocab_size(len(tokenizer), padded, stop)):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(schema)
        store = GrammarStore(padded)
        g = store.new_matcher(GrammarSpec("k", compiled.serialize_json(), info.serialize_json()), stop)
        assert store.words == (vocab + 31) // 32
        out = []
        for t in tokenizer.encode('{"name": "Anna", "age": 31, "city": "Paris"}') + stop:
            bits = store.fill_bitmask([g])
            out.append(unpack_bitmask(bits, 1, padded, torch.device("cpu")))
            assert g.accept(t)
        masks[vocab] = torch.cat(out)
    wide, narrow = masks.values()
    assert torch.equal(wide, narrow) and bool(narrow[:, 49152:].all())


@pytest.mark.slow
def test_batched_accept_reports_each_refusal(tokenizer, monkeypatch):
    """The core's batched accept (xgrammar's C++ array read without converting it, and the public
    wrapper as fallback; one thread and a pool of two from 64 rows): every row's answer, a refused
    token leaves its matcher where it was, the others advance."""
    import xgrammar as xgr
    from zpp.engine import structured_output as so
    from zpp.transport.core_messages import GrammarSpec

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    spec = GrammarSpec("k", xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON)).serialize_json(),
                       info.serialize_json())
    stop = [tokenizer.eos_token_id]
    good, bad = tokenizer.encode("{")[0], tokenizer.encode("}")[0]
    for raw in (None, False):
        monkeypatch.setattr(so, "_raw_batch_accept", raw)
        for threads, n in ((1, 3), (2, 70)):
            store = so.GrammarStore(len(tokenizer), threads)
            gs = [store.new_matcher(spec, stop) for _ in range(n)]
            assert store.accept_tokens(gs, [good] * n) == [True] * n
            quote = tokenizer.encode('"')[0]  # after '{': '"' starts a key, '}' is refused (keys required)
            ok = store.accept_tokens(gs, [bad if i % 2 == 0 else quote for i in range(n)])
            assert ok == [i % 2 == 1 for i in range(n)], (raw, threads)
            assert [g.num_accepted for g in gs] == [1 + (i % 2) for i in range(n)]


@pytest.mark.slow
def test_core_bitmask_fill_threaded_equals_row_by_row(tokenizer):
    """The core's bitmask: filled on several threads (many-core hosts) or row by row (the 2-core
    machines), the bytes are the same, and they follow the matchers as tokens are accepted."""
    import asyncio as aio

    from zpp.engine.structured_output import GrammarStore
    from zpp.frontend.grammar import GrammarCompiler

    async def compile_all():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 30.0, 1 << 20)
        specs = [gc.for_core(await gc.compile(SO(json=s))) for s in (PERSON, BOOK, FLAG, WEATHER)]
        gc.close()
        return specs

    specs = aio.run(compile_all())
    one, many = GrammarStore(49152, 1), GrammarStore(49152, 2)
    text = '{"name": "Anna", "age": 31, "city": "Paris"}'
    ms1 = [one.new_matcher(specs[i % 4], [2]) for i in range(20)]
    ms2 = [many.new_matcher(specs[i % 4], [2]) for i in range(20)]
    for t in tokenizer.encode(text)[:6]:
        assert one.fill_bitmask(ms1) == many.fill_bitmask(ms2)
        for a, b in zip(ms1[::4], ms2[::4]):  # the PERSON matchers advance: one by one, and batched
            assert a.accept(t)
        assert many.accept_tokens(ms2[::4], [t] * 5) == [True] * 5
    assert [g.num_accepted for g in ms1] == [g.num_accepted for g in ms2] == [6, 0, 0, 0] * 5
    # A refused token (a dead end: the stop token of an incomplete object) leaves the matcher
    # where it was; a finished sequence's row (None) allows every token.
    assert many.accept_tokens(ms2[:2], [2, tokenizer.encode("{")[0]]) == [False, True]
    assert (ms2[0].num_accepted, ms2[1].num_accepted) == (6, 1)
    rows = many.fill_rows([ms2[0], None, ms2[1]])
    assert (rows[1] == -1).all() and rows[0].tobytes() == one.fill_bitmask([ms1[0]])
    # Many rows: the accept runs in slices on the store's threads, with the same outcome.
    ids = tokenizer.encode(text)
    ms1 = [one.new_matcher(specs[0], [2]) for _ in range(80)]
    ms2 = [many.new_matcher(specs[0], [2]) for _ in range(80)]
    for step, t in enumerate(ids[:8]):
        toks = [2 if i % 9 == step else t for i in range(80)]  # a few stop tokens: refused mid-object
        assert one.accept_tokens(ms1, toks) == many.accept_tokens(ms2, toks)
        assert one.fill_bitmask(ms1) == many.fill_bitmask(ms2)
    assert [g.num_accepted for g in ms1] == [g.num_accepted for g in ms2]
    assert many._pool is not None  # the threaded path ran


HOSTILE_PATTERN = "^(a|b|c|d)*(a|b)*(c|d){3,30}[a-z]{5,50}$"  # ~0.5 MB of compiled grammar per property


def _pattern_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": HOSTILE_PATTERN} for i in range(n)},
            "required": [f"p{i}" for i in range(n)]}


@pytest.mark.slow
def test_compiled_grammar_size_is_bounded_before_serializing(tokenizer):
    """A small schema that compiles to a huge grammar (a newcomer's 18 KB schema of 200 such
    properties made the server grow by tens of GB while serializing it) is refused with a 400
    naming --max-structured-outputs-grammar-bytes, without serializing it (60 properties: 29 MB of
    grammar, ~95 MB serialized, which the front end never receives); a schema under the limit still
    compiles."""
    import asyncio as aio
    import resource
    import time

    from zpp.frontend.grammar import GrammarCompiler

    async def go():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 60.0, 1 << 20, max_grammar_bytes=4 << 20)
        assert (await gc.compile(SO(json=_pattern_schema(2)))).compiled  # ~1 MB: accepted
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.monotonic()
        with pytest.raises(RequestError, match=r"MiB; this server accepts at most 4.0 MiB "
                                               r"\(--max-structured-outputs-grammar-bytes\)") as info:
            await gc.compile(SO(json=_pattern_schema(60)))
        assert info.value.param == "structured_outputs"
        took, grew = time.monotonic() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**10
        gc.close()
        return took, grew

    took, grew_mib = aio.run(go())
    assert took < 30 and grew_mib < 64, (took, grew_mib)


def slow_schema(n: int = 250, tag: str = "") -> dict:
    """The schema of shared/cases/grammar-compile-outlives-timeout.md: ``n`` required strings, each
    with its own pattern (250: about 17 KB, about 41 s and 160 MB for xgrammar alone)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z0-9]{{1,100}}x{tag}{i}"}
                                             for i in range(n)}, "required": [f"p{i}" for i in range(n)]}


def _compile_children(host_pid: int) -> list[int]:
    from helpers import descendants
    return descendants(host_pid)


@pytest.mark.slow
def test_compiles_are_killed_refused_once_and_never_starve_small_ones(tokenizer):
    """Compiles run in processes forked by the compile host: two slow schemas hold both general
    slots, yet a small ``choice`` compiles at once (its own slot); a third large schema says it
    waited for a slot; at the timeout the slow compiles are killed (no compile process left a second
    later) and a copy of one is refused at once without compiling; a compile whose only request
    goes away is killed at once."""
    import asyncio as aio
    import time

    from zpp.frontend.grammar import GrammarCompiler

    async def go():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 2.0, 1 << 20)
        await gc.compile(SO(choice=["warm", "up"]))  # starts the host (not counted in any timeout)
        host = gc.host_pid
        slow = [aio.ensure_future(gc.compile(SO(json=slow_schema(tag=t)))) for t in "ab"]
        await aio.sleep(0.3)
        third = aio.ensure_future(gc.compile(SO(json=slow_schema(tag="c"))))
        t = time.monotonic()
        assert (await gc.compile(SO(choice=["yes", "no", "maybe"]))).compiled
        assert time.monotonic() - t < 1.0, "a small choice waited behind the slow schemas"
        for f in slow:
            with pytest.raises(RequestError, match=r"did not compile within 2 s \(--structured-outputs-compile-timeout\)"):
                await f
        with pytest.raises(RequestError, match="for a compile slot, all busy with other grammars"):
            await third
        await aio.sleep(1.0)
        assert _compile_children(host) == [], "a compile process outlived its timeout"
        t = time.monotonic()
        with pytest.raises(RequestError, match="it timed out before: not compiled again"):
            await gc.compile(SO(json=slow_schema(tag="a")))
        assert time.monotonic() - t < 0.1
        gone = aio.ensure_future(gc.compile(SO(json=slow_schema(tag="d"))))
        await aio.sleep(0.5)
        assert len(_compile_children(host)) == 1
        gone.cancel()  # the client went away
        await aio.sleep(0.5)
        assert _compile_children(host) == [], "a compile nobody waits for still runs"
        gc.close()
        await aio.sleep(0.5)
        from helpers import alive
        assert not alive(host)

    aio.run(go())


@pytest.mark.slow
def test_a_running_compile_does_not_keep_the_process_alive(tmp_path):
    """A process that exits while a grammar compiles exits at once, and its compile host and the
    compile process go with it (a stopping server waited minutes for xgrammar)."""
    import subprocess
    import sys

    from helpers import alive
    script = tmp_path / "exit_during_compile.py"
    script.write_text(
        "import asyncio, json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from zpp.frontend.grammar import GrammarCompiler\n"
        "from zpp.sampling_params import StructuredOutputsParams as SO\n"
        "async def main():\n"
        "    gc = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[1]), 49152, {2}, 600.0, 1 << 20)\n"
        "    asyncio.ensure_future(gc.compile(SO(json=json.loads(sys.argv[2]))))\n"
        "    while gc.host_pid is None or not gc._host._started:\n"
        "        await asyncio.sleep(0.05)\n"
        "    print(gc.host_pid, flush=True)\n"
        "asyncio.run(main())\n"
        "print('exiting', flush=True)\n")
    from helpers import demo_model_or_skip
    out = subprocess.run([sys.executable, str(script), demo_model_or_skip(), json.dumps(slow_schema())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "exiting", out.stderr
    host = int(out.stdout.split()[0])
    import time
    deadline = time.monotonic() + 5
    while alive(host) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(host), "the compile host outlived its process"


# --- tool-call parsing (no engine) -----------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


def test_tool_output_parsing_and_streaming():
    auto = parse_tools(TOOLS, "auto", None)
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parse_output(auto, text)
    assert content == "Let me check. " and len(calls) == 1  # the text before the call, as generated
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert parse_output(auto, '{"name": "get_time", "parameters": {"zone": "UTC"}}')[1][0]["function"]["name"] == "get_time"
    assert parse_output(auto, "Paris is sunny.") == ("Paris is sunny.", [])
    assert parse_output(auto, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []
    required = parse_tools(TOOLS, "required", None)
    _, calls = parse_output(required, '[{"name": "get_time", "parameters": {"zone": "CET"}}, '
                                      '{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    schema = required.structured_outputs().json
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Rome"}}], schema)
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.structured_outputs().json == TOOLS[0]["function"]["parameters"]
    # Streaming in auto mode: content goes out until a tag may start; the call at the end.
    ts, deltas = ToolStream(auto), []
    for end in range(0, len(text) + 1, 5):
        deltas += ts.feed(text[:end], False)
    deltas += ts.feed(text, True)
    assert "".join(d.get("content", "") for d in deltas) == content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[1]["function"]["arguments"] == '{"city": "Paris"}'
    # A request's bad tools are refused naming the field.
    for tools, choice, param in [([{"type": "code"}], "auto", "tools"), (TOOLS, {"type": "function", "function": {"name": "x"}}, "tool_choice"),
                                 (None, "required", "tool_choice"), (TOOLS + TOOLS[:1], "auto", "tools"),
                                 (TOOLS, "always", "tool_choice")]:
        with pytest.raises(Exception) as info:
            parse_tools(tools, choice, None)
        assert info.value.param == param


# --- the server ------------------------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct"
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    return shared_pp2_server


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


class Person(BaseModel):
    name: str
    age: int


@pytest.mark.slow
def test_server_parse_tools_and_vllm_fields(server):
    async def go():
        c = _client(server)
        parsed, forced, named, streams, choice, regex = await asyncio.gather(
            c.chat.completions.parse(model=MODEL, temperature=0, max_tokens=40, response_format=Person, messages=[
                {"role": "user", "content": "Describe a person named Bob aged 40 as JSON."}]),
            c.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice="required",
                                      temperature=0, max_tokens=60),
            c.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=40,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            asyncio.gather(*(_stream_tool_calls(c, choice) for choice in
                             ("required", {"type": "function", "function": {"name": "get_weather"}}))),
            c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                 extra_body={"structured_outputs": {"choice": ["yes", "no"]}}),
            c.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=0,
                                 extra_body={"guided_regex": PHONE}))
        p = parsed.choices[0]
        assert p.finish_reason == "stop" and isinstance(p.message.parsed, Person), p
        for r in (forced, named):
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            for call in ch.message.tool_calls:
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
        for calls, finish in streams:
            assert finish == "tool_calls" and calls
            for call in calls.values():
                tool = next(t for t in TOOLS if t["function"]["name"] == call["name"])
                jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
        assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
        assert re.fullmatch(PHONE, regex.choices[0].text) and regex.choices[0].finish_reason == "stop"

    asyncio.run(go())


async def _stream_tool_calls(c: AsyncOpenAI, tool_choice) -> tuple[dict, str]:
    """Stream a tools request; returns ({index: {"name", "arguments"}}, finish reason), checking that
    each call's id, type and name come in its first delta and only arguments after."""
    calls: dict[int, dict] = {}
    finish = None
    stream = await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=tool_choice,
                                             temperature=0, max_tokens=60, stream=True)
    async for chunk in stream:
        ch = chunk.choices[0]
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    return calls, finish


BAD = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"guided_json": {"type": "objec"}}, "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "foo": 1}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.slow
def test_server_bad_inputs_get_400_naming_the_field(server):
    async def go():
        c = _client(server)
        for extra, param in BAD:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5, extra_body=extra)
            assert e.value.status_code == 400 and e.value.body["param"] == param, (extra, e.value.body)
        r = await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length"

    asyncio.run(go())


# --- handed cases (shared/cases/): one message shape however an output ends; bounded compiles ----
GET_WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                          "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "temperature": {"type": "integer"}},
                  "required": ["city", "temperature"]}
# Every kind of request, as extra chat-completion fields.
SHAPE_MODES = {
    "plain": {},
    "tools-auto": {"tools": GET_WEATHER},
    "tools-named": {"tools": GET_WEATHER, "tool_choice": NAMED},
    "tools-required": {"tools": GET_WEATHER, "tool_choice": "required"},
    "json-schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_SCHEMA}}},
    "choice": {"structured_outputs": {"choice": ["sunny and warm", "rainy and cold"]}},
}
CONSTRAINED = ("tools-named", "tools-required", "json-schema", "choice")


async def _shape(c: AsyncOpenAI, stream: bool, **kw) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(tool name, arguments)], finish reason) of one chat completion, from the message
    or reassembled from the stream's deltas (content joined; each call's name from its first delta,
    its arguments joined)."""
    if not stream:
        ch = (await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0, **kw)).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return ch.message.content or "", calls, ch.finish_reason
    content, calls, finish = "", {}, None
    async for chunk in await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, temperature=0, stream=True,
                                                       **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for t in ch.delta.tool_calls or []:
            if t.index not in calls:
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [tuple(v) for _, v in sorted(calls.items())], finish


def _kw(fields: dict) -> dict:
    """Chat fields as the openai client takes them (non-standard ones through extra_body)."""
    std = {k: v for k, v in fields.items() if k in ("tools", "tool_choice", "response_format", "max_tokens", "stop")}
    extra = {k: v for k, v in fields.items() if k not in std}
    return {**std, "extra_body": extra} if extra else std


@pytest.mark.slow
def test_named_tool_call_cut_off_has_one_shape(server):
    """shared/cases/named-tool-call-cut-off.md: a named tool call cut off by max_tokens (8, 15) is
    its call in both modes, the arguments as far as generated (at 8 tokens: the case's fragment),
    finish_reason "length"; a complete one (20, 100) is the call with finish "tool_calls"; a cut-off
    ``required`` output (8, 15, 20) is content in both modes."""
    async def go():
        c = _client(server)
        cases = [(mode, n, stream) for mode in ("tools-named", "tools-required") for n in (8, 15, 20, 100)
                 for stream in (False, True)]
        got = await asyncio.gather(*(_shape(c, stream, **_kw({**SHAPE_MODES[mode], "max_tokens": n}))
                                     for mode, n, stream in cases))
        res = dict(zip(cases, got))
        for mode in ("tools-named", "tools-required"):
            for n in (8, 15, 20, 100):
                assert res[mode, n, False] == res[mode, n, True], (mode, n, res[mode, n, False], res[mode, n, True])
        assert res["tools-named", 8, False] == ("", [("get_weather", '{\n  "city": "Paris",')], "length")
        for n in (8, 15):
            content, calls, finish = res["tools-named", n, False]
            assert (content, finish) == ("", "length") and len(calls) == 1 and calls[0][0] == "get_weather"
            with pytest.raises(ValueError):
                json.loads(calls[0][1])  # cut off: the arguments are incomplete JSON
        for n in (8, 15, 20):
            content, calls, finish = res["tools-required", n, False]
            assert calls == [] and finish == "length" and content.startswith('[{"name": "get_')
        for n in (20, 100):
            content, calls, finish = res["tools-named", n, False]
            assert finish == "tool_calls" and calls[0][0] == "get_weather"
            jsonschema.validate(json.loads(calls[0][1]), GET_WEATHER[0]["function"]["parameters"])

    asyncio.run(go())


@pytest.mark.slow
def test_every_early_end_has_one_shape_streamed_or_not(server):
    """The whole kind of that case: for plain text, tool calls (auto, named, required) and
    structured outputs (JSON schema, choice), each way an output ends early -- max_tokens, a stop
    string, a grammar dead end (min_tokens past the grammar's end: "abort") -- gives the same
    message (content, tool calls, finish reason) streamed and not streamed."""
    async def go():
        c = _client(server)
        full = dict(zip(SHAPE_MODES, await asyncio.gather(*(
            _shape(c, False, **_kw({**fields, "max_tokens": 40})) for fields in SHAPE_MODES.values()))))
        cases: list[tuple[str, str, dict]] = []
        for mode, fields in SHAPE_MODES.items():
            content, calls, _ = full[mode]
            text = calls[0][1] if calls else content
            cases.append((mode, "length", {**fields, "max_tokens": 5}))
            if len(text) >= 6:  # a stop string from the middle of the full output
                mid = len(text) // 2
                cases.append((mode, "stop string", {**fields, "max_tokens": 40, "stop": [text[mid:mid + 3]]}))
            if mode in CONSTRAINED:
                cases.append((mode, "dead end", {**fields, "max_tokens": 60, "min_tokens": 59}))
        got = await asyncio.gather(*(_shape(c, stream, **_kw(fields)) for _, _, fields in cases
                                     for stream in (False, True)))
        finishes = set()
        for i, (mode, end, _) in enumerate(cases):
            plain, streamed = got[2 * i], got[2 * i + 1]
            assert plain == streamed, (mode, end, plain, streamed)
            finishes.add((end, plain[2]))
            if mode == "tools-named":
                assert len(plain[1]) == 1, (end, plain)  # a named function's output is always its call
        assert {("length", "length"), ("stop string", "stop"), ("dead end", "abort")} <= finishes, finishes

    asyncio.run(go())


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and its live descendants."""
    import os
    from helpers import descendants
    total = 0
    for p in [pid] + descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_slow_schema_is_stopped_refused_once_and_starves_nobody(server):
    """shared/cases/grammar-compile-outlives-timeout.md on the server (compile timeout 10 s): a
    client that gives up after 1 s; the same schema from a patient client gets a 400 naming the
    timeout flag; a few seconds later the server's processes are back near idle (the compile was
    killed); a copy of the schema is refused at once; while two other slow schemas compile, a small
    ``choice`` request is answered in under 2 s. (A constrained request first: the engine core's
    first grammar costs ~2 s once -- importing xgrammar, reading the tokenizer info -- which would
    otherwise fall on the measured request when this test runs alone.)"""
    import time

    async def go():
        c = _client(server)
        await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5, temperature=0,
                                        extra_body={"structured_outputs": {"choice": ["warm", "up"]}})
        fmt = lambda schema: {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        impatient = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):
            await impatient.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5,
                                                    response_format=fmt(slow_schema()))
        t = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="--structured-outputs-compile-timeout"):
            await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5,
                                            response_format=fmt(slow_schema()))
        assert 9 < time.monotonic() - t < 14
        await asyncio.sleep(1.0)
        cpu0 = _tree_cpu_seconds(server.proc.pid)
        await asyncio.sleep(2.0)
        busy = _tree_cpu_seconds(server.proc.pid) - cpu0
        assert busy < 0.6, f"the server's processes used {busy:.2f} CPU-seconds in 2 s after the refusal"
        t = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="timed out before"):
            await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5,
                                            response_format=fmt(slow_schema()))
        assert time.monotonic() - t < 1.0
        slow = [asyncio.ensure_future(c.chat.completions.create(
            model=MODEL, messages=WEATHER_Q, max_tokens=5, response_format=fmt(slow_schema(tag=tag))))
            for tag in "pq"]
        await asyncio.sleep(1.0)
        t = time.monotonic()
        r = await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, max_tokens=5, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        took = time.monotonic() - t
        assert r.choices[0].message.content in ("yes", "no") and took < 2.0, took
        for f in slow:  # the clients go away: their compiles are killed
            f.cancel()
        await asyncio.gather(*slow, return_exceptions=True)

    asyncio.run(go())
