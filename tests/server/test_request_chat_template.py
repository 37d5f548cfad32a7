"""A request's own ``chat_template`` needs ``--trust-request-chat-template`` (vLLM's flag): without
it chat (streamed or not) and ``/tokenize`` answer 400 with ``param`` ``chat_template`` and a
message naming the flag; with it the template renders the prompt; docs/serving.md says so where it
describes the field. In-process (:mod:`echo_engine`: the reply is the rendered prompt)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
from echo_engine import MODEL, serve

HI = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
FLAG = "--trust-request-chat-template"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


async def _post(url: str, path: str, body: dict):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json={"model": MODEL, **body}) as r:
            return r.status, await r.text()


def _requests():
    return [("/v1/chat/completions", {"messages": HI, "chat_template": TEMPLATE}),
            ("/v1/chat/completions", {"messages": HI, "chat_template": TEMPLATE, "stream": True}),
            ("/tokenize", {"messages": HI, "chat_template": TEMPLATE})]


def test_request_chat_template_is_refused_naming_the_flag(tokenizer):
    async def test(client, url):
        for path, body in _requests():
            status, text = await _post(url, path, body)
            assert status == 400, (path, body, text)
            err = json.loads(text)["error"]
            assert err["param"] == "chat_template" and err["type"] == "invalid_request_error", err
            assert FLAG in err["message"], err
    serve(tokenizer, test)


def test_request_chat_template_is_used_with_the_flag(tokenizer):
    async def test(client, url):
        status, text = await _post(url, *_requests()[0])
        assert status == 200, text
        assert json.loads(text)["choices"][0]["message"]["content"] == "[user] hi"
        status, text = await _post(url, *_requests()[2])
        assert status == 200 and json.loads(text)["tokens"] == tokenizer.encode("[user] hi"), text
    serve(tokenizer, test, trust_request_chat_template=True)


def test_serving_docs_name_the_flag_where_chat_template_is_described():
    text = re.sub(r"\s+", " ", DOCS.read_text())
    where = [m.start() for m in re.finditer(r"`chat_template`", text)]
    assert where and any(FLAG in text[i:i + 400] for i in where), "docs/serving.md: chat_template without " + FLAG
