"""``--generation-config``, ``--tool-call-parser`` / ``--reasoning-parser`` and ``logit_bias`` through
real servers (the demo SmolLM2) and the official ``openai`` client.

SmolLM2 writes neither Mistral's tool calls nor ``<think>`` blocks on its own, so those outputs are
forced, token by token, with a ``choice`` grammar (the request's ``structured_outputs``); the rest of
the path is the real one: tokens sampled on the last stage, detokenized, streamed, and parsed by the
server into ``tool_calls`` / ``reasoning_content`` that the official client reads. ``logit_bias`` is
checked at PP=1 (this module's server) and PP=2 (the shared server).

``/v1/responses`` with ``--reasoning-parser deepseek_r1`` (a second server): DeepSeek-R1's outputs
start in their reasoning, and SmolLM2, asked to copy a text with ``</think>`` in it, writes one
greedily, unforced; the Responses output items are checked against the chat completion of the
same input.
"""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai import AsyncOpenAI

from helpers import ServerProcess

pytestmark = pytest.mark.slow  # servers / engines (see tests/helpers.py)

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GEN_DEFAULTS = {"top_k": 1, "max_new_tokens": 6}  # greedy unless the request says otherwise; 6 tokens


@pytest.fixture(scope="module")
def parser_server(demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("genconfig")
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, **GEN_DEFAULTS}))
    srv = ServerProcess([demo_model, "--max-model-len", "1024", "--num-kv-blocks", "128",
                         "--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--reasoning-parser", "qwen3",
                         "--generation-config", str(d), "--disable-log-stats"])
    yield srv
    srv.stop()


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _run(coro):
    return asyncio.run(coro)


