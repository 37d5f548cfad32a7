"""A corpus of malformed and hostile requests against one live ``zpp serve``: every one gets a 4xx
in OpenAI's error shape within a second, and afterwards the server answers a greedy request
exactly as it did before the corpus, with nothing left running.

What the corpus covers: broken JSON and encodings, Content-Encodings the server cannot undo (415:
br, zstd, unknown names) and bodies that do not decode (400), NaN/inf, bodies past --max-request-body-bytes
(plain, chunked, gzip bomb), deep nesting, texts and token lists far past max_model_len, wrong types
in every field, out-of-range values, token ids outside the vocabulary, empty prompts and messages,
wrong roles, stop lists past --max-stop-sequences, unknown keys in stream_options, unsupported features, request
chat templates (refused without --trust-request-chat-template) and wrong routes.

(Legitimate but unusual values — a negative seed inside 64 bits, top_k of 10**12, temperature 1e300 —
are valid requests, as in vLLM; they are not in this corpus. Seeds outside 64 bits are.)
"""
from __future__ import annotations

import asyncio
import gzip
import json
import time
import zlib

import aiohttp
import pytest

from helpers import ServerProcess, parse_metrics

C, H = "/v1/completions", "/v1/chat/completions"
FR = [{"role": "user", "content": "What is the capital of France?"}]
MAX_MODEL_LEN, BODY_LIMIT = 1024, 1 << 20
GREEDY = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server(demo_model):
    srv = ServerProcess([demo_model, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "32",
                         "--max-request-body-bytes", "1MiB", "--max-stop-sequences", "16",
                         "--log-level", "warning"])
    try:
        srv.reference = _post_json(srv, C, GREEDY)  # before any bad request
        assert srv.reference[0] == 200, srv.reference
        yield srv
    finally:  # also when the reference request fails: no server left behind
        srv.stop()


def _post_json(server, path, body) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + path, json=body) as r:
                return r.status, await r.json()
    return asyncio.run(go())


def _chunks(data: bytes, size: int = 1 << 16):
    async def gen():
        for i in range(0, len(data), size):
            yield data[i:i + size]
    return gen()


def _nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * depth + inner + b"}" * depth


def _gzip_bomb(total: int) -> bytes:
    """A gzip body that inflates to ``total`` bytes of a JSON prompt (a few hundred KB on the wire)."""
    z = gzip.zlib.compressobj(9, gzip.zlib.DEFLATED, 31)
    chunk = b"a" * (1 << 20)
    parts = [z.compress(b'{"prompt": "')] + [z.compress(chunk) for _ in range(total >> 20)]
    return b"".join(parts + [z.compress(b'"}'), z.flush()])


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def chat(**kw) -> bytes:
    return j({"messages": FR, "max_tokens": 2, **kw})


def comp(**kw) -> bytes:
    return j({"prompt": "hi", "max_tokens": 2, **kw})


