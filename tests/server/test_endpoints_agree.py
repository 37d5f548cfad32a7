"""Chat, completions and responses agree with each other, OpenAI and vLLM (issue 51): ``max_tokens:
0`` is a 400 naming the field on every endpoint (OpenAI and vLLM refuse it), except completions
with ``echo``, which return the prompt with nothing generated (vLLM's prompt scoring); a request
ended by a draining server gets the same message, "the server is shutting down", on every
endpoint, streamed or not. In-process (:mod:`echo_engine`)."""
from __future__ import annotations

import json

import aiohttp
from echo_engine import MODEL, EchoEngine, serve

HI = [{"role": "user", "content": "hi"}]
SHUTDOWN = "the server is shutting down"


async def _post(url: str, path: str, body: dict):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json={"model": MODEL, **body}) as r:
            return r.status, await r.text()


def test_max_tokens_zero_is_refused_except_completions_echo(tokenizer):
    """``max_tokens`` 0 or -1 (and chat's ``max_completion_tokens``, responses' ``max_output_tokens``)
    gets one 400 on every endpoint, streamed or not: OpenAI's error object with the message
    ``"<param> must be at least 1, got <value>"`` naming the field the client sent; completions
    with ``echo`` accept 0 (not -1)."""
    async def test(client, url):
        cases = [("/v1/chat/completions", {"messages": HI}, "max_tokens"),
                 ("/v1/chat/completions", {"messages": HI}, "max_completion_tokens"),
                 ("/v1/chat/completions", {"messages": HI, "max_tokens": 5}, "max_completion_tokens"),
                 ("/v1/completions", {"prompt": "hi"}, "max_tokens"),
                 ("/v1/completions", {"prompt": "hi", "echo": True}, "max_tokens"),
                 ("/v1/responses", {"input": "hi"}, "max_output_tokens")]
        for path, body, param in cases:
            for value in (0, -1, -(2 ** 63)):
                if body.get("echo") and value == 0:
                    continue
                for stream in (False, True):
                    status, text = await _post(url, path, {**body, param: value, "stream": stream})
                    assert status == 400, (path, param, value, stream, text)
                    assert json.loads(text) == {"error": {
                        "message": f"{param} must be at least 1, got {value}", "type": "invalid_request_error",
                        "param": param, "code": None}}, (path, param, value, stream, text)
        status, text = await _post(url, "/v1/completions", {"prompt": "hi there", "max_tokens": 0, "echo": True})
        assert status == 200, text
        choice = json.loads(text)["choices"][0]
        assert choice["text"] == "hi there" and choice["finish_reason"] == "length"
        assert json.loads(text)["usage"]["completion_tokens"] == 0
    serve(tokenizer, test)


def test_a_drained_request_gets_one_message_on_every_endpoint(tokenizer):
    """The engine ends the request with EngineShutdownError (``AsyncEngine.abort_all`` on SIGTERM):
    a non-streamed request gets 503 with the message, a stream an error event with it (chat and
    completions: OpenAI's error object; responses: the ``error`` and ``response.failed`` events)."""
    async def test(client, url):
        messages = []
        for path, body in [("/v1/chat/completions", {"messages": HI}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/responses", {"input": "hi"})]:
            status, text = await _post(url, path, body)
            assert status == 503, (path, text)
            messages.append(json.loads(text)["error"]["message"])
            status, text = await _post(url, path, {**body, "stream": True})
            assert status == 200, text
            events = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            errors = [e["error"]["message"] if "error" in e and isinstance(e["error"], dict) else e.get("message")
                      for e in events if "error" in e or e.get("type") == "error"]
            if path == "/v1/responses":
                failed = [e for e in events if e.get("type") == "response.failed"]
                assert failed and failed[0]["response"]["error"]["message"] == SHUTDOWN, events
            assert errors and all(m == SHUTDOWN for m in errors), (path, events)
        assert messages == [SHUTDOWN] * 3, messages
    serve(tokenizer, test, engine=EchoEngine(tokenizer, shutdown_after=2))