def test_generation_config_defaults_and_request_override(parser_server):
    assert "sampling defaults from" in parser_server.output() and "top_k=1, max_tokens=6" in parser_server.output()

    async def go():
        c = _client(parser_server)
        prompt = "Once upon a time"
        greedy = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
        # No top_k / max_tokens in the request: the model's top_k=1 (greedy whatever the seed) and 6 tokens.
        defaults = await asyncio.gather(*[c.completions.create(model=MODEL, prompt=prompt, seed=s) for s in range(4)])
        # top_k -1 in the request overrides the model's default: seeded sampling over the whole vocabulary.
        sampled = await asyncio.gather(*[c.completions.create(model=MODEL, prompt=prompt, seed=s, max_tokens=6,
                                                              extra_body={"top_k": -1}) for s in range(4)])
        chat = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
        await c.close()
        return greedy, defaults, sampled, chat

    greedy, defaults, sampled, chat = _run(go())
    assert all(r.choices[0].text == greedy.choices[0].text for r in defaults)
    assert all(r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length" for r in defaults)
    assert any(r.choices[0].text != greedy.choices[0].text for r in sampled)
    assert chat.usage.completion_tokens == 3  # the request's max_tokens wins over max_new_tokens


# --- parsers, forced outputs ------------------------------------------------------------------------
MISTRAL_CALL = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
THINKING = "<think>\nParis?\n</think>\n\nIt is sunny."


def _forced(text: str) -> dict:
    return {"structured_outputs": {"choice": [text]}}


async def _streamed(c: AsyncOpenAI, **kw) -> tuple[dict, str]:
    """The message a client assembles from a stream, and the finish reason."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    async for chunk in await c.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or ():
                call = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return msg, finish


def test_tool_call_and_reasoning_parsers_through_the_server(parser_server):
    async def go():
        c = _client(parser_server)
        both = THINKING.split("It is")[0] + MISTRAL_CALL
        calls, calls_s, think, think_s, hidden, mixed, mixed_s = await asyncio.gather(
            c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60,
                                      extra_body=_forced(MISTRAL_CALL)),
            _streamed(c, messages=ASK, tools=TOOLS, max_tokens=60, extra_body=_forced(MISTRAL_CALL)),
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, extra_body=_forced(THINKING)),
            _streamed(c, messages=ASK, max_tokens=60, extra_body=_forced(THINKING)),
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                      extra_body={**_forced(THINKING), "include_reasoning": False}),
            c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, extra_body=_forced(both)),
            _streamed(c, messages=ASK, tools=TOOLS, max_tokens=80, extra_body=_forced(both)))
        await c.close()
        return calls, calls_s, think, think_s, hidden, mixed, mixed_s

    calls, (calls_s, calls_s_finish), think, (think_s, _), hidden, mixed, (mixed_s, _) = _run(go())
    m = calls.choices[0].message
    assert calls.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
    paris = [("get_weather", {"city": "Paris"})]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == paris
    assert len(m.tool_calls[0].id) == 9 and m.tool_calls[0].id.isalnum()  # Mistral's id form
    assert calls_s_finish == "tool_calls" and calls_s["content"] == "Checking."
    assert [(t["name"], json.loads(t["arguments"])) for t in calls_s["tool_calls"].values()] == paris
    m = think.choices[0].message
    assert m.model_extra["reasoning_content"] == "\nParis?\n"
    assert m.content == "\n\nIt is sunny."
    assert (think_s["reasoning_content"], think_s["content"]) == (m.model_extra["reasoning_content"], m.content)
    assert hidden.choices[0].message.model_extra["reasoning_content"] is None
    assert hidden.choices[0].message.content == m.content
    m = mixed.choices[0].message
    assert m.model_extra["reasoning_content"] == "\nParis?\n" and m.content == "\n\nChecking."
    assert m.tool_calls[0].function.name == "get_weather"
    assert mixed_s["reasoning_content"] == m.model_extra["reasoning_content"] and mixed_s["content"] == m.content
    assert [t["name"] for t in mixed_s["tool_calls"].values()] == ["get_weather"]


# --- logit_bias at PP=1 and PP=2 ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["pp1", "pp2"])
def bias_server(request):
    return request.getfixturevalue("parser_server" if request.param == "pp1" else "shared_pp2_server")


MODES = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=4),
         dict(temperature=1.0, extra_body={"top_k": 5, "min_p": 0.05}, seed=5)]


def test_logit_bias_forces_and_forbids(bias_server, tokenizer):
    prompt = "The capital of France is"
    forced_id = tokenizer.encode(" banana")[0]

    async def go():
        c = _client(bias_server)
        greedy = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1)
        top = tokenizer.encode(greedy.choices[0].text)
        assert len(top) == 1, "the greedy token's text must encode back to it"
        forbidden = await c.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=1,
                                               logit_bias={str(top[0]): -100})
        forced = await asyncio.gather(*[c.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                                             logit_bias={str(forced_id): 100}, **mode)
                                        for mode in MODES])
        chat = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                               logit_bias={str(forced_id): 100})
        chat_s, _ = await _streamed(c, messages=ASK, max_tokens=2, temperature=0, logit_bias={str(forced_id): 100})
        errors = []
        for bias in ({"abc": 1}, {str(len(tokenizer) + 10**6): 1}, {str(forced_id): 101}, {str(forced_id): "x"}):
            with pytest.raises(openai.BadRequestError) as info:
                await c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logit_bias=bias)
            errors.append(info.value)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, logit_bias={"-5": 1})
        errors.append(info.value)
        await c.close()
        return top[0], forbidden, forced, chat, chat_s, errors

    top, forbidden, forced, chat, chat_s, errors = _run(go())
    assert tokenizer.encode(forbidden.choices[0].text)[0] != top
    want = tokenizer.decode([forced_id] * 3)
    assert [r.choices[0].text for r in forced] == [want] * len(MODES)
    assert chat.choices[0].message.content == tokenizer.decode([forced_id] * 2) == chat_s["content"]
    for e in errors:
        assert e.status_code == 400 and e.param == "logit_bias" and e.body["type"] == "invalid_request_error", e.body


# --- /v1/responses with a reasoning parser ------------------------------------------------------------
COPY = "Copy this text: <think>\nParis?\n</think>\n\nIt is sunny."


@pytest.fixture(scope="module")
def r1_server(demo_model):
    srv = ServerProcess([demo_model, "--max-model-len", "512", "--num-kv-blocks", "64", "--reasoning-parser",
                         "deepseek_r1", "--log-level", "warning"])
    yield srv
    srv.stop()


def _items(output) -> list[dict]:
    """Output items without their random ids (nor the stream helper's ``parsed: None``)."""
    return [{k: v for k, v in o.to_dict(exclude_none=True).items() if k not in ("id", "call_id")} for o in output]


def test_responses_report_reasoning_as_a_reasoning_item(r1_server):
    from openai import OpenAI
    c = OpenAI(base_url=r1_server.url + "/v1", api_key="unused", max_retries=0)
    user = [{"role": "user", "content": COPY}]
    chat = c.chat.completions.create(model=MODEL, messages=user, temperature=0, max_tokens=40)
    m = chat.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and m.content, m  # the greedy output closes its reasoning

    r = c.responses.create(model=MODEL, input=COPY, temperature=0, max_output_tokens=40)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.summary == [] and rs.status == "completed"
    assert [(p.type, p.text) for p in rs.content] == [("reasoning_text", reasoning)]
    assert r.output_text == m.content  # the reasoning is not in the text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)

    # Streamed: the reasoning item's events (reasoning_text deltas), then the message's.
    with c.responses.stream(model=MODEL, input=COPY, temperature=0, max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    n = kinds.count("response.reasoning_text.delta")
    k = kinds.count("response.output_text.delta")
    assert n >= 1 and k >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.reasoning_text.delta"] * n + [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"] + ["response.output_text.delta"] * k + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert events[4 + n].text == reasoning and events[6 + n].item.content[0].text == reasoning
    assert all(e.output_index == 0 for e in events[2:7 + n]) and events[7 + n].output_index == 1
    assert _items(final.output) == _items(r.output) and final.output_text == m.content

    # Cut off inside the reasoning: the reasoning item alone, incomplete, streamed or not.
    cut = c.chat.completions.create(model=MODEL, messages=user, temperature=0, max_tokens=3).choices[0].message
    r = c.responses.create(model=MODEL, input=COPY, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status, o.content[0].text) for o in r.output] == [
        ("reasoning", "incomplete", cut.model_extra["reasoning_content"])] and r.output_text == ""
    with c.responses.stream(model=MODEL, input=COPY, temperature=0, max_output_tokens=3) as s:
        assert _items(s.get_final_response().output) == _items(r.output)

    # The next turn gets the whole output back as input, the reasoning item included: accepted, and
    # left out of the prompt, as the chat template leaves out a message's reasoning.
    follow = "Thanks. Now the capital of Italy?"
    whole = c.responses.create(model=MODEL, input=COPY, temperature=0, max_output_tokens=40)
    r2 = c.responses.create(model=MODEL, temperature=0, max_output_tokens=20, input=[
        *user, *(o.model_dump(exclude_none=True) for o in whole.output), {"role": "user", "content": follow}])
    chat2 = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, messages=[
        *user, {"role": "assistant", "content": m.content}, {"role": "user", "content": follow}])
    assert r2.usage.input_tokens == chat2.usage.prompt_tokens
    m2 = chat2.choices[0].message
    assert [o.content[0].text for o in r2.output if o.type == "reasoning"] == \
        ([m2.model_extra["reasoning_content"]] if m2.model_extra["reasoning_content"] else [])
    assert r2.output_text == (m2.content or "")
