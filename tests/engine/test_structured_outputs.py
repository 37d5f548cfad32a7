"""Structured outputs and tool calls on the real SmolLM2 (CPU).

Offline (one engine per pipeline size, PP=1, 2, 3, all requests of a check in one generate call):
JSON-schema outputs parse and validate (nested objects, enums, arrays, numbers, required fields),
a choice returns one of the choices, a regex / EBNF output fullmatches, greedy and seeded sampling
(top-k/p, min-p) give the same tokens at every PP size, free requests next to constrained ones get
the tokens they get without them, a grammar dead end finishes with "abort", and the PP=2 engine's
tiny KV cache forces preemption (recompute) of constrained requests, which must not change them
(the result rank, which holds the matchers, replays the outputs they come back with). The result
rank's matchers (``zpp.workers.grammar``) and the core's side (``GrammarSender``) are also tested
alone. Compile errors, the size limit and the compile timeout are refused as RequestErrors.

Server (``zpp serve`` at PP=2 through the official ``openai`` client): ``chat.completions.parse``
with a pydantic model, ``tools`` with tool_choice "required" and a named function (non-stream and
stream; with a response_format too, which the forced call's grammar overrides), the vLLM fields on
/v1/completions, and 400s naming the field for bad inputs.
"""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
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
    """Records, on an in-process engine's executor, the micro-batches sent (with the fields only
    the result rank gets) and the results taken, and checks what the result rank was sent."""

    def __init__(self, llm):
        from zpp.transport import messages as m
        self.m, self.ex, self.events = m, llm.engine.core.executor, []
        ex, ev = self.ex, self.events
        send, next_result = ex.send, ex.next_result

        def sending(batch, result_fields=None):
            ev.append(("batch", batch, dict(result_fields or {})))
            return send(batch, result_fields)

        async def taking():
            item = await next_result()
            if isinstance(item, m.StepResult):
                ev.append(("result", item))
            return item

        ex.send, ex.next_result = sending, taking

    def close(self) -> None:
        del self.ex.send, self.ex.next_result

    def check(self) -> dict:
        """Each constrained request reached the result rank with its grammar in the batch that sent
        it (first, or again after preemption: then with the outputs to replay), each grammar's
        compiled text and the tokenizer info once; the results name only constrained sampling
        chunks as completed or refused. Returns counts: requests sent with a grammar, those resent
        with outputs (replayed), batches with a constrained FROM_PREV row, rows reported complete
        and refused."""
        m = self.m
        counts = {"sent": 0, "replayed": 0, "from_prev": 0, "stopped": 0, "refused": 0}
        compiled_keys, tokenizer_sent = [], 0
        constrained: set[int] = set()
        batches = {}
        for kind, msg, *extra in self.events:
            if kind == "result":
                b = batches.pop(msg.batch_id)
                sampled = set(np.flatnonzero(b[0].sample).tolist())
                for i in msg.grammar_stopped + msg.grammar_refused:
                    assert i in sampled and int(b[0].slots[i]) in b[1], (msg.batch_id, i)
                counts["stopped"] += len(msg.grammar_stopped)
                counts["refused"] += len(msg.grammar_refused)
                continue
            fields = extra[0]
            cols = m.BatchColumns(msg)
            constrained -= set(cols.freed_slots.tolist())
            new = {r.slot: r for r in msg.new_reqs}
            constrained -= set(new)
            tokenizer_sent += bool(fields.get("grammar_tokenizer"))
            for g in fields.get("grammars", ()):
                r = new[g.slot]  # only with the batch that sends its request
                assert tokenizer_sent, "a grammar before the tokenizer info"
                constrained.add(g.slot)
                counts["sent"] += 1
                counts["replayed"] += len(m.int32s(r.token_ids)) > r.num_prompt_tokens
                if g.compiled:
                    compiled_keys.append(g.key)
            counts["from_prev"] += any(bool(cols.from_prev[i]) and int(cols.slots[i]) in constrained
                                       for i in range(cols.size))
            batches[msg.batch_id] = (cols, set(constrained))
        assert tokenizer_sent == 1 and len(compiled_keys) == len(set(compiled_keys)), compiled_keys
        return counts


