"""End-to-end HTTP serving at PP=2: concurrent requests (streaming and not, mixed lengths) each give
exactly what the same request gives alone, and the chat answer on the real model is right."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    """The OpenAI-API modules' PP=2 server (128 KV blocks: the 8 concurrent requests below need 22)."""
    return shared_pp2_server


async def _complete(session, url, body) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) for one completion request, streamed or not."""
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            data = await r.json()
            c = data["choices"][0]
            return c["text"], c["finish_reason"], data["usage"]["completion_tokens"]
        text, finish, usage, done = "", None, None, False
        async for raw in r.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            msg = json.loads(payload)
            if msg.get("usage"):
                usage = msg["usage"]["completion_tokens"]
            for c in msg["choices"]:
                text += c["text"]
                if c["finish_reason"] is not None:
                    assert finish is None, "two finish_reasons in one stream"
                    finish = c["finish_reason"]
        assert done, "stream did not end with data: [DONE]"
        return text, finish, usage


def test_chat_answers_paris(server):
    import urllib.request
    body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "temperature": 0}).encode()
    req = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.loads(r.read())
    assert "Paris" in data["choices"][0]["message"]["content"]
    assert data["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_equal_alone(server):
    words = "the river runs past the old mill and the children play by the water while".split()
    bodies = []
    # 8 requests (every prompt repeat count 1-4, streamed and not, 4-32 tokens): several
    # micro-batches' worth at PP=2, each request's tokens checked against it alone.
    for i in range(8):
        prompt = " ".join(words[: 2 + (i * 5) % len(words)]) * (1 + i % 4)
        bodies.append({"prompt": prompt, "max_tokens": 4 + (i * 7) % 29, "temperature": 0,
                       "stream": i % 2 == 1, "stream_options": {"include_usage": True} if i % 2 else None})
    for b in bodies:
        if b["stream_options"] is None:
            del b["stream_options"]

    async def run():
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            together = await asyncio.gather(*(_complete(s, server.url, b) for b in bodies))
            alone = [await _complete(s, server.url, b) for b in bodies]
        return together, alone

    together, alone = asyncio.run(run())
    for i, (t, a) in enumerate(zip(together, alone)):
        assert t == a, f"request {i} differs when sent with {len(bodies) - 1} others"
        assert t[2] is not None and t[2] <= bodies[i]["max_tokens"]
        if t[1] == "length":
            assert t[2] == bodies[i]["max_tokens"]


def test_prompt_logprobs_on_prefix_cache_hits(shared_pp2_prefix_server, tokenizer):
    """shared/cases/prefix-cache-prompt-logprobs.md over HTTP with --enable-prefix-caching: a
    repeated prompt (full hit), a shared 40-token start (partial hit) and echo + logprobs after
    them score every prompt position, equal to the first (cold) request. On the PP=2
    prefix-caching server of tests/server/test_observability.py (block size 16, 64 KV blocks), whose
    requests never sent these prompts."""
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
    ids = tokenizer.encode(" ".join(words * 6))
    p48, x25 = ids[:48], ids[60:85]
    s = shared_pp2_prefix_server

    async def go():
        async with aiohttp.ClientSession() as session:
            async def post(body):
                async with session.post(s.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["choices"][0]

            def values(choice, prompt):
                plp = choice["prompt_logprobs"]
                assert len(plp) == len(prompt) and plp[0] is None
                return [e[str(t)]["logprob"] for t, e in zip(prompt[1:], plp[1:])]

            body = {"prompt": p48, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0}
            cold = values(await post(body), p48)
            hit = values(await post(body), p48)
            partial = values(await post(body | {"prompt": p48[:40] + x25}), p48[:40] + x25)
            echo = await post({"prompt": p48, "echo": True, "logprobs": 1, "max_tokens": 0})
            return cold, hit, partial, echo["logprobs"]["token_logprobs"]

    cold, hit, partial, echo = asyncio.run(go())
    assert hit == pytest.approx(cold, abs=1e-4)
    assert partial[:39] == pytest.approx(cold[:39], abs=1e-4)
    assert echo[0] is None and echo[1:] == pytest.approx(cold, abs=1e-4)
