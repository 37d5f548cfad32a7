"""Chat's ``reasoning_effort`` and Responses' ``reasoning.effort`` reach the chat template as the
variable ``reasoning_effort`` (as in vLLM), through the real HTTP handlers.

In-process (aiohttp TestServer, no model weights, seconds): the server runs around an engine
whose ``prepare`` is :meth:`AsyncEngine.prepare` (the real rendering and tokenizing, the demo
model's tokenizer) and whose "generation" answers with the rendered prompt itself, so a reply's
text is exactly what the template made of the request.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
import pytest
from openai import AsyncOpenAI

from zpp.frontend.async_engine import AsyncEngine
from zpp.frontend.inputs import InputProcessor
from zpp.outputs import CompletionOutput, RequestOutput
from zpp.server.protocol import REASONING_EFFORTS

MODEL = "smol"
HI = [{"role": "user", "content": "hi"}]
# Reads reasoning_effort (as gpt-oss's template does), and renders "(unset)" without it.
EFFORT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "effort={{ reasoning_effort if reasoning_effort is defined else '(unset)' }}\nassistant:")


def _rendered(effort: str, question: str = "hi") -> str:
    return f"user: {question}\neffort={effort}\nassistant:"


class _EchoEngine:
    """Just enough of AsyncEngine for a request without structured outputs to run: the real
    ``prepare``, and a ``generate`` whose one output is the rendered prompt (finished, ``"stop"``)."""

    prepare, compile_grammar = AsyncEngine.prepare, AsyncEngine.compile_grammar

    def __init__(self, tokenizer):
        self.inputs = InputProcessor(tokenizer, 49152, 512, 32, 16)
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(model=SimpleNamespace(model="/nowhere"))
        self.max_model_len, self.vocab_size, self.metrics, self.is_healthy = 512, 49152, None, True

    async def generate(self, prepared, request_id=None, stream=True):
        ids = self.tokenizer.encode(prepared.prompt, add_special_tokens=False)
        yield RequestOutput(request_id, prepared.prompt, prepared.prompt_token_ids,
                            [CompletionOutput(0, prepared.prompt, ids, "stop")], finished=True)


def _serve(tokenizer, test, **server_kw):
    """Run ``test(client)`` against an in-process server around :class:`_EchoEngine`."""
    from aiohttp.test_utils import TestServer

    from zpp.server.app import OpenAIServer

    async def go():
        app = OpenAIServer(_EchoEngine(tokenizer), MODEL, log_requests=False, **server_kw).build_app()
        srv = TestServer(app, auto_decompress=False)
        await srv.start_server()
        try:
            await test(AsyncOpenAI(base_url=str(srv.make_url("/v1")), api_key="x", max_retries=0))
        finally:
            await srv.close()
    asyncio.run(go())


def test_chat_reasoning_effort_reaches_a_request_template(tokenizer):
    async def test(c):
        async def reply(**extra):
            r = await c.chat.completions.create(model=MODEL, messages=HI, extra_body={"chat_template": EFFORT_TEMPLATE,
                                                                                     **extra})
            return r.choices[0].message.content

        for effort in REASONING_EFFORTS:
            assert await reply(reasoning_effort=effort) == _rendered(effort)
        assert await reply() == _rendered("(unset)")  # left out: no such variable, as before
        assert await reply(reasoning_effort=None) == _rendered("(unset)")
        # An explicit chat_template_kwargs.reasoning_effort wins over the field (any value: it is the
        # template's business), and the field joins other kwargs.
        assert await reply(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "max"}) == \
            _rendered("max")
        assert await reply(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == \
            _rendered("low")
        # Streamed too (the same rendering).
        stream = await c.chat.completions.create(model=MODEL, messages=HI, stream=True, reasoning_effort="high",
                                                 extra_body={"chat_template": EFFORT_TEMPLATE})
        assert "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]) == \
            _rendered("high")
    _serve(tokenizer, test, trust_request_chat_template=True)


def test_responses_reasoning_effort_reaches_the_server_template(tokenizer):
    async def test(c):
        for effort in REASONING_EFFORTS:
            r = await c.responses.create(model=MODEL, input="hi", reasoning={"effort": effort})
            assert r.output_text == _rendered(effort)
            assert r.reasoning.effort == effort and r.reasoning.summary is None  # echoed
        r = await c.responses.create(model=MODEL, input="hi")
        assert r.output_text == _rendered("(unset)") and r.reasoning is None
        r = await c.responses.create(model=MODEL, input="hi", reasoning={"effort": None, "summary": None})
        assert r.output_text == _rendered("(unset)")
        # The chat path with the server's template (--chat-template) sees the same.
        r = await c.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="medium")
        assert r.choices[0].message.content == _rendered("medium")
    _serve(tokenizer, test, chat_template=EFFORT_TEMPLATE)


def test_a_template_that_ignores_the_effort_renders_as_without_it(tokenizer):
    """SmolLM2's own template does not read reasoning_effort: the prompt is unchanged."""
    async def test(c):
        plain = (await c.chat.completions.create(model=MODEL, messages=HI)).choices[0].message.content
        assert plain == tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
        r = await c.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="high")
        assert r.choices[0].message.content == plain
        assert (await c.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})).output_text == plain
    _serve(tokenizer, test)


def test_bad_efforts_and_summaries_are_refused(tokenizer):
    async def test(c):
        async def refused(call, **kw) -> dict:
            with pytest.raises(openai.BadRequestError) as e:
                await call(model=MODEL, **kw)
            assert set(e.value.body) == {"message", "type", "param", "code"}, e.value.body
            return e.value.body

        chat, responses = c.chat.completions.create, c.responses.create
        for bad in ("extreme", "HIGH", "", 3):
            body = await refused(chat, messages=HI, reasoning_effort=bad)
            assert body["param"] == "reasoning_effort", body
            body = await refused(responses, input="hi", reasoning={"effort": bad})
            assert body["param"] == "reasoning.effort", body
        body = await refused(chat, messages=HI, reasoning_effort="extreme")
        assert "'low'" in body["message"] and "'extreme'" in body["message"], body
        for key in ("summary", "generate_summary"):
            body = await refused(responses, input="hi", reasoning={"effort": "low", key: "verbose"})
            assert body["param"] == f"reasoning.{key}" and "'auto'" in body["message"], body
        for summary in ("auto", "concise", "detailed"):  # accepted (Codex sends "auto"), no summary written
            r = await responses(model=MODEL, input="hi", reasoning={"effort": "low", "summary": summary})
            assert r.reasoning.summary == summary and r.reasoning.effort == "low"
            assert all(not getattr(item, "summary", None) for item in r.output)
        body = await refused(responses, input="hi", reasoning={"budget": 100})
        assert body["param"] == "reasoning" and "budget" in body["message"], body
    _serve(tokenizer, test, chat_template=EFFORT_TEMPLATE)