@pytest.mark.slow
def test_constrained_and_free_in_one_batch(engine):
    """A mixed batch: every constrained output is valid; the same tokens at every PP size (the
    PP=2 engine preempts constrained requests, which the result rank replays); each grammar
    reached the result rank with its request, and its reports end the sequences as before."""
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
    # Every constrained case was sent with its grammar; the phone number's grammar completed with
    # ignore_eos, and the dead end was refused, as the result rank reported.
    assert counts["sent"] >= len(CASES) and counts["stopped"] >= 1 and counts["refused"] == 1, counts
    if pp == 2:  # preempted constrained requests came back with their outputs, replayed
        assert counts["replayed"] > 0, counts
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
    """Free requests alone get the tokens they got next to constrained ones. They run in the
    slots the constrained requests had (the lowest free ones): the result rank must have dropped
    those matchers when the slots were freed, or it would mask these rows."""
    pp, llm = engine
    assert pp in RESULTS, "runs after test_constrained_and_free_in_one_batch"
    tok = llm.get_tokenizer()
    alone = llm.generate([_chat(tok, q) for q, _ in FREE], [sp for _, sp in FREE], use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in alone] == RESULTS[pp][len(CASES):]


@pytest.mark.slow
def test_async_scheduling_constrained_mixed_batch(demo_model):
    """Async scheduling (PP=1, forced on the CPU): a constrained sequence is scheduled again
    while its previous token is still in flight (FROM_PREV); the result rank fills its row once it
    has finished the previous result (its matcher accepted that token). Outputs valid, and the
    same tokens as without async scheduling; a sequence the grammar ends while it is in the next
    batch has that batch's token dropped."""
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
def test_decode_graph_path_constrained(demo_model, tmp_path, monkeypatch):
    """The CUDA decode-graph path's host logic on the CPU (the ``ZPP_EAGER_GRAPHS`` stand-in of
    tests/workers/test_graph_path_cpu.py) with async scheduling: greedy results are left pending
    and finished after the next launch, or by the result rank before it fills the next bitmask,
    its matchers accepting their tokens then. Outputs valid, and the eager path's tokens."""
    replays = tmp_path / "replays"
    monkeypatch.setenv("ZPP_EAGER_GRAPHS", str(replays))
    with LLM(demo_model, async_scheduling=True, kv_cache_memory="64MiB") as llm:
        tok = llm.get_tokenizer()
        reqs = CASES + FREE
        outs = llm.generate([_chat(tok, q) for q, *_ in reqs], [r[1] for r in reqs], use_tqdm=False)
    assert replays.exists() and len(replays.read_text().splitlines()) >= 20, "the graph path did not run"
    for (q, _, check), o in zip(CASES, outs):
        _check(o.outputs[0].text, o.outputs[0].finish_reason, check)
    if 1 in RESULTS:
        for i, (o, want) in enumerate(zip(outs, RESULTS[1])):
            assert (o.outputs[0].token_ids, o.outputs[0].finish_reason) == want, f"request {i} differs"


@pytest.mark.slow
def test_tensor_parallel_last_stage(demo_model):
    """TP=3 (SmolLM2's 3 KV heads): only TP rank 0 samples, and only it gets the grammars (the
    other ranks run the same batches without them); every constrained output is valid, with the
    finish reasons of the single-rank engine (a completed grammar "stop", the dead end "abort")."""
    with LLM(demo_model, tensor_parallel_size=3, kv_cache_memory="64MiB") as llm:
        tok = llm.get_tokenizer()
        order = _Order(llm)
        try:
            outs = llm.generate([_chat(tok, q) for q, *_ in CASES], [r[1] for r in CASES], use_tqdm=False)
        finally:
            order.close()
    counts = order.check()
    assert counts["sent"] == len(CASES) and counts["refused"] == 1, counts
    for (q, _, check), o in zip(CASES, outs):
        _check(o.outputs[0].text, o.outputs[0].finish_reason, check)


