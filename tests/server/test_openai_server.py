"""The OpenAI API through the official ``openai`` client against one live ``zpp serve`` at
--pipeline-parallel-size 2 (the real SmolLM2 weights, CPU), shared by every test of this module
(and by the other modules on the ``shared_pp2_server`` fixture)."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from helpers import parse_metrics

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# Prompts for which SmolLM2 greedily answers with emoji / CJK characters (byte-level BPE splits
# each of them over 2-4 tokens).
EMOJI = [{"role": "user", "content": "Give me a list of 5 fruit emojis."}]
PARTY = [{"role": "user", "content": "Use emojis to describe a party 🎉"}]
CHINESE = [{"role": "user", "content": "Translate into Chinese: I love my family."}]
JAPANESE = [{"role": "user", "content": "Translate 'good morning' into Japanese."}]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    return shared_pp2_server


def client(server, **kw) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


async def scrape(server) -> dict[str, float]:
    """The /metrics samples as {'name{labels}': value} (without the model_name label)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            assert r.status == 200
            return parse_metrics(await r.text())


def non_ascii(text: str) -> int:
    return sum(ord(ch) >= 0x2E80 for ch in text)  # CJK, kana, hangul, emoji, ...


# --- models, health, version -------------------------------------------------------------------
@pytest.mark.slow
def test_models_health_version(server):
    async def go():
        c = client(server)
        models = await c.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert (await c.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("no-such-model")
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
            async with s.get(server.url + "/version") as r:
                assert "version" in await r.json()
    run(go())


# --- /v1/completions ---------------------------------------------------------------------------
@pytest.mark.slow
def test_completion_prompt_forms_and_exact_usage(server, tokenizer):
    texts = ["The capital of France is", "One, two, three,"]
    ids = [tokenizer.encode(t) for t in texts]

    async def go():
        c = client(server)
        kw = dict(model=MODEL, max_tokens=6, temperature=0)
        r_str, r_strs, r_ids, r_idss = await asyncio.gather(
            c.completions.create(prompt=texts[0], **kw), c.completions.create(prompt=texts, **kw),
            c.completions.create(prompt=ids[0], **kw), c.completions.create(prompt=ids, **kw))
        return r_str, r_strs, r_ids, r_idss

    r_str, r_strs, r_ids, r_idss = run(go())
    assert r_str.object == "text_completion" and r_str.model == MODEL
    assert len(r_str.choices) == 1 and len(r_ids.choices) == 1
    assert len(r_strs.choices) == 2 and len(r_idss.choices) == 2
    # A string and its token ids give the same (greedy) completion.
    assert r_str.choices[0].text == r_ids.choices[0].text == r_strs.choices[0].text == r_idss.choices[0].text
    assert r_strs.choices[1].text == r_idss.choices[1].text
    assert " Paris" in r_str.choices[0].text
    assert [ch.index for ch in r_strs.choices] == [0, 1]
    for r, plens in ((r_str, [len(ids[0])]), (r_ids, [len(ids[0])]), (r_strs, map(len, ids)), (r_idss, map(len, ids))):
        assert all(ch.finish_reason == "length" for ch in r.choices)
        n_prompt = sum(plens)
        assert r.usage.prompt_tokens == n_prompt
        assert r.usage.completion_tokens == 6 * len(r.choices)
        assert r.usage.total_tokens == n_prompt + 6 * len(r.choices)


@pytest.mark.slow
def test_completion_n_choices_are_prompt_major(server, tokenizer):
    prompts = ["Apples are", "The ocean is"]
    plen = sum(len(tokenizer.encode(p)) for p in prompts)

    async def go():
        return await client(server).completions.create(
            model=MODEL, prompt=prompts, n=3, max_tokens=4, temperature=1.0, seed=7, echo=True)

    r = run(go())
    assert [ch.index for ch in r.choices] == list(range(6))
    for ch in r.choices:
        assert ch.text.startswith(prompts[ch.index // 3])  # choice index = prompt index * n + j
    assert r.usage.completion_tokens == 6 * 4
    assert r.usage.prompt_tokens == plen  # each prompt once, whatever n


@pytest.mark.slow
def test_completion_echo_and_logprobs(server, tokenizer):
    prompt = "The capital of France is"
    plen = len(tokenizer.encode(prompt))

    async def go():
        c = client(server)
        full = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                          echo=True, logprobs=3)
        gen = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
        score = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        return full, gen, score

    full, gen, score = run(go())
    ch = full.choices[0]
    lp = ch.logprobs
    assert ch.text.startswith(prompt) and ch.text == prompt + gen.choices[0].text
    assert len(lp.tokens) == plen + 5 and "".join(lp.tokens) == ch.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i in range(1, len(lp.tokens)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert len(top) <= 4 and lp.token_logprobs[i] <= 0
    for i in range(plen, plen + 5):  # greedy: every generated token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-5)
    # logprobs=0: the chosen token only; the same numbers as with echo.
    g = gen.choices[0].logprobs
    assert all(len(t) == 1 for t in g.top_logprobs)
    assert g.token_logprobs == pytest.approx(lp.token_logprobs[plen:], abs=1e-4)
    # echo + max_tokens 0 scores the prompt: its logprobs, nothing generated.
    s = score.choices[0]
    assert s.text == prompt and score.usage.completion_tokens == 0 and s.finish_reason == "length"
    assert s.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:plen], abs=1e-4)


@pytest.mark.slow
def test_completion_stream_matches_non_stream_with_usage(server):
    prompts = ["Once upon a time", "def fibonacci(n):"]

    async def go():
        c = client(server)
        kw = dict(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.7, seed=3)
        ref = await c.completions.create(**kw)
        stream = await c.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
        chunks = [ch async for ch in stream]
        return ref, chunks

    ref, chunks = run(go())
    texts, finishes = {}, {}
    for ch in chunks[:-1]:
        assert ch.usage is None and len(ch.choices) == 1
        c = ch.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finishes.setdefault(c.index, []).append(c.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}  # exactly one finish per choice
    assert texts == {ch.index: ch.text for ch in ref.choices}  # seeded sampling: the same text
    last = chunks[-1]
    assert last.choices == [] and last.usage == ref.usage
    assert ref.usage.completion_tokens == 4 * 8


@pytest.mark.slow
def test_completion_suffix_and_best_of_rejected(server):
    async def go():
        c = client(server)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="def f(", suffix="return 1", max_tokens=4)
        assert e.value.body["param"] == "suffix" and "suffix" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="x", best_of=3, max_tokens=4)
        assert e.value.body["param"] == "best_of"
    run(go())


