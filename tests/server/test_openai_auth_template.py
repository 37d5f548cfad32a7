"""``--api-key``, chat templates (``--chat-template FILE``, per-request ``chat_template``, none at
all) and BOS handling, then engine death, through the official ``openai`` client.

The live server here (PP=1) serves a copy of SmolLM2 whose tokenizer has no chat template and
*adds* BOS (``<|im_start|>``) when it encodes text, as Llama-style tokenizers do: a chat prompt
must then not get a second BOS in front of the one its template writes.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from helpers import ServerProcess, alive, descendants

pytestmark = pytest.mark.slow

from zpp.frontend.async_engine import AsyncEngine
from zpp.frontend.inputs import InputProcessor

KEY = "sk-test-secret"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def bos_model(demo_model, tmp_path_factory) -> str:
    """The demo model with a tokenizer that prepends BOS on encode and has no chat template."""
    d = tmp_path_factory.mktemp("models") / "smollm2-bos-notemplate"
    d.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        os.symlink(os.path.join(demo_model, f), d / f)
    with open(os.path.join(demo_model, "tokenizer.json")) as f:
        tj = json.load(f)
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tj["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with open(os.path.join(demo_model, "tokenizer_config.json")) as f:
        tc = json.load(f)
    tc.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return str(d)


@pytest.fixture(scope="module")
def bos_tokenizer(bos_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(bos_model)
    assert tok.encode("hi")[0] == tok.bos_token_id == 1 and not tok.chat_template
    return tok


@pytest.fixture(scope="module")
def template_file(tokenizer, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("templates") / "smollm2.jinja"
    path.write_text(tokenizer.chat_template)
    return str(path)


@pytest.fixture(scope="module")
def server(bos_model, template_file):
    srv = ServerProcess([bos_model, "--served-model-name", "smol", "--api-key", KEY, "--chat-template",
                         template_file, "--max-model-len", "512", "--num-kv-blocks", "64", "--log-level", "warning",
                         "--trust-request-chat-template", "--max-stage-restarts", "0"])
    yield srv
    srv.stop()


def client(server, key=KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_api_key(server):
    async def go():
        with pytest.raises(openai.AuthenticationError) as e:
            await client(server, "wrong-key").completions.create(model="smol", prompt="hi", max_tokens=1)
        assert e.value.status_code == 401
        assert set(e.value.body) == {"message", "type", "param", "code"}
        with pytest.raises(openai.AuthenticationError):
            await client(server, "wrong-key").models.list()
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):
                async with s.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers) as r:
                    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            for path in ("/health", "/version", "/metrics"):  # not part of the API: no key needed
                async with s.get(server.url + path) as r:
                    assert r.status == 200, path
        assert [m.id for m in (await client(server).models.list()).data] == ["smol"]
    run(go())


def test_chat_template_file_and_single_bos(server, bos_tokenizer, tokenizer):
    async def go():
        return await client(server).chat.completions.create(model="smol", messages=FRANCE, temperature=0,
                                                            max_tokens=20)

    r = run(go())
    assert r.choices[0].message.content == "The capital of France is Paris."
    text = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    single = bos_tokenizer.encode(text, add_special_tokens=False)
    assert single[0] == 1 and single[1] != 1
    assert bos_tokenizer.encode(text)[:2] == [1, 1]  # what a naive encode would have sent
    assert r.usage.prompt_tokens == len(single)


def test_request_chat_template_and_add_special_tokens(server, bos_tokenizer):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

    async def go():
        c = client(server)
        plain = await c.chat.completions.create(model="smol", messages=FRANCE, max_tokens=2, temperature=0,
                                                extra_body={"chat_template": template})
        with_bos = await c.chat.completions.create(model="smol", messages=FRANCE, max_tokens=2, temperature=0,
                                                   extra_body={"chat_template": template,
                                                               "add_special_tokens": True})
        return plain, with_bos

    plain, with_bos = run(go())
    rendered = "user: What is the capital of France?\nassistant:"
    assert plain.usage.prompt_tokens == len(bos_tokenizer.encode(rendered, add_special_tokens=False))
    assert with_bos.usage.prompt_tokens == plain.usage.prompt_tokens + 1


def test_completion_prompt_gets_the_tokenizers_bos(server, bos_tokenizer):
    async def go():
        c = client(server)
        return await asyncio.gather(c.completions.create(model="smol", prompt="Hello there", max_tokens=1),
                                    c.completions.create(model="smol", prompt=[9, 10, 11], max_tokens=1))

    text, ids = run(go())
    assert text.usage.prompt_tokens == len(bos_tokenizer.encode("Hello there", add_special_tokens=False)) + 1
    assert ids.usage.prompt_tokens == 3  # token ids are taken as they are


class _StubEngine:
    """Just enough of AsyncEngine for requests that fail before reaching it (its ``prepare`` and
    input checks, no core)."""

    prepare = AsyncEngine.prepare

    def __init__(self, tokenizer):
        self.inputs = InputProcessor(tokenizer, 49152, 512, 32, 16)
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(model=SimpleNamespace(model="/nowhere"))
        self.max_model_len, self.vocab_size, self.metrics, self.is_healthy = 512, 49152, None, True


def test_model_without_chat_template_gets_400(bos_tokenizer):
    """In-process server (aiohttp TestServer) around a stub engine: chat needs a template."""
    from aiohttp.test_utils import TestServer

    from zpp.server.app import OpenAIServer

    async def go():
        srv = TestServer(OpenAIServer(_StubEngine(bos_tokenizer), "smol").build_app(), auto_decompress=False)
        await srv.start_server()
        try:
            c = AsyncOpenAI(base_url=str(srv.make_url("/v1")), api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="smol", messages=FRANCE)
            assert "no chat template" in e.value.body["message"] and "--chat-template" in e.value.body["message"]
            assert e.value.body["param"] == "messages"
        finally:
            await srv.close()
    run(go())


def test_missing_chat_template_file_fails_before_start(demo_model, tmp_path):
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "zpp.cli", "serve", demo_model, "--chat-template",
                        str(tmp_path / "nope.jinja"), "--port", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--chat-template" in p.stderr and "nope.jinja" in p.stderr
    assert "stage" not in p.stderr  # no worker was started
    assert time.monotonic() - t < 60


def test_engine_death_mid_stream(server):
    """Last in this module: a worker killed mid-stream -> an error event on the stream, /health
    503, then the server exits with status 1 and leaves no process behind."""
    async def go():
        c = client(server)
        stream = await c.completions.create(model="smol", prompt="Count: 1, 2, 3,", max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
        first = await stream.__anext__()
        assert first.choices[0].text is not None
        kids = descendants(server.proc.pid)
        workers = [p for p in kids if open(f"/proc/{p}/cmdline").read().startswith("zpp::stage")]
        assert workers
        os.kill(workers[0], signal.SIGKILL)
        with pytest.raises(openai.APIError) as e:
            async for _ in stream:
                pass
        assert "dead" in str(e.value.message) or "died" in str(e.value.message)
        saw_503 = False
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(server.url + "/health") as r:
                        if r.status == 503:
                            saw_503 = True
                            break
                except aiohttp.ClientError:
                    break
                await asyncio.sleep(0.02)
        return kids, saw_503

    kids, saw_503 = run(go())
    assert saw_503
    assert server.proc.wait(30) == 1
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in kids if alive(p)]