@pytest.mark.slow
def test_compile_errors_size_limit_and_timeout(engine, caplog):
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
        with caplog.at_level("WARNING", logger="zpp.frontend.grammar"):
            refused(SO(json=slow_schema()), r"did not compile within 0.5 s \(--structured-outputs-compile-timeout\)")
        # the operator sees it too, not only the client
        assert any("did not compile within 0.5 s" in r.getMessage() for r in caplog.records), caplog.text
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


def _slots(info: str, grammars: list, vocab: int = 49152, threads: int = 1, outputs=None):
    """The result rank's grammars (:class:`SlotGrammars`) with request ``i`` in slot ``i``:
    ``grammars[i]`` = (key, compiled text, stop ids), sent as a worker gets them (one
    ExecuteBatch, the tokenizer info with it); ``outputs[i]``: output tokens it was resent with."""
    from zpp.transport import messages as m
    from zpp.workers.grammar import SlotGrammars
    from zpp.workers.slots import SlotTable

    n = len(grammars)
    table, g = SlotTable(n + 2, 512, 16), SlotGrammars(n + 2, vocab, threads)
    b = m.BatchBuilder()
    for i in range(n):
        b.new_request(i, f"r{i}", [1] + list((outputs or {}).get(i, ())), 1, [0], None)
    batch = b.build(0)
    batch.grammars = [m.GrammarInit(i, k, stop, c) for i, (k, c, stop) in enumerate(grammars)]
    batch.grammar_tokenizer = info
    table.apply(batch)
    g.apply(batch, table)
    return g, table


def _rows(n: int):
    import numpy as np
    return np.arange(n, dtype=np.int64)


@pytest.mark.slow
def test_grammar_vocabulary_is_the_tokenizers_not_the_padded_one(tokenizer):
    """A model with more logits than tokens (padding): xgrammar is built for the tokenizer's tokens
    only (grammar_vocab_size), the result rank's bitmask is that narrow, and the mask is the one
    the padded vocabulary gives (every padding id disallowed), step after step."""
    import numpy as np
    import torch
    import xgrammar as xgr
    from zpp.frontend.compile_host import grammar_vocab_size
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
        g, _ = _slots(info.serialize_json(), [("k", compiled.serialize_json(), stop)], padded)
        assert g.words == (vocab + 31) // 32
        out = []
        text = tokenizer.encode('{"name": "Anna", "age": 31, "city": "Paris"}') + stop
        for i, t in enumerate(text):
            bits = g.fill(_rows(1), np.array([i])).reshape(-1).view(np.uint8)
            out.append(unpack_bitmask(bits, 1, padded, torch.device("cpu")))
            assert g.accept(_rows(1), [t]) == (([0], []) if i == len(text) - 1 else ([], []))
        masks[vocab] = torch.cat(out)
    wide, narrow = masks.values()
    assert torch.equal(wide, narrow) and bool(narrow[:, 49152:].all())


@pytest.mark.slow
def test_batched_accept_reports_each_refusal(tokenizer, monkeypatch):
    """The result rank's batched accept (xgrammar's C++ array read without converting it, and the
    public wrapper as fallback; one thread and a pool of two from 64 rows): every row's answer, a
    refused token leaves its matcher where it was and ends it (all-ones row, no accept after), the
    others advance."""
    import numpy as np
    import xgrammar as xgr
    from zpp.workers import grammar as wg

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON)).serialize_json()
    stop = [tokenizer.eos_token_id]
    good, bad = tokenizer.encode("{")[0], tokenizer.encode("}")[0]
    quote = tokenizer.encode('"')[0]  # after '{': '"' starts a key, '}' is refused (keys required)
    for raw in (None, False):
        monkeypatch.setattr(wg, "_raw_batch_accept", raw)
        for threads, n in ((1, 3), (2, 70)):
            g, _ = _slots(info.serialize_json(), [("k", compiled, stop)] * n, len(tokenizer), threads)
            assert g.accept(_rows(n), [good] * n) == ([], [])
            stopped, refused = g.accept(_rows(n), [bad if i % 2 == 0 else quote for i in range(n)])
            assert (stopped, refused) == ([], list(range(0, n, 2))), (raw, threads)
            assert g.num_accepted[:n].tolist() == [1 + (i % 2) for i in range(n)]
            assert g.ended[:n].tolist() == [i % 2 == 0 for i in range(n)]
            rows = g.fill(_rows(n), np.array([1 + (i % 2) for i in range(n)]))
            assert (rows[0] == -1).all() and not (rows[1] == -1).all()
            assert g.accept(_rows(n), [tokenizer.encode("name")[0]] * n) == ([], [])  # ended rows are left alone
            assert g.num_accepted[:n].tolist() == [1 + 2 * (i % 2) for i in range(n)]