@pytest.mark.slow
def test_completion_stop_strings_and_tokens(server, tokenizer):
    async def go():
        c = client(server)
        base = await c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
        text = base.choices[0].text
        assert " 7" in text
        cut = await c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0,
                                         stop=[" 7"])
        assert cut.choices[0].text == text[:text.index(" 7")]
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_dump()["stop_reason"] == " 7"
        # Streamed, a possible start of the stop string (the "," of ", 7", one token before " 7") is
        # held back, never sent and taken back.
        kw = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[", 7"])
        whole = await c.completions.create(**kw)
        deltas = [ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)]
        assert whole.choices[0].text == text[:text.index(", 7")]
        assert "".join(deltas) == whole.choices[0].text and not any("," in d for d in deltas)
        comma = tokenizer.encode(",")[0]
        tok = await c.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0,
                                         extra_body={"stop_token_ids": [comma]})
        assert tok.choices[0].finish_reason == "stop" and tok.choices[0].model_dump()["stop_reason"] == comma
        assert tok.choices[0].text == text[:text.index(",")]  # the stop token's text is not returned
    run(go())


@pytest.mark.slow
def test_stop_string_on_the_length_token(server):
    """A stop string completed by the token that reaches max_tokens ends the choice with "stop" and
    the string (stop conditions before the length limit, as vLLM), streamed and not."""
    async def go():
        c = client(server)
        kw = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0)
        toks = (await c.completions.create(max_tokens=12, logprobs=0, **kw)).choices[0].logprobs.tokens
        k = next(i for i in range(1, len(toks) + 1) if " 7" in "".join(toks[:i]))
        text = "".join(toks[:k])
        kw.update(max_tokens=k, stop=[" 7"])
        whole = (await c.completions.create(**kw)).choices[0]
        chunks = [ch.choices[0] async for ch in await c.completions.create(stream=True, **kw)]
        return text, whole, chunks

    text, whole, chunks = run(go())
    assert whole.text == text[:text.index(" 7")]
    assert (whole.finish_reason, whole.model_dump()["stop_reason"]) == ("stop", " 7")
    assert "".join(ch.text for ch in chunks) == whole.text
    last = chunks[-1]
    assert (last.finish_reason, last.model_dump()["stop_reason"]) == ("stop", " 7")
    assert all(ch.finish_reason is None for ch in chunks[:-1])


@pytest.mark.slow
def test_streamed_chunks_carry_whole_tokens_with_stop_strings_and_logprobs(server):
    """Issue 38: streamed with stop strings and logprobs, a chunk used to end inside a token (its
    text ``' capit'``, the next ``'al of France'``: a possible start of a stop string was held back
    by characters), so its logprobs did not match its text. Now, on both endpoints with n=2 and
    greedy sampling: every chunk's text is exactly the text of the tokens its logprobs list (a
    held-back token goes out whole with the next chunk), the joined text and tokens equal the
    non-streamed ones, and the last chunk of a stop string ending mid-token stops at the stop
    string while listing that whole token, as vLLM does."""
    cases = {  # greedy outputs: ", the city of Nova Haven was a thriving metropolis, ..." and
        # "The capital of France is Paris."; the first stop string is held ("ty", "al" ...) then
        # released, the second ends inside a token (" metropolis", " Paris")
        "completions": dict(prompt="Once upon a time", stop=["ty of Mars", "metrop"], logprobs=1),
        "chat": dict(messages=FRANCE, stop=["al of Germ", "Par"], logprobs=True, top_logprobs=1)}

    async def go():
        c = client(server)
        out = {}
        for path, kw in cases.items():
            api = c.completions if path == "completions" else c.chat.completions
            kw = dict(model=MODEL, temperature=0, max_tokens=24, n=2, **kw)
            out[path] = (await api.create(**kw), [ch async for ch in await api.create(stream=True, **kw)])
        return out

    for path, (whole, chunks) in run(go()).items():
        for ref in whole.choices:
            assert ref.finish_reason == "stop" and ref.model_dump()["stop_reason"] == cases[path]["stop"][1]
            mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == ref.index]
            pieces = []  # (text, [token strings]) of each chunk with content
            for ch in mine:
                text = ch.text if path == "completions" else ch.delta.content or ""
                if ch.logprobs is None:
                    assert not text, (path, ch)
                    continue
                toks = ch.logprobs.tokens if path == "completions" else [t.token for t in ch.logprobs.content]
                pieces.append((text, toks))
                if path == "completions":  # offsets count the choice's characters
                    start = sum(len(t) for t, _ in pieces[:-1])
                    assert ch.logprobs.text_offset == [start + sum(map(len, toks[:j])) for j in range(len(toks))]
            for text, toks in pieces[:-1]:
                assert text == "".join(toks), (path, text, toks)
            assert any(len(toks) > 1 for _, toks in pieces[:-1]), "a held-back token went out with the next"
            last_text, last_toks = pieces[-1]
            rest = "".join(last_toks)
            assert rest.startswith(last_text) and rest[len(last_text):].startswith(cases[path]["stop"][1])
            ref_text = ref.text if path == "completions" else ref.message.content
            ref_toks = ref.logprobs.tokens if path == "completions" else [t.token for t in ref.logprobs.content]
            assert "".join(t for t, _ in pieces) == ref_text and ref_text.endswith(" ")
            assert sum((toks for _, toks in pieces), []) == ref_toks
            assert mine[-1].finish_reason == "stop" and mine[-1].model_dump()["stop_reason"] == cases[path]["stop"][1]