# (id, method, path, body bytes, extra headers, expected status, expected param or None)
CORPUS = [
    # --- not JSON, not an object, bad encodings ---------------------------------------------------
    ("empty-body", "POST", C, b"", {}, 400, None),
    ("truncated-json", "POST", C, b'{"prompt": "hi", "max_tok', {}, 400, None),
    ("truncated-chat", "POST", H, b'{"messages": [{"role": "user", "content": "hi"}', {}, 400, None),
    ("json-null", "POST", C, b"null", {}, 400, None),
    ("json-array", "POST", H, b"[1, 2, 3]", {}, 400, None),
    ("json-string", "POST", C, b'"prompt"', {}, 400, None),
    ("trailing-garbage", "POST", C, b'{"prompt": "hi"} {"prompt": "again"}', {}, 400, None),
    ("nan-literal", "POST", C, b'{"prompt": "hi", "temperature": NaN}', {}, 400, None),
    ("infinity-literal", "POST", H, b'{"messages": [], "top_p": Infinity}', {}, 400, None),
    ("inf-by-overflow", "POST", C, b'{"prompt": "hi", "temperature": 1e999}', {}, 400, "temperature"),
    ("minus-inf-penalty", "POST", C, b'{"prompt": "hi", "presence_penalty": -1e999}', {}, 400,
     "presence_penalty"),
    ("inf-chat-frequency", "POST", H, b'{"messages": [], "frequency_penalty": 1e400}', {}, 400,
     "frequency_penalty"),
    ("invalid-utf8-prompt", "POST", C, b'{"prompt": "\xff\xfe\xfa"}', {}, 400, None),
    ("invalid-utf8-chat", "POST", H, b'{"messages": [{"role": "user", "content": "caf\xc3"}]}', {}, 400, None),
    ("lone-surrogate", "POST", C, b'{"prompt": "x\\ud800y"}', {}, 400, None),
    ("utf16-body", "POST", C, '{"prompt": "hi"}'.encode("utf-16"), {}, 400, None),
    ("deep-array-body", "POST", C, b"[" * 200_000 + b"]" * 200_000, {}, 400, None),
    ("deep-template-kwargs", "POST", H, b'{"messages": [], "chat_template_kwargs": ' + _nested(100_000) + b"}",
     {}, 400, None),
    ("deep-message-content", "POST", H, b'{"messages": [{"role": "user", "content": [' + _nested(100_000)
     + b"]}]}", {}, 400, None),
    # --- Content-Encoding: unsupported or unknown codings (415), bodies that do not decode (400) ---
    ("content-encoding-br", "POST", C, j(GREEDY), {"Content-Encoding": "br"}, 415, None),
    ("content-encoding-zstd", "POST", H, chat(), {"Content-Encoding": "zstd"}, 415, None),
    ("content-encoding-compress", "POST", C, j(GREEDY), {"Content-Encoding": "compress"}, 415, None),
    ("content-encoding-unknown", "POST", C, j(GREEDY), {"Content-Encoding": "foo"}, 415, None),
    ("content-encoding-unknown-in-list", "POST", C, gzip.compress(j(GREEDY)), {"Content-Encoding": "gzip, foo"},
     415, None),
    ("content-encoding-unknown-tokenize", "POST", "/tokenize", j({"prompt": "hi"}), {"Content-Encoding": "foo"},
     415, None),
    ("content-encoding-5-stacked", "POST", C, j(GREEDY), {"Content-Encoding": ", ".join(["gzip"] * 5)}, 415, None),
    ("gzip-corrupt", "POST", C, b"\x1f\x8b\x08\x00" + b"garbage" * 10, {"Content-Encoding": "gzip"}, 400, None),
    ("deflate-corrupt", "POST", H, b"xxxx" + b"garbage" * 10, {"Content-Encoding": "deflate"}, 400, None),
    ("gzip-truncated", "POST", C, gzip.compress(j(GREEDY))[:-12], {"Content-Encoding": "gzip"}, 400, None),
    ("deflate-truncated", "POST", C, zlib.compress(j(GREEDY))[:-6], {"Content-Encoding": "deflate"}, 400, None),
    ("gzip-label-on-plain-body", "POST", C, j(GREEDY), {"Content-Encoding": "gzip"}, 400, None),
    ("gzip-trailing-garbage", "POST", C, gzip.compress(j(GREEDY)) + b"junk", {"Content-Encoding": "gzip"}, 400,
     None),
    ("deflate-trailing-garbage", "POST", C, zlib.compress(j(GREEDY)) + b"junk", {"Content-Encoding": "deflate"},
     400, None),
    # --- size -------------------------------------------------------------------------------------
    ("10MB-body", "POST", C, j({"prompt": "a" * 10_000_000}), {}, 413, None),
    ("10MB-chunked", "POST", C, "chunked:" + "a" * 10_000_000, {}, 413, None),
    ("gzip-bomb-200MB", "POST", C, _gzip_bomb(200 << 20),
     {"Content-Encoding": "gzip"}, 413, None),
    ("400KB-text-prompt", "POST", C, j({"prompt": "a" * 400_000}), {}, 400, "prompt"),
    ("300k-token-ids", "POST", C, j({"prompt": [1] * 300_000}), {}, 400, "prompt"),
    ("batch-token-list-too-long", "POST", C, j({"prompt": [[1, 2], [1] * 2000]}), {}, 400, "prompt"),
    ("20k-messages", "POST", H, j({"messages": [{"role": "user", "content": "x"}] * 20_000}), {}, 400,
     "messages"),
    # tokens past max_model_len, characters under the cheap pre-check: chat names its own field
    ("chat-tokens-past-context", "POST", H, chat(messages=[{"role": "user", "content": "hello " * 1500}]), {}, 400,
     "messages"),
    # --- wrong types ------------------------------------------------------------------------------
    ("prompt-int", "POST", C, j({"prompt": 123}), {}, 400, "prompt"),
    ("prompt-object", "POST", C, j({"prompt": {"text": "hi"}}), {}, 400, "prompt"),
    ("prompt-floats", "POST", C, j({"prompt": [1.5, 2.5]}), {}, 400, "prompt"),
    ("prompt-bools", "POST", C, j({"prompt": [True, False]}), {}, 400, "prompt"),
    ("prompt-mixed-lists", "POST", C, j({"prompt": [[1, "a"]]}), {}, 400, "prompt"),
    ("prompt-missing", "POST", C, j({"max_tokens": 2}), {}, 400, "prompt"),
    ("max-tokens-string", "POST", C, comp(max_tokens="10"), {}, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, comp(max_tokens=1.5), {}, 400, "max_tokens"),
    ("temperature-string", "POST", H, chat(temperature="hot"), {}, 400, "temperature"),
    ("n-string", "POST", C, comp(n="2"), {}, 400, "n"),
    ("stream-string", "POST", C, comp(stream="yes"), {}, 400, "stream"),
    ("stop-int", "POST", C, comp(stop=5), {}, 400, "stop"),
    ("stop-list-of-ints", "POST", H, chat(stop=[1, 2]), {}, 400, "stop"),
    ("seed-string", "POST", C, comp(seed="42"), {}, 400, "seed"),
    ("echo-string", "POST", C, comp(echo="true"), {}, 400, "echo"),
    ("logprobs-bool-completions", "POST", C, comp(logprobs=True), {}, 400, "logprobs"),
    ("logprobs-int-chat", "POST", H, chat(logprobs=5), {}, 400, "logprobs"),
    ("messages-string", "POST", H, j({"messages": "hi"}), {}, 400, "messages"),
    ("message-without-role", "POST", H, j({"messages": [{"content": "hi"}]}), {}, 400, "messages"),
    ("role-int", "POST", H, j({"messages": [{"role": 1, "content": "hi"}]}), {}, 400, "messages"),
    ("content-int", "POST", H, j({"messages": [{"role": "user", "content": 5}]}), {}, 400, "messages"),
    ("message-as-pair", "POST", H, j({"messages": [["user", "hi"]]}), {}, 400, "messages"),
    ("content-image-part", "POST", H, j({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}), {}, 400, "messages"),
    ("model-int", "POST", C, comp(model=5), {}, 400, "model"),
    ("stream-options-string", "POST", C, comp(stream=True, stream_options="yes"), {}, 400, "stream_options"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), {}, 400,
     "stream_options"),
    ("stop-token-ids-strings", "POST", C, comp(stop_token_ids=["a"]), {}, 400, "stop_token_ids"),
    # --- out of range -----------------------------------------------------------------------------
    ("n-zero", "POST", C, comp(n=0), {}, 400, "n"),
    ("n-negative", "POST", H, chat(n=-1), {}, 400, "n"),
    ("n-million", "POST", C, comp(n=10 ** 6), {}, 400, "n"),
    ("n-2**64", "POST", C, comp(n=2 ** 64), {}, 400, "n"),
    ("logprobs-21", "POST", C, comp(logprobs=21), {}, 400, "logprobs"),
    ("logprobs-million", "POST", C, comp(logprobs=10 ** 6), {}, 400, "logprobs"),
    ("logprobs-negative", "POST", C, comp(logprobs=-1), {}, 400, "logprobs"),
    ("top-logprobs-21", "POST", H, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", "POST", H, chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("prompt-logprobs-huge", "POST", C, comp(prompt_logprobs=10 ** 9), {}, 400, "prompt_logprobs"),
    ("max-tokens-billion", "POST", C, comp(max_tokens=10 ** 9), {}, 400, "max_tokens"),
    ("max-tokens-2**64", "POST", C, comp(max_tokens=2 ** 64), {}, 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-1), {}, 400, "max_tokens"),
    ("max-completion-tokens-huge", "POST", H, chat(max_completion_tokens=10 ** 6), {}, 400,
     "max_completion_tokens"),
    ("max-tokens-past-kv-cache", "POST", C, comp(max_tokens=900), {}, 400, "max_tokens"),
    ("chat-max-tokens-zero", "POST", H, chat(max_tokens=0), {}, 400, "max_tokens"),  # a reply of no tokens
    ("chat-max-completion-tokens-zero", "POST", H, chat(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=5), {}, 400, "min_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-0.5), {}, 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), {}, 400, "top_p"),
    ("top-p-1.5", "POST", H, chat(top_p=1.5), {}, 400, "top_p"),
    ("min-p-2", "POST", C, comp(min_p=2), {}, 400, "min_p"),
    ("top-k-negative", "POST", C, comp(top_k=-5), {}, 400, "top_k"),
    ("presence-penalty-3", "POST", C, comp(presence_penalty=3), {}, 400, "presence_penalty"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("seed-below-int64", "POST", C, comp(seed=-2 ** 63 - 1), {}, 400, "seed"),
    ("seed-negative-float", "POST", C, comp(seed=-1e30), {}, 400, "seed"),
    ("seed-2**64", "POST", H, chat(seed=2 ** 64), {}, 400, "seed"),
    # --- token ids --------------------------------------------------------------------------------
    ("token-id-vocab-size", "POST", C, j({"prompt": [49152]}), {}, 400, "prompt"),
    ("token-id-negative", "POST", C, j({"prompt": [-1]}), {}, 400, "prompt"),
    ("token-id-in-batch", "POST", C, j({"prompt": [[1, 2], [999_999]]}), {}, 400, "prompt"),
    ("token-id-2**70", "POST", C, j({"prompt": [2 ** 70]}), {}, 400, "prompt"),
    ("stop-token-id-vocab-size", "POST", C, comp(stop_token_ids=[49152]), {}, 400, "stop_token_ids"),
    ("stop-token-id-negative", "POST", C, comp(stop_token_ids=[-1]), {}, 400, "stop_token_ids"),
    # --- empty ------------------------------------------------------------------------------------
    ("prompt-empty-string", "POST", C, j({"prompt": ""}), {}, 400, "prompt"),
    ("prompt-empty-list", "POST", C, j({"prompt": []}), {}, 400, "prompt"),
    ("prompt-empty-token-list", "POST", C, j({"prompt": [[]]}), {}, 400, "prompt"),
    ("messages-empty", "POST", H, j({"messages": []}), {}, 400, "messages"),
    ("chat-empty-object", "POST", H, b"{}", {}, 400, "messages"),
    ("user-content-null", "POST", H, j({"messages": [{"role": "user", "content": None}]}), {}, 400, "messages"),
    # --- roles ------------------------------------------------------------------------------------
    ("role-wizard", "POST", H, j({"messages": [{"role": "wizard", "content": "hi"}]}), {}, 400, "messages"),
    ("role-empty", "POST", H, j({"messages": [{"role": "", "content": "hi"}]}), {}, 400, "messages"),
    ("role-trailing-space", "POST", H, j({"messages": [{"role": "user ", "content": "hi"}]}), {}, 400,
     "messages"),
    # --- stop lists -------------------------------------------------------------------------------
    ("stop-1000-strings", "POST", C, comp(stop=[f"s{i}" for i in range(1000)]), {}, 400, "stop"),
    ("stop-1000-strings-chat", "POST", H, chat(stop=[f"s{i}" for i in range(1000)]), {}, 400, "stop"),
    ("stop-token-ids-1000", "POST", C, comp(stop_token_ids=list(range(1000))), {}, 400, "stop_token_ids"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), {}, 400, "stop"),
    # --- unknown fields and unsupported features --------------------------------------------------
    # (unknown top-level fields are ignored, as in vLLM: tests/server/test_unknown_fields.py)
    ("unknown-field-in-stream-options", "POST", H, chat(stream=True, stream_options={"foo": 1}), {}, 400,
     "stream_options.foo"),
    ("unknown-field-in-stream-options-comp", "POST", C,
     comp(stream=True, stream_options={"include_usage": True, "x": 1}), {}, 400, "stream_options.x"),
    ("guided-whitespace-not-a-string", "POST", H, chat(guided_whitespace_pattern=3), {}, 400,
     "guided_whitespace_pattern"),
    ("max-tokens-zero-completions", "POST", C, comp(max_tokens=0), {}, 400, "max_tokens"),
    ("guided-json-uncompilable", "POST", H, chat(guided_json={"type": "objec"}), {}, 400, "guided_json"),
    ("structured-outputs-two-kinds", "POST", C, comp(structured_outputs={"regex": "a", "choice": ["a"]}), {}, 400,
     "structured_outputs"),
    ("unknown-functions", "POST", H, chat(functions=[{"name": "f"}]), {}, 400, "functions"),
    ("function-call", "POST", H, chat(function_call="auto"), {}, 400, "function_call"),
    ("modalities-audio", "POST", H, chat(modalities=["text", "audio"]), {}, 400, "modalities"),
    ("audio", "POST", H, chat(audio={"voice": "alloy", "format": "wav"}), {}, 400, "audio"),
    ("reasoning-effort-extreme", "POST", H, chat(reasoning_effort="extreme"), {}, 400, "reasoning_effort"),
    ("reasoning-effort-number", "POST", H, chat(reasoning_effort=3), {}, 400, "reasoning_effort"),
    ("prediction", "POST", H, chat(prediction={"type": "content", "content": "x"}), {}, 400, "prediction"),
    ("web-search-options", "POST", H, chat(web_search_options={}), {}, 400, "web_search_options"),
    ("n-wrong-type-null-ok-but-not-string", "POST", H, chat(n="2"), {}, 400, "n"),
    ("suffix", "POST", C, comp(suffix="!"), {}, 400, "suffix"),
    ("best-of", "POST", C, comp(best_of=3), {}, 400, "best_of"),
    ("logit-bias-out-of-range", "POST", C, comp(logit_bias={"1": 500}), {}, 400, "logit_bias"),
    ("logit-bias-not-a-token-id", "POST", H, chat(logit_bias={"one": 5}), {}, 400, "logit_bias"),
    ("response-format-xml", "POST", H, chat(response_format={"type": "xml"}), {}, 400, "response_format"),
    ("response-format-schema-missing", "POST", H, chat(response_format={"type": "json_schema", "json_schema": {}}),
     {}, 400, "response_format"),
    ("tools-not-function", "POST", H, chat(tools=[{"type": "code_interpreter"}]), {}, 400, "tools"),
    ("tool-choice-unknown-function", "POST", H, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                     tool_choice={"type": "function", "function": {"name": "g"}}),
     {}, 400, "tool_choice"),
    # --- templates --------------------------------------------------------------------------------
    ("request-template-nested-loops", "POST", H, chat(chat_template="{% for i in range(100000) %}{% for j in "
                                                      "range(100000) %}x{% endfor %}{% endfor %}"), {}, 400,
     "chat_template"),
    ("template-kwargs-tokenize", "POST", H, chat(chat_template_kwargs={"tokenize": True}), {}, 400, "messages"),
    ("template-kwargs-int", "POST", H, chat(chat_template_kwargs=3), {}, 400, "chat_template_kwargs"),
    ("continue-and-generation-prompt", "POST", H, chat(continue_final_message=True), {}, 400,
     "continue_final_message"),
    # --- routes and models ------------------------------------------------------------------------
    ("unknown-model", "POST", C, comp(model="gpt-4o"), {}, 404, "model"),
    ("post-models", "POST", "/v1/models", b"{}", {}, 405, None),
    ("get-completions", "GET", C, b"", {}, 405, None),
    ("unknown-route", "POST", "/v1/nope", b"{}", {}, 404, None),
    ("dot-dot-route", "GET", "/v1/models/../../etc/passwd", b"", {}, 404, None),
]