@pytest.mark.slow
def test_bitmask_fill_threaded_equals_row_by_row(tokenizer):
    """The bitmask: filled on several threads (many-core hosts) or on one (the 2-core machines),
    the bytes are the same, and they follow the matchers as tokens are accepted; a row whose
    matcher has not accepted the tokens before it is an error, never a wrong mask."""
    import asyncio as aio

    import numpy as np
    from zpp.frontend.grammar import GrammarCompiler

    async def compile_all():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 30.0, 1 << 20)
        specs = [await gc.compile(SO(json=s)) for s in (PERSON, BOOK, FLAG, WEATHER)]
        info = gc.tokenizer_info_json
        gc.close()
        return specs, info

    specs, info = aio.run(compile_all())
    grammars = [(specs[i % 4].key, specs[i % 4].compiled, [2]) for i in range(20)]
    one, _ = _slots(info, grammars, 49152, 1)
    many, _ = _slots(info, grammars, 49152, 2)
    text = '{"name": "Anna", "age": 31, "city": "Paris"}'
    person = _rows(20)[::4]
    for step, t in enumerate(tokenizer.encode(text)[:6]):
        needs = np.array([step if i % 4 == 0 else 0 for i in range(20)])
        assert one.fill(_rows(20), needs).tobytes() == many.fill(_rows(20), needs).tobytes()
        for s in person.tolist():  # the PERSON matchers advance: one by one, and batched
            assert one.accept(np.array([s]), [t]) == ([], [])
        assert many.accept(person, [t] * 5) == ([], [])
    assert one.num_accepted[:20].tolist() == many.num_accepted[:20].tolist() == [6, 0, 0, 0] * 5
    with pytest.raises(RuntimeError, match="accepted 6 tokens, but its row samples output token 5"):
        many.fill(_rows(1), np.array([5]))
    # A refused token (a dead end: the stop token of an incomplete object) ends the matcher.
    assert many.accept(_rows(2), [2, tokenizer.encode("{")[0]]) == ([], [0])
    rows = many.fill(np.array([0, 1, 4]), np.array([0, 1, 6]))
    assert (rows[0] == -1).all() and rows[2].tobytes() == one.fill(np.array([4]), np.array([6])).tobytes()
    # Many rows: the accept runs in slices on the threads, with the same outcome.
    ids = tokenizer.encode(text)
    grammars = [(specs[0].key, specs[0].compiled, [2])] * 80
    one, _ = _slots(info, grammars, 49152, 1)
    many, _ = _slots(info, grammars, 49152, 2)
    for step, t in enumerate(ids[:8]):
        toks = [2 if i % 9 == step else t for i in range(80)]  # a few stop tokens: refused mid-object
        assert one.accept(_rows(80), toks) == many.accept(_rows(80), toks)
        needs = one.num_accepted[:80]
        assert one.fill(_rows(80), needs).tobytes() == many.fill(_rows(80), needs).tobytes()
    assert one.num_accepted[:80].tolist() == many.num_accepted[:80].tolist()
    assert many._pool is not None  # the threaded path ran