# --- /v1/chat/completions ----------------------------------------------------------------------
@pytest.mark.slow
def test_chat_uses_template_without_double_bos(server, tokenizer):
    msgs = [{"role": "system", "content": "You are a geography teacher."},
            {"role": "user", "content": "Name a country in Europe."},
            {"role": "assistant", "content": "France."},
            {"role": "user", "content": "What is the capital of France?"}]

    async def go():
        c = client(server)
        return await asyncio.gather(
            c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_completion_tokens=20),
            c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=20))

    simple, multi = run(go())
    assert simple.object == "chat.completion"
    m = simple.choices[0].message
    assert m.role == "assistant" and m.content == "The capital of France is Paris."
    assert simple.choices[0].finish_reason == "stop"
    # The template writes every <|im_start|> (SmolLM2's BOS) itself: default system, user, assistant.
    expect = tokenizer.encode(tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    assert expect.count(tokenizer.bos_token_id) == 3 and expect[1] != tokenizer.bos_token_id
    assert simple.usage.prompt_tokens == len(expect)
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert multi.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert multi.choices[0].message.content


@pytest.mark.slow
def test_chat_max_completion_tokens_and_n(server):
    async def go():
        return await client(server).chat.completions.create(
            model=MODEL, messages=FRANCE, n=2, temperature=1.0, seed=11, max_completion_tokens=3,
            extra_body={"ignore_eos": True})

    r = run(go())
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 6


@pytest.mark.slow
def test_whole_floats_accepted_for_integer_fields(server):
    """As vLLM (pydantic): a float with no fractional part is an integer (``max_tokens: 5.0`` runs
    5 tokens) in both endpoints; ``5.5`` is still a 400 naming the field."""
    async def go():
        async with aiohttp.ClientSession() as s:
            status, r = await _post(s, server, "/v1/completions", {
                "prompt": "The capital of France is", "max_tokens": 5.0, "n": 2.0, "seed": 7.0, "logprobs": 2.0,
                "temperature": 0, "ignore_eos": True})
            assert status == 200, r
            assert [len(c["logprobs"]["tokens"]) for c in r["choices"]] == [5, 5]
            assert [len(c["logprobs"]["top_logprobs"][0]) for c in r["choices"]] == [2, 2]
            assert r["usage"]["completion_tokens"] == 10
            status, r = await _post(s, server, "/v1/chat/completions", {
                "messages": FRANCE, "max_completion_tokens": 3.0, "logprobs": True, "top_logprobs": 2.0,
                "temperature": 0, "ignore_eos": True, "min_tokens": 3.0, "top_k": 5.0})
            assert status == 200, r
            assert r["usage"]["completion_tokens"] == 3
            assert [len(t["top_logprobs"]) for t in r["choices"][0]["logprobs"]["content"]] == [2, 2, 2]
            for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 5.5}),
                               ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 5.5})]:
                status, r = await _post(s, server, path, body)
                assert status == 400 and r["error"]["param"] == "max_tokens", r
    run(go())


def test_integer_fields_take_whole_floats_only():
    """Every integer field of the request structs (no server needed): 3.0 decodes to the int 3,
    3.5, "3" and true are refused naming the field, and the bounds still hold (``n`` 129.0)."""
    from zpp.server.http_body import decode_request
    from zpp.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ProtocolError
    comp = {"max_tokens": 3.0, "n": 3.0, "seed": 3.0, "top_k": 3.0, "min_tokens": 3.0, "prompt_logprobs": 3.0,
            "logprobs": 3.0, "best_of": 3.0}
    chat = {"max_tokens": 3.0, "max_completion_tokens": 3.0, "top_logprobs": 3.0, "n": 3.0, "seed": 3.0}
    cases = [(CompletionRequest, {"prompt": "x"}, comp), (ChatCompletionRequest, {"messages": []}, chat)]
    for kind, base, fields in cases:
        req = decode_request(json.dumps({**base, **fields}).encode(), kind)
        for name in fields:
            assert getattr(req, name) == 3 and type(getattr(req, name)) is int, name
        for name in fields:
            for bad in (3.5, "3", True):
                with pytest.raises(ProtocolError) as e:
                    decode_request(json.dumps({**base, name: bad}).encode(), kind)
                assert e.value.param == name, (name, bad)
        for name, value in [("n", 129.0), ("n", 0.0), ("seed", 2.0 ** 64)]:
            with pytest.raises(ProtocolError) as e:
                decode_request(json.dumps({**base, name: value}).encode(), kind)
            assert e.value.param == name
    req = decode_request(b'{"prompt": "x", "stop_token_ids": [1.0, 2]}', CompletionRequest)
    assert req.stop_token_ids == [1, 2] and all(type(t) is int for t in req.stop_token_ids)
    assert [type(t) for t in decode_request(b'{"tokens": [5.0]}', DetokenizeRequest).tokens] == [int]


