"""The HTTP bodies of a fixed set of requests, compared with golden files recorded from an earlier
version of the server (``tests/server/golden/http.json``): the front door can be restructured without
changing one byte a client sees.

One live ``zpp serve`` (the shared PP=2 server, real SmolLM2 on the CPU, greedy decoding) gets
completions, chat, streams (SSE), logprobs / top_logprobs, echo, prompt logprobs, tools with each
tool_choice, structured outputs, a range of 4xx errors, /v1/models, /tokenize and /detokenize,
one request at a time.

What may differ between runs, and only that, is normalised:
- ids (``cmpl-…``, ``chatcmpl-…``, tool-call ids), ``created``, the model directory;
- floats are compared to 1e-3 (logprobs differ in their last bits between CPUs); the text with
  every float masked is compared byte for byte;
- a stream's chunking (how many engine steps one SSE event carries depends on timing): the events
  of each choice are merged into one (text concatenated, lists joined, tool-call deltas merged by
  index, the last finish reason kept; per-chunk ``continuous_usage_stats`` dropped), every event
  must be ``data: <json>\\n\\n`` and the stream must end with ``data: [DONE]``.

Record anew (only on purpose, from a server whose bodies are known right)::

    ZPP_RECORD_GOLDEN=1 python -m pytest -q tests/server/test_http_golden.py
"""
from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.slow  # servers / engines (see tests/helpers.py)

GOLDEN = Path(__file__).parent / "golden" / "http.json"
RECORD = os.environ.get("ZPP_RECORD_GOLDEN") == "1"

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
G = {"temperature": 0}  # greedy