@pytest.mark.slow
def test_result_rank_matchers_follow_the_slots(tokenizer):
    """The result rank's matchers (zpp.workers.grammar): a request resent with output tokens
    (preemption by recompute, a stage restart) replays them into a fresh matcher (the same mask as
    one fed token by token); a completed grammar reports its stop token once; a freed slot drops
    its matcher (finished, aborted, preempted); a grammar's compiled text is sent once and kept
    under its key until evicted; an unreadable grammar gives an all-ones row and one refusal;
    ``forget`` (stage restart) drops everything."""
    import numpy as np
    import xgrammar as xgr
    from zpp.transport import messages as m

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON)).serialize_json()
    eos = tokenizer.eos_token_id
    text = tokenizer.encode('{"name": "Anna", "age": 31, "city": "Paris"}')
    g, table = _slots(info.serialize_json(), [("k", compiled, [eos]), ("k", "", [eos])], len(tokenizer),
                      outputs={1: text[:5]})
    assert g.num_live == 2 and g.num_accepted[:2].tolist() == [0, 5]  # slot 1 replayed, the grammar kept
    for t in text[:5]:
        g.accept(_rows(1), [t])
    assert g.fill(_rows(1), np.array([5])).tobytes() == g.fill(np.array([1]), np.array([5])).tobytes()
    for t in text[5:]:
        assert g.accept(_rows(2), [t, t]) == ([], [])
    assert g.accept(_rows(2), [eos, eos]) == ([0, 1], [])  # complete: "stop", even with ignore_eos
    assert g.ended[:2].all() and g.accept(_rows(2), [eos, eos]) == ([], [])
    # Slot 0 finishes, slot 1 is preempted and comes back in slot 2 with its outputs; another
    # grammar in slot 0, its compiled text unreadable; "k" is evicted after the batch.
    b = m.BatchBuilder()
    b.new_request(2, "r1", [1] + text[:3], 1, [0], None)
    b.new_request(0, "r2", [1], 1, [0], None)
    batch = b.build(1, freed_slots=[0, 1])
    batch.grammars = [m.GrammarInit(2, "k", [eos]), m.GrammarInit(0, "bad", [eos], "not a grammar")]
    batch.grammar_evict = ["k"]
    table.apply(batch)
    g.apply(batch, table)
    assert g.matchers[1] is None and not g.constrained[1] and g.num_live == 2
    assert g.num_accepted[2] == 3 and not g.ended[2] and "k" not in g._compiled
    assert (g.fill(np.array([0]), np.array([0])) == -1).all()
    assert g.accept(np.array([0, 2]), [text[0], text[3]]) == ([], [0])  # the unreadable one: refused, once
    assert g.accept(np.array([0, 2]), [text[0], text[4]]) == ([], [])
    batch = m.BatchBuilder().build(2, freed_slots=[0, 2])
    table.apply(batch)
    g.apply(batch, table)
    assert g.num_live == 0 and not g.constrained.any() and g.matchers == [None] * len(g.matchers)
    b = m.BatchBuilder()  # "k" without its text after its eviction (never done by the core): unreadable
    b.new_request(1, "r3", [1], 1, [0], None)
    batch = b.build(3)
    batch.grammars = [m.GrammarInit(1, "k", [eos])]
    table.apply(batch)
    g.apply(batch, table)
    assert g.unreadable[1] and g.matchers[1] is None
    g.forget()
    assert g.num_live == 0 and g._tokenizer_info is None and not g._compiled


def test_core_sends_each_grammar_once_per_key(monkeypatch):
    """The core's side (GrammarSender): the tokenizer info with the first grammar, a grammar's
    compiled text with the first request of its key, an eviction named when its LRU mirror (the
    result rank's cache) overflows, never a key the same batch sends; all again after a restart."""
    from zpp.engine import structured_output as so
    from zpp.transport.core_messages import GrammarSpec

    monkeypatch.setattr(so, "_CACHE_ENTRIES", 2)
    s = so.GrammarSender()
    spec = {k: GrammarSpec(k, "compiled-" + k, "info" if k == "a" else "") for k in "abc"}
    for k in "abc":
        s.check(spec[k])
    assert s.tokenizer_info == "info" and s.batch_fields([]) == {}
    f = s.batch_fields([(0, spec["a"], [2]), (1, spec["a"], [2, 5])])
    assert f["grammar_tokenizer"] == "info" and [(g.slot, g.compiled, g.stop_token_ids) for g in f["grammars"]] \
        == [(0, "compiled-a", [2]), (1, "", [2, 5])] and "grammar_evict" not in f
    f = s.batch_fields([(2, spec["b"], [2]), (3, spec["a"], [2])])
    assert "grammar_tokenizer" not in f and [g.compiled for g in f["grammars"]] == ["compiled-b", ""]
    f = s.batch_fields([(4, spec["c"], [2])])  # b is the least recently used
    assert f["grammar_evict"] == ["b"] and f["grammars"][0].compiled == "compiled-c"
    # Three keys through a cache of two in one batch: each sent with its text; the result rank
    # evicts after the batch's grammars, so only the key the mirror dropped last is named.
    f = s.batch_fields([(5, spec["b"], [2]), (6, spec["a"], [2]), (7, spec["c"], [2])])
    assert [g.compiled for g in f["grammars"]] == ["compiled-b", "compiled-a", "compiled-c"]
    assert f["grammar_evict"] == ["b"] and list(s._keys) == ["a", "c"]
    s.reset()
    f = s.batch_fields([(0, spec["a"], [2])])
    assert f["grammar_tokenizer"] == "info" and f["grammars"][0].compiled == "compiled-a"
    with pytest.raises(RuntimeError, match="before the front end's tokenizer info"):
        so.GrammarSender().check(spec["b"])


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