@pytest.mark.slow
def test_chat_logprobs(server):
    async def go():
        return await client(server).chat.completions.create(
            model=MODEL, messages=EMOJI, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)

    r = run(go())
    content = r.choices[0].logprobs.content
    text = r.choices[0].message.content
    assert len(content) == r.usage.completion_tokens == 12
    for item in content:
        assert len(item.top_logprobs) == 3
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.token == item.top_logprobs[0].token  # greedy
        assert item.logprob == pytest.approx(values[0], abs=1e-5)
    # The bytes of consecutive tokens join into the text, even where a character is split.
    joined = bytes(b for item in content for b in item.bytes)
    assert joined.decode("utf-8", errors="replace") == text
    assert non_ascii(text) > 0 and any("\ufffd" in item.token for item in content)


def _collect_chat(chunks):
    """Per choice: (joined content, finish reasons); checks the role / [DONE]-free chunk shape."""
    text, finishes, roles = {}, {}, {}
    for ch in chunks:
        assert ch.object == "chat.completion.chunk"
        for c in ch.choices:
            if c.delta.role is not None:
                roles.setdefault(c.index, []).append(c.delta.role)
                assert c.index not in text, "the role comes in the choice's first chunk"
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return text, finishes, roles


@pytest.mark.slow
def test_continuous_usage_stats_in_every_chunk(server):
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk with
    choices carries the usage so far, completion tokens never decrease and end at the final
    usage; an unknown ``stream_options`` key is refused (it was silently ignored)."""
    async def go():
        c = client(server)
        out = {}
        for path, kw in (("completions", dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)),
                         ("chat", dict(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0))):
            api = c.completions if path == "completions" else c.chat.completions
            stream = await api.create(stream=True, stream_options={"include_usage": True,
                                                                   "continuous_usage_stats": True}, **kw)
            out[path] = [ch async for ch in stream]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True, "bogus": 1})
        assert "bogus" in str(e.value)
        return out

    for path, chunks in run(go()).items():
        body, last = chunks[:-1], chunks[-1]
        assert body and all(ch.usage is not None for ch in body), path
        done = [ch.usage.completion_tokens for ch in body]
        assert done == sorted(done) and done[-1] == last.usage.completion_tokens, (path, done)
        assert 1 <= done[-1] <= 8 and done[0] < done[-1], (path, done)
        assert {ch.usage.prompt_tokens for ch in body} == {last.usage.prompt_tokens}, path


@pytest.mark.slow
def test_chat_stream_matches_non_stream(server):
    async def go():
        c = client(server)
        kw = dict(model=MODEL, messages=FRANCE, temperature=0.8, seed=5, n=2, max_tokens=16)
        ref = await c.chat.completions.create(**kw)
        chunks = [ch async for ch in await c.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw)]
        return ref, chunks

    ref, chunks = run(go())
    text, finishes, roles = _collect_chat(chunks[:-1])
    assert roles == {0: ["assistant"], 1: ["assistant"]}
    assert text == {c.index: c.message.content for c in ref.choices}
    assert finishes == {c.index: [c.finish_reason] for c in ref.choices}
    assert all(f in ("stop", "length") for fs in finishes.values() for f in fs)
    assert chunks[-1].choices == [] and chunks[-1].usage == ref.usage


@pytest.mark.slow
def test_raw_sse_ends_with_done(server):
    async def go():
        body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                raw = (await r.read()).decode()
        events = [e for e in raw.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]" and raw.count("[DONE]") == 1
        payloads = [json.loads(e[6:]) for e in events[:-1]]
        assert sum(c["finish_reason"] is not None for p in payloads for c in p["choices"]) == 1
    run(go())


@pytest.mark.slow
@pytest.mark.parametrize("messages", [EMOJI, PARTY, CHINESE, JAPANESE], ids=["emoji", "party", "chinese", "japanese"])
def test_multibyte_stream_equals_non_stream(server, tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def go():
        c = client(server)
        kw = dict(model=MODEL, temperature=0, max_tokens=24)
        chat_ref, chat_stream, cmpl_ref, cmpl_stream = await asyncio.gather(
            c.chat.completions.create(messages=messages, **kw),
            c.chat.completions.create(messages=messages, stream=True, **kw),
            c.completions.create(prompt=prompt, **kw),
            c.completions.create(prompt=prompt, stream=True, **kw))
        return chat_ref, [x async for x in chat_stream], cmpl_ref, [x async for x in cmpl_stream]

    chat_ref, chat_chunks, cmpl_ref, cmpl_chunks = run(go())
    ref = chat_ref.choices[0].message.content
    assert non_ascii(ref) >= 3, f"expected emoji/CJK output, got {ref!r}"
    chat_deltas = [c.delta.content for ch in chat_chunks for c in ch.choices if c.delta.content]
    cmpl_deltas = [c.text for ch in cmpl_chunks for c in ch.choices if c.text]
    assert "".join(chat_deltas) == ref
    assert cmpl_ref.choices[0].text == ref and "".join(cmpl_deltas) == ref
    # No piece of a character is ever sent on its own: a U+FFFD can only be a character cut by
    # max_tokens at the very end.
    for deltas in (chat_deltas, cmpl_deltas):
        assert all("\ufffd" not in d for d in deltas[:-1])
        assert "\ufffd" not in deltas[-1][:-1]


# --- errors ------------------------------------------------------------------------------------
MALFORMED = [
    # (path, body: dict or raw bytes, expected status, expected param or None)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": -2}, 400,
     "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "priority": -3}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "request_id": ""}, 400, "request_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "request_id": "a\nb"}, 400,
     "request_id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -7}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, -1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [49152]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", 7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 1024}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": -2}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": 10 ** 6}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "chat_template_kwargs": 3}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": FRANCE, "chat_template": "{% for %}"}, 400, "chat_template"),
    ("/v1/chat/completions", {"messages": FRANCE, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": FRANCE, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": FRANCE, "tools": [{"type": "retrieval"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": FRANCE, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/no-such-route", {}, 404, None),
]


@pytest.mark.slow
def test_malformed_requests_get_openai_errors_and_server_keeps_serving(server):
    assert len(MALFORMED) >= 25

    async def go():
        async with aiohttp.ClientSession() as s:
            for path, body, status, param in MALFORMED:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with s.post(server.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    got = await r.json()
                    assert r.status == status, (path, body, got)
                err = got["error"]
                assert set(err) == {"message", "type", "param", "code"}, got
                assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
                if param is not None:
                    assert err["param"] == param, (body, got)
            async with s.get(server.url + "/v1/completions") as r:
                assert r.status == 405 and "error" in await r.json()
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
        r = await client(server).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3

    run(go())


@pytest.mark.slow
def test_client_errors_through_the_official_client(server):
    async def go():
        c = client(server)
        with pytest.raises(openai.NotFoundError) as e:
            await c.chat.completions.create(model="gpt-4o", messages=FRANCE)
        assert e.value.status_code == 404 and e.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="hi", temperature=-1)
        assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model=MODEL, messages=FRANCE, max_completion_tokens=2000)
        assert "max_model_len" in e.value.body["message"]
    run(go())


# --- abort on disconnect, metrics --------------------------------------------------------------
async def _wait_metrics(server, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(server)
        if pred(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_disconnect_aborts_and_frees_kv(server):
    aborted = 'zpp:request_success_total{finished_reason="abort"}'

    async def go():
        idle = await _wait_metrics(server, lambda m: m["zpp:num_requests_running"] == 0)
        assert idle["zpp:num_requests_running"] == 0 and idle["zpp:num_requests_waiting"] == 0
        idle_kv, aborts0 = idle["zpp:kv_cache_usage_perc"], idle.get(aborted, 0.0)
        c = client(server)
        kw = dict(model=MODEL, temperature=0, stream=True, extra_body={"ignore_eos": True})
        keep = [await c.completions.create(prompt=f"Story number {i}:", max_tokens=40, **kw) for i in range(2)]
        quitter_client = client(server)
        quitter = await quitter_client.completions.create(prompt="A very long story:", max_tokens=800, **kw)

        async def drain(stream):
            text, finishes = "", 0
            async for ch in stream:
                text += ch.choices[0].text if ch.choices else ""
                finishes += sum(c.finish_reason is not None for c in ch.choices)
            return text, finishes

        keepers = [asyncio.create_task(drain(s)) for s in keep]
        got = 0
        async for ch in quitter:
            got += 1
            if got == 3:
                break
        during = await scrape(server)
        assert during["zpp:num_requests_running"] == 3 and during["zpp:kv_cache_usage_perc"] > idle_kv
        await quitter.close()  # the client goes away mid-stream
        await quitter_client.close()
        # The abort lands within a step or so: the other two streams are still running then.
        m = await _wait_metrics(server, lambda m: m.get(aborted, 0.0) > aborts0, timeout=5.0)
        assert m.get(aborted, 0.0) == aborts0 + 1
        m = await _wait_metrics(server, lambda m: m["zpp:num_requests_running"] <= 2, timeout=5.0)
        assert m["zpp:num_requests_running"] <= 2
        results = await asyncio.gather(*keepers)
        assert all(f == 1 and t for t, f in results)  # the other streams finish normally
        m = await _wait_metrics(server, lambda m: m["zpp:num_requests_running"] == 0
                                and m["zpp:kv_cache_usage_perc"] == idle_kv)
        assert m["zpp:num_requests_running"] == 0 and m["zpp:num_requests_waiting"] == 0
        assert m["zpp:kv_cache_usage_perc"] == idle_kv

        # A non-streaming client that gives up is aborted too.
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(server.url + "/v1/completions", timeout=aiohttp.ClientTimeout(total=1.0),
                             json={"model": MODEL, "prompt": "Go on forever:", "max_tokens": 800,
                                   "ignore_eos": True})
        m = await _wait_metrics(server, lambda m: m.get(aborted, 0.0) == aborts0 + 2
                                and m["zpp:num_requests_running"] == 0 and m["zpp:kv_cache_usage_perc"] == idle_kv)
        assert m.get(aborted, 0.0) == aborts0 + 2
        assert m["zpp:num_requests_running"] == 0 and m["zpp:kv_cache_usage_perc"] == idle_kv

    run(go())


@pytest.mark.slow
def test_metrics(server):
    async def go():
        before = await scrape(server)
        await client(server).completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=7,
                                                temperature=0, extra_body={"ignore_eos": True})
        return before, await scrape(server)

    before, after = run(go())
    for name in ("zpp:num_requests_running", "zpp:num_requests_waiting", "zpp:kv_cache_usage_perc",
                 "zpp:num_free_kv_blocks", "zpp:num_preemptions_total"):
        assert name in after
    assert after["zpp:prompt_tokens_total"] - before["zpp:prompt_tokens_total"] == 5
    assert after["zpp:generation_tokens_total"] - before["zpp:generation_tokens_total"] == 7
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"zpp:{h}_count"] - before.get(f"zpp:{h}_count", 0) == 1
        assert after[f"zpp:{h}_sum"] > before.get(f"zpp:{h}_sum", 0)
    assert after["zpp:inter_token_latency_seconds_count"] - before.get("zpp:inter_token_latency_seconds_count", 0) == 6
    assert after['zpp:request_success_total{finished_reason="length"}'] >= 1
    busy = {k: v for k, v in after.items() if k.startswith("zpp:stage_busy_seconds_total")}
    assert set(busy) == {'zpp:stage_busy_seconds_total{stage="0"}', 'zpp:stage_busy_seconds_total{stage="1"}'}
    assert all(v > 0 for v in busy.values())


# --- zpp bench serve ---------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_serve_random_and_sharegpt(server, tmp_path, capsys):
    from zpp.cli import main
    out = tmp_path / "random.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "16",
               "--random-output-len", "4", "--request-rate", "inf", "--no-progress", "--output-json", str(out)])
    table = capsys.readouterr().out
    assert rc == 0 and "Serving Benchmark Result" in table and "Median TTFT (ms)" in table
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["failed"] == 0 and res["model"] == MODEL
    assert res["total_input_tokens"] == 4 * 16 and res["total_output_tokens"] == 4 * 4
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(res[key]) == {"mean", "median", "p99"} and res[key]["mean"] > 0
    assert res["ttft_ms"]["mean"] < res["e2el_ms"]["mean"]
    assert all(len(itl) == 3 for itl in res["per_request"]["itls_s"])

    convs = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i} in a few words."},
                                {"from": "gpt", "value": "It is a number that comes after the one before it."}]}
             for i in range(6)] + [{"conversations": [{"from": "human", "value": "hi"}]}]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(convs))
    out = tmp_path / "sharegpt-result.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", str(data), "--num-prompts", "3",
               "--sharegpt-output-len", "3", "--request-rate", "50", "--max-concurrency", "2", "--no-progress",
               "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 3 and res["total_output_tokens"] == 9 and res["max_concurrency"] == 2


@pytest.mark.slow
def test_bench_serve_with_vllm_flags_saves_result(server, tmp_path):
    """A ``vllm bench serve`` command line, run as a subprocess against this server: the result
    file goes to --result-dir/--result-filename, or by default to vLLM's file name pattern."""
    import glob
    import subprocess
    import sys
    common = ["--backend", "vllm", "--host", "127.0.0.1", "--port", str(server.port), "--endpoint", "/v1/completions",
              "--model", MODEL, "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
              "--num-prompts", "4", "--request-rate", "inf", "--max-concurrency", "2", "--seed", "1",
              "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
              "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path / "results")]
    bench = lambda *a: subprocess.run([sys.executable, "-m", "zpp.cli", "bench", "serve", *common, *a],
                                      capture_output=True, text=True, timeout=300)
    r = bench("--result-filename", "run.json")
    assert r.returncode == 0, r.stderr
    assert "P90 ITL (ms)" in r.stdout and "P50 TTFT (ms)" in r.stdout
    res = json.loads((tmp_path / "results" / "run.json").read_text())
    assert res["completed"] == 4 and res["failed"] == 0 and res["max_concurrency"] == 2
    assert res["total_input_tokens"] == 4 * 16 and res["total_output_tokens"] == 4 * 4
    assert res["backend"] == "vllm" and res["model_id"] == MODEL and res["duration"] > 0
    for k in ("ttft", "tpot", "itl", "e2el"):  # vLLM's flat keys
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{k}_ms" in res, (stat, k)
        assert res[f"p50_{k}_ms"] <= res[f"p90_{k}_ms"] <= res[f"p99_{k}_ms"]
    r = bench()
    assert r.returncode == 0, r.stderr
    saved = glob.glob(str(tmp_path / "results" / f"vllm-infqps-concurrency2-{MODEL}-*.json"))
    assert len(saved) == 1 and json.loads(open(saved[0]).read())["completed"] == 4


@pytest.mark.slow
def test_prompt_logprobs_in_responses(server, tokenizer):
    """vLLM's ``prompt_logprobs``: one entry per prompt token (None first) holding the prompt token,
    each entry ``{"logprob", "rank", "decoded_token"}`` with the top-2 ranked 1 and 2."""
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "The capital of France is", "max_tokens": 1, "prompt_logprobs": 2}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                plp = (await r.json())["choices"][0]["prompt_logprobs"]
            ids = tokenizer.encode(body["prompt"])
            assert len(plp) == len(ids) and plp[0] is None
            assert all(str(t) in e for t, e in zip(ids[1:], plp[1:]))
            for t, e in zip(ids[1:], plp[1:]):
                assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in e.values())
                assert e[str(t)]["decoded_token"] == tokenizer.decode([t]) and e[str(t)]["rank"] >= 1
                ranks = sorted(v["rank"] for v in e.values())  # the prompt token's, then the top-2's
                assert ranks[:2] == [1, 2] and len(e) in (2, 3)
            body = {"messages": FRANCE, "max_tokens": 1, "prompt_logprobs": 0}
            async with s.post(server.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                data = await r.json()
            assert data["prompt_logprobs"][0] is None
            assert len(data["prompt_logprobs"]) == data["usage"]["prompt_tokens"]
            # streamed: the prompt's logprobs come once, in the first chunk (of each choice on
            # completions, n=2 here; at the top of the first chunk on chat, as the whole response)
            for path, extra, want in (("/v1/completions", {"prompt": "The capital of France is", "n": 2}, plp),
                                      ("/v1/chat/completions", {"messages": FRANCE}, data["prompt_logprobs"])):
                body = {**extra, "max_tokens": 3, "prompt_logprobs": 2 if "prompt" in extra else 0,
                        "stream": True, "temperature": 0}
                async with s.post(server.url + path, json=body) as r:
                    assert r.status == 200
                    events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                              if line.startswith("data: {")]
                if "prompt" in extra:
                    got = [(c["index"], c.get("prompt_logprobs")) for e in events for c in e["choices"]]
                    firsts = {}
                    for idx, p in got:
                        firsts.setdefault(idx, p)
                    assert set(firsts) == {0, 1} and sum(p is not None for _, p in got) == 2, got
                else:
                    firsts = {0: events[0].get("prompt_logprobs")}
                    assert all("prompt_logprobs" not in e for e in events[1:])
                for p in firsts.values():
                    assert p is not None and len(p) == len(want) and p[0] is None
                    for a, b in zip(p[1:], want[1:]):  # same tokens and ranks (values up to batching noise)
                        assert {t: v["rank"] for t, v in a.items()} == {t: v["rank"] for t, v in b.items()}
                        assert all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-3 for t in a)
    run(go())