C, CH = "/v1/completions", "/v1/chat/completions"
# (name, method, path, json body (or raw bytes), extra headers)
CASES = [
    ("models", "GET", "/v1/models", None, None),
    ("model", "GET", f"/v1/models/{MODEL}", None, None),
    ("model_404", "GET", "/v1/models/nope", None, None),
    ("health", "GET", "/health", None, None),
    ("no_route", "GET", "/v1/nothing", None, None),
    # --- completions
    ("cmpl", "POST", C, {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, **G}, None),
    ("cmpl_default_max", "POST", C, {"prompt": "Once upon a time", **G}, None),
    ("cmpl_two_prompts_n2", "POST", C, {"prompt": ["One, two,", "Red, green,"], "max_tokens": 5, "n": 2, **G}, None),
    ("cmpl_token_ids", "POST", C, {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 5, **G}, None),
    ("cmpl_logprobs_echo", "POST", C, {"prompt": "The capital of France is", "max_tokens": 4, "logprobs": 3,
                                       "echo": True, **G}, None),
    ("cmpl_echo_score_only", "POST", C, {"prompt": "Paris is in France", "max_tokens": 0, "logprobs": 2,
                                         "echo": True, **G}, None),
    ("cmpl_prompt_logprobs", "POST", C, {"prompt": "Hello world", "max_tokens": 3, "prompt_logprobs": 2, **G}, None),
    ("cmpl_stop", "POST", C, {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "stop": [" 7"], **G}, None),
    ("cmpl_stream", "POST", C, {"prompt": "The capital of France is", "max_tokens": 8, "stream": True,
                                "logprobs": 2, "stream_options": {"include_usage": True}, **G}, None),
    ("cmpl_stream_echo_n2", "POST", C, {"prompt": "Red, green,", "max_tokens": 5, "stream": True, "echo": True,
                                        "n": 2, **G}, None),
    ("cmpl_stream_continuous", "POST", C, {"prompt": "Hello", "max_tokens": 4, "stream": True,
                                           "stream_options": {"include_usage": True,
                                                              "continuous_usage_stats": True}, **G}, None),
    ("cmpl_json_schema", "POST", C, {"prompt": "A person as JSON:", "max_tokens": 40,
                                     "structured_outputs": {"json": PERSON}, **G}, None),
    ("cmpl_gzip", "POST", C, gzip.compress(json.dumps({"prompt": "Hi", "max_tokens": 3, **G}).encode()),
     {"Content-Encoding": "gzip", "Content-Type": "application/json"}),
    # --- chat
    ("chat", "POST", CH, {"model": MODEL, "messages": FRANCE, "max_tokens": 12, **G}, None),
    ("chat_logprobs", "POST", CH, {"messages": FRANCE, "max_completion_tokens": 5, "logprobs": True,
                                   "top_logprobs": 2, **G}, None),
    ("chat_prompt_logprobs", "POST", CH, {"messages": FRANCE, "max_tokens": 2, "prompt_logprobs": 1, **G}, None),
    ("chat_stream", "POST", CH, {"messages": FRANCE, "max_tokens": 12, "stream": True,
                                 "stream_options": {"include_usage": True}, **G}, None),
    ("chat_stream_logprobs_n2", "POST", CH, {"messages": FRANCE, "max_tokens": 6, "stream": True, "n": 2,
                                             "logprobs": True, "top_logprobs": 1, **G}, None),
    ("chat_stream_continuous", "POST", CH, {"messages": FRANCE, "max_tokens": 5, "stream": True,
                                            "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}, **G}, None),
    ("chat_system_developer", "POST", CH, {"messages": [{"role": "developer", "content": "Answer in one word."},
                                                        *FRANCE], "max_tokens": 6, **G}, None),
    ("chat_response_format", "POST", CH, {"messages": [{"role": "user", "content": "Describe Anna, 31, as JSON."}],
                                          "max_tokens": 40, "response_format": {
                                              "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                                          **G}, None),
    ("tools_auto", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 40, **G}, None),
    ("tools_none", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "tool_choice": "none", "max_tokens": 10,
                                **G}, None),
    ("tools_required", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "tool_choice": "required",
                                    "max_tokens": 60, **G}, None),
    # a forced call with a response_format (pydantic-ai's NativeOutput): the call's grammar wins
    ("tools_required_with_format", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "tool_choice": "required",
                                                "response_format": {"type": "json_object"}, "max_tokens": 60, **G},
     None),
    ("tools_named", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 40, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}, **G}, None),
    ("tools_required_stream", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "tool_choice": "required",
                                           "max_tokens": 60, "stream": True, **G}, None),
    ("tools_named_stream", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 40, "stream": True,
                                        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                                        **G}, None),
    ("tools_auto_stream", "POST", CH, {"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 40, "stream": True,
                                       **G}, None),
    # --- errors
    ("err_model", "POST", C, {"model": "nope", "prompt": "x"}, None),
    ("err_unknown_field", "POST", C, {"prompt": "x", "stream": True, "stream_options": {"frobnicate": 1}}, None),
    ("err_bad_json", "POST", C, b"{not json", {"Content-Type": "application/json"}),
    ("err_missing_prompt", "POST", C, {"max_tokens": 3}, None),
    ("err_empty_prompt_list", "POST", C, {"prompt": []}, None),
    ("err_prompt_form", "POST", C, {"prompt": [1, "a"]}, None),
    ("err_max_tokens_too_large", "POST", C, {"prompt": "x", "max_tokens": 100000}, None),
    ("err_max_tokens_negative", "POST", C, {"prompt": "x", "max_tokens": -1}, None),
    ("err_temperature", "POST", C, {"prompt": "x", "temperature": -1}, None),
    ("err_top_p", "POST", C, {"prompt": "x", "top_p": 2}, None),
    ("err_token_out_of_vocab", "POST", C, {"prompt": [1, 10 ** 7], "max_tokens": 2}, None),
    ("err_stop_token_out_of_vocab", "POST", C, {"prompt": "x", "stop_token_ids": [10 ** 7]}, None),
    ("err_suffix", "POST", C, {"prompt": "x", "suffix": "y"}, None),
    ("err_best_of", "POST", C, {"prompt": "x", "best_of": 3}, None),
    ("err_n", "POST", C, {"prompt": "x", "n": 0}, None),
    ("err_logprobs_too_many", "POST", C, {"prompt": "x", "logprobs": 1000}, None),
    ("err_too_many_stops", "POST", C, {"prompt": "x", "stop": ["a"] * 65}, None),
    ("err_content_encoding", "POST", C, b"{}", {"Content-Encoding": "br", "Content-Type": "application/json"}),
    ("err_bad_grammar", "POST", C, {"prompt": "x", "structured_outputs": {"grammar": "root ::= ("}}, None),
    ("err_two_constraints", "POST", C, {"prompt": "x", "structured_outputs": {"regex": "a"},
                                        "guided_choice": ["a"]}, None),
    ("err_chat_empty", "POST", CH, {"messages": []}, None),
    ("err_chat_role", "POST", CH, {"messages": [{"role": "robot", "content": "hi"}]}, None),
    ("err_chat_no_content", "POST", CH, {"messages": [{"role": "user"}]}, None),
    ("err_chat_image", "POST", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None),
    ("err_chat_top_logprobs", "POST", CH, {"messages": FRANCE, "top_logprobs": 2}, None),
    ("err_chat_template_refused", "POST", CH, {"messages": FRANCE, "chat_template": "{{ 1 }}"}, None),
    ("err_chat_continue_and_gen", "POST", CH, {"messages": FRANCE, "continue_final_message": True}, None),
    ("err_chat_mct_too_large", "POST", CH, {"messages": FRANCE, "max_completion_tokens": 100000}, None),
    ("err_chat_unsupported", "POST", CH, {"messages": FRANCE, "audio": {"voice": "x"}}, None),
    ("err_tools_bad_type", "POST", CH, {"messages": FRANCE, "tools": [{"type": "retrieval"}]}, None),
    ("err_tool_choice_unknown", "POST", CH, {"messages": FRANCE, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, None),
    ("err_tool_choice_without_tools", "POST", CH, {"messages": FRANCE, "tool_choice": "required"}, None),
    ("err_tools_and_format", "POST", CH, {"messages": FRANCE, "tools": TOOLS, "tool_choice": "required",
                                          "structured_outputs": {"json_object": True}}, None),
    ("err_stream_options_without_stream", "POST", CH, {"messages": FRANCE, "stream_options": {
        "include_usage": True}}, None),
    # --- /tokenize, /detokenize
    ("tokenize_prompt", "POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True}, None),
    ("tokenize_messages", "POST", "/tokenize", {"messages": FRANCE}, None),
    ("tokenize_both", "POST", "/tokenize", {"prompt": "x", "messages": FRANCE}, None),
    ("tokenize_neither", "POST", "/tokenize", {}, None),
    ("detokenize", "POST", "/detokenize", {"tokens": [19556, 905]}, None),
    ("detokenize_bad", "POST", "/detokenize", {"tokens": [10 ** 7]}, None),
]

_IDS = re.compile(r'"(cmpl|chatcmpl|chatcmpl-tool)-[0-9a-f]{32}"')
_CREATED = re.compile(r'"created": ?\d+')
_FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")
_SCALARS = ("finish_reason", "stop_reason", "id", "object", "created", "model")


def _normalise_text(text: str, model_dir: str) -> str:
    text = _IDS.sub(lambda m: f'"{m.group(1)}-<id>"', text)
    text = _CREATED.sub('"created": 0', text)
    return text.replace(json.dumps(model_dir)[1:-1], "<model-dir>")


def _merge(a, b):
    """Two consecutive stream chunks of one choice as one (see the module docstring)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            if k in _SCALARS or k not in out:
                out[k] = v if v is not None or k not in out else out[k]
            else:
                out[k] = _merge(out[k], v)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, dict) and "index" in x for x in a + b):  # tool-call deltas
            by = {x["index"]: x for x in a}
            for x in b:
                by[x["index"]] = _merge(by[x["index"]], x) if x["index"] in by else x
            return [by[i] for i in sorted(by)]
        return a + b
    if isinstance(a, str) and isinstance(b, str):
        return a + b
    return b


def _canonical_stream(text: str) -> dict:
    """A stream's events, one per choice (merged), then the others (usage, errors) in order."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text[:-len("data: [DONE]\n\n")].split("\n\n")
    assert events[-1] == "", repr(events[-1])
    choices, others = {}, []
    for e in events[:-1]:
        assert e.startswith("data: "), e
        body = json.loads(e[len("data: "):])
        if body.get("choices"):
            assert len(body["choices"]) == 1, body
            idx = body["choices"][0]["index"]
            if "usage" in body:
                body["usage"] = "<continuous usage>"
            choices[idx] = _merge(choices.get(idx), body)
        else:
            others.append(body)
    return {"choices": [choices[i] for i in sorted(choices)], "others": others}


def _masked(obj) -> tuple[str, list[float]]:
    """``obj`` as JSON with every float replaced by ``<f>``, and the floats."""
    text = json.dumps(obj, ensure_ascii=False)
    return _FLOAT.sub("<f>", text), [float(x) for x in _FLOAT.findall(text)]


def _observe(server, demo_model, method, path, body, headers) -> dict:
    kw = {"timeout": 120, "headers": headers or {}}
    if isinstance(body, bytes):
        kw["data"] = body
    elif body is not None:
        kw["json"] = body
    r = requests.request(method, server.url + path, **kw)
    ctype = r.headers.get("Content-Type", "")
    text = _normalise_text(r.content.decode("utf-8"), demo_model)
    if ctype.startswith("text/event-stream"):
        content = {"stream": _canonical_stream(text)}
    else:
        content = {"body": text}
    return {"status": r.status_code, "content_type": ctype, **content}


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    return shared_pp2_server


@pytest.fixture(scope="module")
def observed(server, demo_model) -> dict:
    got = {name: _observe(server, demo_model, *rest) for name, *rest in CASES}
    if RECORD:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    return got


@pytest.fixture(scope="module")
def golden(observed) -> dict:  # after ``observed``, which writes the file when recording
    return json.loads(GOLDEN.read_text())


def test_golden_covers_every_case(golden):
    assert sorted(golden) == sorted(name for name, *_ in CASES)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_http_body_unchanged(name, observed, golden):
    got, want = observed[name], golden[name]
    assert (got["status"], got["content_type"]) == (want["status"], want["content_type"])
    if "body" in want:
        assert "body" in got
        gm, gf = _masked(got["body"])
        wm, wf = _masked(want["body"])
    else:
        assert "stream" in got
        gm, gf = _masked(got["stream"])
        wm, wf = _masked(want["stream"])
    assert gm == wm
    assert gf == pytest.approx(wf, abs=1e-3)