async def _children_become(host_pid: int, want, within: float) -> list[int]:
    """Poll the compile host's children until ``want(children)`` holds or ``within`` seconds
    pass (a margin for a loaded 2-core machine, not a sleep: it returns as soon as it holds);
    returns the last list seen, for the caller's assert."""
    import asyncio as aio
    import time
    deadline = time.monotonic() + within
    while not want(kids := _compile_children(host_pid)) and time.monotonic() < deadline:
        await aio.sleep(0.05)
    return kids


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
        # The killed compiles are reaped before their refusal is sent; the third's compile (if it
        # started when the slots freed) ends at its own 2 s limit or its drop: allow that, plus load.
        assert await _children_become(host, lambda k: k == [], 2.0 + 3.0) == [], \
            "a compile process outlived its timeout"
        t = time.monotonic()
        with pytest.raises(RequestError, match="it timed out before: not compiled again"):
            await gc.compile(SO(json=slow_schema(tag="a")))
        assert time.monotonic() - t < 0.1
        t = time.monotonic()
        gone = aio.ensure_future(gc.compile(SO(json=slow_schema(tag="d"))))
        assert len(await _children_become(host, lambda k: len(k) == 1, 1.5)) == 1
        gone.cancel()  # the client went away
        assert await _children_become(host, lambda k: k == [], 1.9 - (time.monotonic() - t)) == [], \
            "a compile nobody waits for still runs"
        # gone before its 2 s limit (counted from its fork, after t): killed for the drop, not the time
        assert time.monotonic() - t < 2.0
        gc.close()
        from helpers import alive
        deadline = time.monotonic() + 2.0
        while alive(host) and time.monotonic() < deadline:
            await aio.sleep(0.05)
        assert not alive(host)

    aio.run(go())


@pytest.mark.slow
def test_compile_host_death_is_logged_by_its_cause_and_the_next_compile_respawns_it(tokenizer, caplog):
    """The compile host ended by SIGTERM (a signal to the server's whole process group, as `timeout`
    or a service manager sends it) is logged at INFO, not as a WARNING; killed otherwise, WARNING.
    Either way the next compile starts a new host (one compiler: SIGTERM, then the respawned host
    SIGKILLed)."""
    import asyncio as aio
    import logging
    import os
    import signal
    import time

    from zpp.frontend.grammar import GrammarCompiler

    async def go():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 5.0, 1 << 20)
        await gc.compile(SO(choice=["warm", "up"]))
        for sig, level, choice in (("SIGTERM", "INFO", ["yes", "no"]), ("SIGKILL", "WARNING", ["up", "down"])):
            host = gc.host_pid
            caplog.clear()
            died = lambda: [r for r in caplog.records if "grammar compile process exited" in r.getMessage()]
            with caplog.at_level(logging.INFO, logger="zpp"):
                os.kill(host, getattr(signal, sig))
                deadline = time.monotonic() + 5.0  # the front end notices the host's exit: a wait, not a sleep
                while not died() and time.monotonic() < deadline:
                    await aio.sleep(0.05)
                await aio.sleep(0.2)  # a second (wrong) record would come right after the first
            records = died()
            assert [r.levelname for r in records] == [level], (sig, [(r.levelname, r.getMessage()) for r in records])
            assert (await gc.compile(SO(choice=choice))).compiled
            assert gc.host_pid not in (None, host), sig
        gc.close()

    aio.run(go())