@pytest.mark.slow
def test_request_id_names_the_response_and_priority_zero_is_accepted(server):
    """vLLM's ``request_id`` and ``priority`` fields: the response's id (every chunk's, streamed) is
    ``chatcmpl-<request_id>`` / ``cmpl-<request_id>``, the output is the one without the fields, the
    same id serves again once its request is done, and while one runs a second is refused (400)."""
    async def go():
        c = client(server)
        base = dict(model=MODEL, max_tokens=4, temperature=0)
        plain = await c.chat.completions.create(messages=FRANCE, **base)
        r = await c.chat.completions.create(messages=FRANCE, **base, extra_body={"request_id": "trace-42", "priority": 0})
        assert r.id == "chatcmpl-trace-42" and r.choices[0].message.content == plain.choices[0].message.content
        ids = {ch.id async for ch in await c.chat.completions.create(messages=FRANCE, stream=True, **base,
                                                                       extra_body={"request_id": "trace-42"})}
        assert ids == {"chatcmpl-trace-42"}
        r = await c.completions.create(prompt="Hello", **base, extra_body={"request_id": "trace-42"})
        assert r.id == "cmpl-trace-42" and r.usage.completion_tokens == 4
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "request_id": "busy"}
            first = asyncio.create_task(_post(s, server, "/v1/completions", body))
            await asyncio.sleep(1.0)
            status, got = await _post(s, server, "/v1/completions", {**body, "max_tokens": 2})
            assert status == 400 and got["error"]["param"] == "request_id", got
            assert got["error"]["message"] == "request id 'busy' is already in use by a request in progress", got
            # an X-Request-Id header names the request when the body does not: the same rule
            del body["request_id"]
            async with s.post(server.url + "/v1/completions", json={**body, "max_tokens": 2},
                              headers={"X-Request-Id": "busy"}) as r:
                assert r.status == 400 and r.headers["X-Request-Id"] == "busy"
                err = (await r.json())["error"]  # in the client's words: its id and the header
                assert err["param"] == "X-Request-Id" and err["message"] == \
                    "request id 'busy' is already in use by a request in progress", err
            status, got = await first
            assert status == 200 and got["id"] == "cmpl-busy" and got["usage"]["completion_tokens"] == 200, got

    run(go())


