"""An in-process server around an engine that answers with its own prompt (no weights, no
processes): the real HTTP handlers, the real ``AsyncEngine.prepare`` (rendering with the chat
template, tokenizing with the demo model's tokenizer, limits), and a "generation" whose one output
is the rendered prompt itself, so that a reply's text is exactly what the server made of the
request. Used by the in-process server tests (fast tier)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Optional

from openai import AsyncOpenAI

from zpp.errors import EngineShutdownError
from zpp.frontend.async_engine import AsyncEngine
from zpp.frontend.inputs import InputProcessor
from zpp.outputs import CompletionOutput, RequestOutput

MODEL = "smol"


class EchoEngine:
    """Just enough of AsyncEngine for a request without structured outputs to run: the real
    ``prepare``, and a ``generate`` whose one output is the rendered prompt (``"stop"``), or
    nothing (``"length"``) for ``max_tokens`` 0. ``shutdown_after`` (a number of outputs):
    streams that many unfinished outputs of the prompt's first character, then raises
    EngineShutdownError as a draining server ends its requests."""

    prepare, compile_grammar = AsyncEngine.prepare, AsyncEngine.compile_grammar

    def __init__(self, tokenizer, shutdown_after: Optional[int] = None):
        self.inputs = InputProcessor(tokenizer, 49152, 512, 32, 16)
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(model=SimpleNamespace(model="/nowhere"))
        self.max_model_len, self.vocab_size, self.metrics, self.is_healthy = 512, 49152, None, True
        self.shutdown_after = shutdown_after

    async def generate(self, prepared, request_id=None, stream=True):
        text = prepared.prompt or ""
        if self.shutdown_after is not None:
            for i in range(self.shutdown_after):
                piece = text[:i + 1]
                yield RequestOutput(request_id, prepared.prompt, prepared.prompt_token_ids,
                                    [CompletionOutput(0, piece, self.tokenizer.encode(piece), None)], finished=False)
            raise EngineShutdownError("the server is shutting down")
        if prepared.max_tokens == 0:
            out = CompletionOutput(0, "", [], "length")
        else:
            out = CompletionOutput(0, text, self.tokenizer.encode(text, add_special_tokens=False), "stop")
        yield RequestOutput(request_id, prepared.prompt, prepared.prompt_token_ids, [out], finished=True)


def serve(tokenizer, test, engine: Optional[EchoEngine] = None, **server_kw) -> None:
    """Run ``await test(openai_client, base_url)`` against an in-process server (aiohttp
    TestServer) around ``engine`` (default: an :class:`EchoEngine`); ``server_kw`` go to
    :class:`~zpp.server.app.OpenAIServer`."""
    from aiohttp.test_utils import TestServer

    from zpp.server.app import OpenAIServer

    async def go():
        app = OpenAIServer(engine or EchoEngine(tokenizer), MODEL, log_requests=False, **server_kw).build_app()
        srv = TestServer(app, auto_decompress=False)
        await srv.start_server()
        try:
            url = str(srv.make_url("")).rstrip("/")
            await test(AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0), url)
        finally:
            await srv.close()
    asyncio.run(go())