def small_slow_schema(n: int) -> dict:
    """A schema of about 117 bytes that takes xgrammar seconds to compile (longer as ``n`` grows):
    size does not tell a slow grammar."""
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": f"([a-z0-9]{{1,100}}x){{1,{n}}}"}},
            "required": ["a"]}


@pytest.mark.slow
def test_small_but_slow_specs_do_not_starve_a_later_request(tokenizer):
    """Three small specifications that compile slowly hold every slot (both general ones and the
    small one); a ``choice`` sent after them still compiles within about a second: a compile gives
    its slot up after ``YOUNG_S`` and runs on below younger ones (the newcomer's case: it waited
    9.4 s). The slow ones are still killed at their timeout."""
    import asyncio as aio
    import time

    from zpp.frontend.compile_host import YOUNG_S
    from zpp.frontend.grammar import GrammarCompiler

    async def go():
        gc = GrammarCompiler(tokenizer, 49152, {2}, 4.0, 1 << 20)
        await gc.compile(SO(choice=["warm", "up"]))  # starts the host (not counted in any timeout)
        host = gc.host_pid
        slow = [aio.ensure_future(gc.compile(SO(json=small_slow_schema(n)))) for n in (80, 81, 82)]
        assert len(await _children_become(host, lambda k: len(k) == 3, 2.0)) == 3
        t = time.monotonic()
        assert (await gc.compile(SO(choice=["yes", "no", "maybe"]))).compiled
        took = time.monotonic() - t
        assert took < YOUNG_S + 1.0, f"a small choice waited {took:.1f} s behind slow grammars"
        for f in slow:
            with pytest.raises(RequestError, match=r"did not compile within 4 s"):
                await f
        assert await _children_become(host, lambda k: k == [], 3.0) == [], "a compile process outlived its timeout"
        gc.close()
        return took

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
NAMED_Q = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    return shared_pp2_server


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


class Person(BaseModel):
    name: str
    age: int


ISSUE_51 = {"messages": [{"role": "user", "content": "Tell me about Paris"}], "temperature": 0,
            "max_completion_tokens": 200, "response_format": {"type": "json_schema", "json_schema": {
                "name": "City", "schema": {"type": "object", "properties": {"name": {"type": "string"},
                                                                           "country": {"type": "string"}},
                                           "required": ["name", "country"]}, "strict": True}}}


@pytest.mark.slow
def test_issue_request_json_ends(server):
    """Issue 51's request (its JSON ran 200 tokens into newlines, finish "length"): with the default
    whitespace bound it ends with valid JSON and "stop" well inside 200 tokens, in chat and in
    /v1/responses, streamed and not (the four at once: one batch). Compact JSON next to a
    response_format (``structured_outputs.disable_any_whitespace``) is tested in-process
    (tests/server/test_json_whitespace.py)."""
    schema = ISSUE_51["response_format"]["json_schema"]["schema"]
    fmt = {"format": {"type": "json_schema", "name": "City", "schema": schema, "strict": True}}
    responses = dict(model=MODEL, input="Tell me about Paris", temperature=0, max_output_tokens=200, text=fmt)

    async def go():
        c = _client(server)

        async def chat_stream():
            return [ch async for ch in await c.chat.completions.create(model=MODEL, stream=True, **ISSUE_51)]

        async def responses_stream():
            return [e async for e in await c.responses.create(stream=True, **responses)]

        r, chunks, resp, events = await asyncio.gather(c.chat.completions.create(model=MODEL, **ISSUE_51),
                                                       chat_stream(), c.responses.create(**responses),
                                                       responses_stream())
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 100, (r.usage, text)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
        assert resp.status == "completed" and resp.output_text == text and resp.usage.output_tokens < 100
        done = [e for e in events if e.type == "response.completed"]
        assert done and done[0].response.status == "completed" and done[0].response.output_text == text
    asyncio.run(go())


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
        for r, reason in ((forced, "tool_calls"), (named, "stop")):  # a named call: "stop", as OpenAI
            ch = r.choices[0]
            assert ch.finish_reason == reason and ch.message.content is None, ch
            for call in ch.message.tool_calls:
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
        for (calls, finish), reason in zip(streams, ("tool_calls", "stop")):  # required, named
            assert finish == reason and calls
            for call in calls.values():
                tool = next(t for t in TOOLS if t["function"]["name"] == call["name"])
                jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])
        assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
        assert re.fullmatch(PHONE, regex.choices[0].text) and regex.choices[0].finish_reason == "stop"

    asyncio.run(go())