@pytest.mark.slow
def test_x_request_id_header_is_echoed_and_names_the_request(server):
    """As vLLM (``--enable-request-id-headers``, always on here): every response carries
    ``X-Request-Id``, the request's own echoed (streams and errors too), else the id the request
    ran under, else a fresh one; on chat and completions the header is the request's id when the
    body has no ``request_id`` (the body's wins: the header is still echoed); /v1/responses keeps
    its own ``resp_`` id; a header unfit for an id is a 400 naming it."""
    async def go():
        base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
        chat = {**base, "messages": FRANCE}
        async with aiohttp.ClientSession() as s:
            async def post(path, body, rid=None):
                async with s.post(server.url + path, json=body,
                                  headers={"X-Request-Id": rid} if rid is not None else {}) as r:
                    raw = await r.text()
                    return r.status, r.headers.get("X-Request-Id"), raw

            status, hdr, raw = await post("/v1/chat/completions", chat, "trace-h1")
            assert (status, hdr, json.loads(raw)["id"]) == (200, "trace-h1", "chatcmpl-trace-h1")
            status, hdr, raw = await post("/v1/completions", {**base, "prompt": "Hi", "stream": True}, "trace-h2")
            ids = {json.loads(e[6:]).get("id") for e in raw.split("\n\n") if e.startswith("data: {")}
            assert (status, hdr, ids) == (200, "trace-h2", {"cmpl-trace-h2"})
            status, hdr, raw = await post("/v1/chat/completions", {**chat, "request_id": "from-body"}, "from-header")
            assert (hdr, json.loads(raw)["id"]) == ("from-header", "chatcmpl-from-body")
            status, hdr, raw = await post("/v1/chat/completions", {**chat, "request_id": "only-body"})
            assert (hdr, json.loads(raw)["id"]) == ("only-body", "chatcmpl-only-body")
            for path, body, prefix in (("/v1/chat/completions", {**chat, "stream": True}, "chatcmpl-"),
                                       ("/v1/completions", {**base, "prompt": "Hi"}, "cmpl-")):
                status, hdr, raw = await post(path, body)
                first = json.loads(raw[6:raw.index("\n\n")] if body.get("stream") else raw)
                assert status == 200 and len(hdr) == 32 and first["id"] == prefix + hdr, (hdr, first)
            status, hdr, raw = await post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
                                          "trace-r")
            assert status == 200 and hdr == "trace-r" and json.loads(raw)["id"].startswith("resp_")
            status, hdr, raw = await post("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2})
            assert json.loads(raw)["id"] == "resp_" + hdr
            status, hdr, raw = await post("/v1/completions", {**base, "prompt": "Hi", "model": "nope"}, "trace-404")
            assert (status, hdr) == (404, "trace-404")
            status, hdr, raw = await post("/v1/completions", {**base, "prompt": "Hi"}, "x" * 300)
            assert status == 400 and json.loads(raw)["error"]["param"] == "X-Request-Id"
            async with s.get(server.url + "/health") as r:
                assert len(r.headers["X-Request-Id"]) == 32
    run(go())


@pytest.mark.slow
def test_truncate_prompt_tokens_keeps_the_last_tokens(server, tokenizer):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens run, as if sent alone (same
    greedy text, k prompt tokens in the usage), for a text prompt, token ids and a chat; a prompt
    far over --max-model-len (1024 here) is served once truncated; a shorter prompt is unchanged."""
    async def go():
        c = client(server)
        base = dict(model=MODEL, max_tokens=8, temperature=0)
        ids = tokenizer.encode("The history of the city is long. " * 300)  # ~2700 tokens
        assert len(ids) > 2048
        alone = await c.completions.create(prompt=ids[-40:], **base)
        for prompt in (tokenizer.decode(ids), ids):
            r = await c.completions.create(prompt=prompt, **base, extra_body={"truncate_prompt_tokens": 40})
            assert r.usage.prompt_tokens == 40 and r.choices[0].text == alone.choices[0].text
        r = await c.completions.create(prompt=ids[-30:], **base, extra_body={"truncate_prompt_tokens": 40})
        assert r.usage.prompt_tokens == 30
        chat_ids = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True)
        chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
        alone = await c.completions.create(prompt=chat_ids[-12:], **base)
        r = await c.chat.completions.create(messages=FRANCE, **base, extra_body={"truncate_prompt_tokens": 12})
        assert r.usage.prompt_tokens == 12 and r.choices[0].message.content == alone.choices[0].text

    run(go())


# --- /tokenize, /detokenize, /ping (vLLM's); unknown fields ------------------------------------
async def _post(s: aiohttp.ClientSession, server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with s.post(server.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


@pytest.mark.slow
def test_tokenize_and_detokenize(server, tokenizer):
    """vLLM's shapes; the ids are those the completion and chat endpoints run."""
    text = "The capital of France is"
    ids = tokenizer.encode(text)

    async def go():
        async with aiohttp.ClientSession() as s:
            status, tok = await _post(s, server, "/tokenize", {"model": MODEL, "prompt": text})
            assert status == 200
            assert tok == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
            _, comp = await _post(s, server, "/v1/completions", {"prompt": text, "max_tokens": 1})
            assert comp["usage"]["prompt_tokens"] == tok["count"]
            _, strs = await _post(s, server, "/tokenize", {"prompt": text, "return_token_strs": True})
            assert strs["tokens"] == ids and strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)

            status, chat_tok = await _post(s, server, "/tokenize", {"model": MODEL, "messages": FRANCE})
            assert status == 200 and chat_tok["count"] == len(chat_tok["tokens"])
            rendered = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
            assert chat_tok["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
            _, chat = await _post(s, server, "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 1})
            assert chat["usage"]["prompt_tokens"] == chat_tok["count"]
            _, no_gen = await _post(s, server, "/tokenize", {"messages": FRANCE, "add_generation_prompt": False})
            assert no_gen["count"] < chat_tok["count"]
            # with tools: the ids a chat request with those tools runs (its tool text included)
            tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
            status, tool_tok = await _post(s, server, "/tokenize", {"messages": FRANCE, "tools": tools})
            _, chat = await _post(s, server, "/v1/chat/completions", {"messages": FRANCE, "tools": tools,
                                                                      "max_tokens": 1})
            assert status == 200 and tool_tok["count"] == chat["usage"]["prompt_tokens"] > chat_tok["count"]
            status, bad = await _post(s, server, "/tokenize", {"messages": FRANCE, "tools": [{"type": "x"}]})
            assert status == 400 and bad["error"]["param"] == "tools"

            status, detok = await _post(s, server, "/detokenize", {"model": MODEL, "tokens": ids})
            assert status == 200 and detok == {"prompt": text}
            _, detok = await _post(s, server, "/detokenize", {"tokens": chat_tok["tokens"]})
            assert detok == {"prompt": rendered}
            _, detok = await _post(s, server, "/detokenize", {"tokens": []})
            assert detok == {"prompt": ""}
    run(go())


TOKENIZE_BAD = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": FRANCE}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/tokenize", {"messages": FRANCE, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/tokenize", b"not json", 400, None),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 2, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "model"),
    ("/detokenize", [1, 2], 400, None),
]


@pytest.mark.slow
def test_tokenize_detokenize_bad_input_gets_openai_errors(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            for path, body, status, param in TOKENIZE_BAD:
                got_status, got = await _post(s, server, path, body)
                assert got_status == status, (path, body, got)
                assert set(got["error"]) == {"message", "type", "param", "code"}, got
                assert got["error"]["param"] == param, (path, body, got)
            status, _ = await _post(s, server, "/tokenize", {"prompt": "still fine"})
            assert status == 200
    run(go())


@pytest.mark.slow
def test_ping(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/ping") as r:
                assert r.status == 200
            async with s.post(server.url + "/ping") as r:
                assert r.status == 200
    run(go())


@pytest.mark.slow
def test_unknown_fields_ignored_and_logged_once_per_name(server):
    """Ignored, as vLLM does (clients send OpenAI's newer fields by default): the request is served,
    its response lists them in X-Ignored-Fields, and the server's log has one warning line for a
    request with a field name it has not seen before, naming all of that request's unknown fields
    (in-process, every endpoint: tests/server/test_unknown_fields.py)."""
    first, second = f"zpp_test_{time.monotonic_ns()}", f"zpp_test_other_{time.monotonic_ns()}"

    async def go():
        async with aiohttp.ClientSession() as s:
            for path, body in [("/v1/completions", {"prompt": "hi", "max_tokens": 2, first: 1}),
                               ("/v1/completions", {"prompt": "hi", "max_tokens": 2, first: 2}),
                               ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2, first: True, second: None}),
                               ("/tokenize", {"prompt": "hi", second: 1})]:
                async with s.post(server.url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Ignored-Fields"] == ", ".join(k for k in (first, second) if k in body)
    run(go())
    deadline = time.monotonic() + 5
    while second not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [l for l in server.output().splitlines() if "ignored unknown request field" in l
             and (first in l or second in l)]
    assert len(lines) == 2 and first in lines[0] and second not in lines[0], lines
    assert first in lines[1] and second in lines[1] and "/v1/chat/completions" in lines[1], lines
    assert all("WARNING" in l for l in lines)
