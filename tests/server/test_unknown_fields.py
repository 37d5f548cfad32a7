"""Unknown request fields as vLLM treats them (issue 51): an unknown top-level field is ignored,
with one warning line naming a request's unknown fields (once per name) and the response header
``X-Ignored-Fields`` listing them, on chat, completions, responses and /tokenize, streamed or not;
an unknown key inside a known object (``stream_options.foo``) stays a 400 naming its path.
OpenAI's newer fields that clients send by default (``verbosity`` among them) are accepted.

In-process (:mod:`echo_engine`: the real handlers around an engine that answers with its prompt)."""
from __future__ import annotations

import json
import logging

import aiohttp
from echo_engine import MODEL, serve

HI = [{"role": "user", "content": "hi"}]
BODIES = {"/v1/chat/completions": {"model": MODEL, "messages": HI},
          "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 3},
          "/v1/responses": {"model": MODEL, "input": "hi"},
          "/tokenize": {"model": MODEL, "prompt": "hi"}}


async def _post(url: str, path: str, body: dict):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
            return r.status, r.headers, await r.text()


def test_unknown_top_level_fields_are_ignored_logged_once_and_listed(tokenizer, caplog):
    async def test(client, url):
        for path, body in BODIES.items():
            for stream in ((False, True) if path.startswith("/v1/") else (False,)):
                extra = {"stream": True} if stream else {}
                status, headers, text = await _post(url, path, {**body, **extra, "zpp_unknown_a": 1,
                                                                 "zpp unknown,b": {"x": [1]}})
                assert status == 200, (path, text)
                assert headers["X-Ignored-Fields"] == "zpp_unknown_a, zpp%20unknown%2Cb", (path, dict(headers))
                status, plain_headers, plain = await _post(url, path, {**body, **extra})
                assert status == 200 and "X-Ignored-Fields" not in plain_headers
                if not stream and path != "/v1/responses":  # (responses have fresh ids and times)
                    strip = ("id", "created")
                    assert {k: v for k, v in json.loads(text).items() if k not in strip} == \
                        {k: v for k, v in json.loads(plain).items() if k not in strip}, path
        # OpenAI's newer fields through the official client (it sends what it is given).
        r = await client.chat.completions.create(model=MODEL, messages=HI, verbosity="low",
                                                 extra_body={"prompt_cache_retention": "24h", "zpp_new": 1})
        assert r.choices[0].finish_reason == "stop"
        r = await client.responses.create(model=MODEL, input="hi", text={"verbosity": "high"},
                                          extra_body={"zpp_new": 2})
        assert r.status == "completed"

    with caplog.at_level(logging.WARNING, logger="zpp.server.app"):
        serve(tokenizer, test)
    lines = [r.getMessage() for r in caplog.records if "ignored unknown request field" in r.getMessage()]
    # One line for the first request with each new name (naming all of its unknown fields), none after.
    assert len(lines) == 2, lines
    assert "'zpp_unknown_a'" in lines[0] and "'zpp unknown,b'" in lines[0] and "/v1/chat/completions" in lines[0]
    assert "'zpp_new'" in lines[1]
    assert all(r.levelname == "WARNING" for r in caplog.records if "ignored unknown" in r.getMessage())


def test_unknown_keys_inside_known_objects_are_400s_naming_the_path(tokenizer):
    async def test(client, url):
        for path, body, param in [
                ("/v1/chat/completions", {"messages": HI, "stream": True, "stream_options": {"foo": 1}},
                 "stream_options.foo"),
                ("/v1/completions", {"prompt": "hi", "stream": True,
                                     "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
                ("/v1/responses", {"input": "hi", "stream": True, "stream_options": {"obfuscate": 1}},
                 "stream_options.obfuscate"),
                ("/v1/chat/completions", {"messages": HI, "verbosity": "loud"}, "verbosity"),
                ("/v1/responses", {"input": "hi", "text": {"verbosity": "loud"}}, "text.verbosity")]:
            status, headers, text = await _post(url, path, {**body, "zpp_ignored": 1})
            assert status == 400, (path, text)
            err = json.loads(text)["error"]
            assert err["param"] == param, err
            assert param.split(".")[-1] in err["message"]
        # Unknown keys inside messages are ignored (clients replay what the server returned).
        status, _, text = await _post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi", "annotations": [], "refusal": None}]})
        assert status == 200, text
    serve(tokenizer, test)