async def _stream_tool_calls(c: AsyncOpenAI, tool_choice, **kw) -> tuple[dict, str]:
    """Stream a tools request; returns ({index: {"name", "arguments"}}, finish reason), checking that
    each call's id, type and name come in its first delta and only arguments after."""
    calls: dict[int, dict] = {}
    finish = None
    stream = await c.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=tool_choice,
                                             temperature=0, max_tokens=60, stream=True, **kw)
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


ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
    "additionalProperties": False}}}


@pytest.mark.slow
def test_forced_tool_call_wins_over_response_format(server):
    """pydantic-ai's NativeOutput with a forced tool sends tool_choice "required" (or a named
    function) with a response_format: the call's grammar wins (as in vLLM; OpenAI accepts the
    pair) and response_format is ignored for the request, so the calls, streamed or not, are those
    of the same request without it."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go():
        c = _client(server)
        kw = dict(model=MODEL, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=60)
        out = {}
        for choice in ("required", named):
            out[str(choice)] = await asyncio.gather(
                c.chat.completions.create(**kw, tool_choice=choice),
                c.chat.completions.create(**kw, tool_choice=choice, response_format=ANSWER_FORMAT),
                c.chat.completions.create(**kw, tool_choice=choice, response_format={"type": "json_object"}),
                _stream_tool_calls(c, choice, response_format=ANSWER_FORMAT))
        return out

    for choice, (plain, schema, obj, (streamed, finish)) in asyncio.run(go()).items():
        calls = [(t.function.name, t.function.arguments) for t in plain.choices[0].message.tool_calls]
        assert calls and calls[0][0] == "get_weather", choice
        reason = "tool_calls" if choice == "required" else "stop"  # a named function's call: "stop"
        for r in (plain, schema, obj):
            ch = r.choices[0]
            assert ch.finish_reason == reason and ch.message.content is None, (choice, ch)
            assert [(t.function.name, t.function.arguments) for t in ch.message.tool_calls] == calls, choice
        assert finish == reason and [(v["name"], v["arguments"]) for v in streamed.values()] == calls, choice


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
    # vLLM's explicit constraints do not give way to a forced call (response_format does)
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"json_object": True}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED_Q, "guided_json": {"type": "object"}}, "tool_choice"),
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
    finish_reason "length"; a complete one (20: the call ends before) is the call with finish "stop"
    (OpenAI's for a forced function); a cut-off ``required`` output (8, 15, 20) is content in both
    modes. (A complete ``required`` call, streamed and not: test_forced_tool_call_wins_over_response_format.)"""
    async def go():
        c = _client(server)
        cases = [(mode, n, stream) for mode in ("tools-named", "tools-required") for n in (8, 15, 20)
                 for stream in (False, True)]
        got = await asyncio.gather(*(_shape(c, stream, **_kw({**SHAPE_MODES[mode], "max_tokens": n}))
                                     for mode, n, stream in cases))
        res = dict(zip(cases, got))
        for mode in ("tools-named", "tools-required"):
            for n in (8, 15, 20):
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
        content, calls, finish = res["tools-named", 20, False]
        assert finish == "stop" and calls[0][0] == "get_weather"
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
            if end == "stop string":  # a call cut by a stop string is not a whole call: "stop", not "tool_calls"
                assert plain[2] == "stop", (mode, plain)
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