def test_corpus_is_large_and_ids_unique():
    ids = [c[0] for c in CORPUS]
    assert len(ids) >= 50 and len(set(ids)) == len(ids)


@pytest.mark.slow
@pytest.mark.parametrize("name,method,path,body,headers,status,param", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_request_gets_4xx_in_openai_shape_within_a_second(server, name, method, path, body, headers,
                                                               status, param):
    async def go():
        data = _chunks(body.removeprefix("chunked:").encode()) if isinstance(body, str) else body
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async with s.request(method, server.url + path, data=data, skip_auto_headers=["Content-Type"],
                                 headers={"Content-Type": "application/json", **headers},
                                 timeout=aiohttp.ClientTimeout(total=10)) as r:
                raw = await r.read()
                return r.status, raw, time.monotonic() - t0

    got, raw, elapsed = asyncio.run(go())
    assert got == status, (got, raw[:300])
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, raw[:300]
    assert isinstance(err["message"], str) and err["message"] and len(err["message"]) < 2000
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert elapsed < 1.0, f"{elapsed:.2f} s"


def _post_raw(server, path: str, body: bytes, headers: dict) -> tuple[int, dict, dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + path, data=body, skip_auto_headers=["Content-Type"],
                              headers={"Content-Type": "application/json", **headers}) as r:
                return r.status, dict(r.headers), json.loads(await r.read())
    return asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("coding", ["br", "zstd", "foo", "gzip, foo"])
def test_unsupported_content_encoding_is_415_naming_what_is_supported(server, coding):
    """An encoding the server cannot undo (never taken for identity) gets 415 Unsupported Media
    Type in OpenAI's shape, its message and Accept-Encoding naming the codings that work."""
    status, headers, body = _post_raw(server, C, j(GREEDY), {"Content-Encoding": coding})
    assert status == 415, body
    msg = body["error"]["message"]
    assert "identity, gzip or deflate" in msg and repr(coding.split(", ")[-1]) in msg, msg
    assert headers.get("Accept-Encoding") == "gzip, deflate"


@pytest.mark.slow
@pytest.mark.parametrize("coding,body", [("gzip", b"\x1f\x8b\x08\x00garbage"), ("deflate", b"xxxxgarbage"),
                                         ("gzip", gzip.compress(j(GREEDY))[:-12])],
                         ids=["gzip-corrupt", "deflate-corrupt", "gzip-truncated"])
def test_undecodable_body_is_400_saying_so(server, coding, body):
    status, _, err = _post_raw(server, C, body, {"Content-Encoding": coding})
    assert status == 400, err
    assert f"could not be decoded as {coding}" in err["error"]["message"], err


def _raw_deflate(data: bytes) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return z.compress(data) + z.flush()


_GREEDY_HEAD, _GREEDY_TAIL = j(GREEDY)[:20], j(GREEDY)[20:]


@pytest.mark.slow
@pytest.mark.parametrize("coding,body", [
    ("gzip", gzip.compress(j(GREEDY))),
    ("GZIP", gzip.compress(j(GREEDY))),  # coding names are case-insensitive
    ("x-gzip", gzip.compress(j(GREEDY))),  # RFC 9110: the same as gzip
    ("gzip", gzip.compress(_GREEDY_HEAD) + gzip.compress(_GREEDY_TAIL)),  # two gzip members
    ("deflate", zlib.compress(j(GREEDY))),  # RFC 1950 zlib stream
    ("deflate", _raw_deflate(j(GREEDY))),  # raw deflate, as some clients send it
    ("gzip, deflate", zlib.compress(gzip.compress(j(GREEDY)))),  # undone last first
    ("identity", j(GREEDY)),
    ("identity, gzip", gzip.compress(j(GREEDY))),
], ids=["gzip", "GZIP", "x-gzip", "gzip-2-members", "deflate-zlib", "deflate-raw", "gzip-then-deflate",
        "identity", "identity-gzip"])
def test_supported_content_encodings_are_undone(server, coding, body):
    status, _, out = _post_raw(server, C, body, {"Content-Encoding": coding})
    assert status == 200, out
    assert out["choices"][0]["text"] == server.reference[1]["choices"][0]["text"]


@pytest.mark.slow
def test_openai_optional_fields_null_and_no_op_fields_are_accepted(server):
    """OpenAI's schema allows null for n, stream, echo and chat logprobs (the default then), and
    knows metadata, store, service_tier, prompt_cache_key, safety_identifier and modalities
    ["text"], which change nothing here: all accepted (a newcomer got "unrecognized request
    argument" for them), with the reference answer; chat without max_tokens fills what the KV
    cache holds (here 512 tokens, under max_model_len 1024) instead of failing."""
    no_ops = dict(n=None, stream=None, metadata={"team": "a"}, store=False, service_tier="auto",
                  prompt_cache_key="k", safety_identifier="u1", user="u1")
    status, out = _post_json(server, C, {**GREEDY, "echo": None, **no_ops})
    assert status == 200, out
    assert out["choices"][0]["text"] == server.reference[1]["choices"][0]["text"]
    status, out = _post_json(server, H, {"messages": FR, "max_tokens": 3, "logprobs": None, "modalities": ["text"],
                                         "functions": None, "function_call": None, **no_ops})
    assert status == 200 and len(out["choices"]) == 1, out
    status, out = _post_json(server, H, {"messages": FR, "temperature": 0, "stop": ["."]})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out


@pytest.mark.slow
def test_reasoning_effort_values_are_accepted(server):
    """OpenAI's reasoning efforts (and null) are served; SmolLM2's chat template does not read the
    variable, so the prompt and the greedy answer are those of the request without it."""
    body = {"messages": FR, "max_tokens": 4, "temperature": 0}
    status, plain = _post_json(server, H, body)
    assert status == 200, plain
    for effort in (None, "none", "minimal", "low", "medium", "high"):
        status, out = _post_json(server, H, {**body, "reasoning_effort": effort})
        assert status == 200, (effort, out)
        assert out["usage"] == plain["usage"], effort
        assert out["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"], effort


@pytest.mark.slow
def test_server_unharmed_after_corpus(server):
    """Runs after the corpus (file order): same greedy answer as before it, healthy, nothing left
    running or holding KV blocks."""
    status, body = _post_json(server, C, GREEDY)
    assert status == 200
    assert body["choices"][0]["text"] == server.reference[1]["choices"][0]["text"]
    assert body["usage"] == server.reference[1]["usage"]

    async def scrape():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert r.status == 200
            async with s.get(server.url + "/metrics") as r:
                return await r.text()
    metrics = parse_metrics(asyncio.run(scrape()))
    for name in ("zpp:num_requests_running", "zpp:num_requests_waiting", "zpp:kv_cache_usage_perc"):
        assert metrics[name] == 0.0, name
    assert server.proc.poll() is None
