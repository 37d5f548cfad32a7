"""``POST /v1/responses`` (stateless) and ``GET /openapi.json`` through the official ``openai``
client against one live ``zpp serve`` at --pipeline-parallel-size 2 (the real SmolLM2 weights,
CPU; the ``shared_pp2_server`` the other OpenAI-API modules use). A Responses request runs on the
chat path, so its greedy output and token counts are checked against the equivalent chat
completion request."""
from __future__ import annotations

import json

import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow  # servers / engines (see tests/helpers.py)

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
TOKENS = 12  # max_output_tokens of the text tests (greedy: temperature 0)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                                "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def server(shared_pp2_server):
    return shared_pp2_server


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_text_and_message_input_match_the_chat_path(client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS)
    c = chat(client, [{"role": "user", "content": QUESTION}], max_completion_tokens=TOKENS)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert r.to_dict()["store"] is False  # store left out: served statelessly, and the response says so
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].status == "completed"
    assert r.output_text == c.choices[0].message.content and "Paris" in r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # A reasoning effort is accepted and echoed; SmolLM2's template does not read it: same answer.
    e = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS,
                                reasoning={"effort": "low", "summary": None})
    assert e.output_text == r.output_text and e.usage.input_tokens == r.usage.input_tokens
    assert e.reasoning.effort == "low" and r.reasoning is None

    # A message list with instructions (a system message first), developer role as system, and
    # content as input_text parts; store: false is accepted.
    instructions = "You are a geography teacher. Answer in one short sentence."
    r = client.responses.create(model=MODEL, instructions=instructions, store=False, temperature=0,
                                max_output_tokens=TOKENS,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    c = chat(client, [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION}],
             max_completion_tokens=TOKENS)
    assert r.instructions == instructions
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens

    # A cut-off output is incomplete, as OpenAI's; top_p is passed on (0.5 with greedy: same text).
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, top_p=0.5, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.top_p == 0.5
    assert r.output_text == chat(client, [{"role": "user", "content": QUESTION}], max_completion_tokens=3
                                 ).choices[0].message.content


def test_stateful_and_unsupported_fields_are_refused(client, server):
    def refused(param: str, **kw) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **({"input": "hi"} | kw))
        assert e.value.body["param"] == param, e.value.body
        return e.value.body["message"]

    assert "keeps no responses" in refused("store", store=True)
    assert "keeps no responses" in refused("previous_response_id", previous_response_id="resp_123")
    assert "only function tools" in refused("tools", tools=[{"type": "web_search"}])
    assert "item_reference" in refused("input", input=[{"type": "item_reference", "id": "msg_1"}])
    assert "input_image" in refused("input", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}])
    refused("input", input=[])
    refused("tool_choice", tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    refused("text", text={"format": {"type": "yaml"}})
    # The over-length error names the field the client sent, in its param and its message; so
    # does a prompt too long for the model (the input, not the Responses "prompt" template field).
    message = refused("max_output_tokens", max_output_tokens=100_000)
    assert "max_output_tokens (100000)" in message and "max_tokens" not in message, message
    assert "max_output_tokens" in refused("max_output_tokens", max_output_tokens=-1)
    assert "1024" in refused("input", input="hi " * 1100, max_output_tokens=5)
    refused("temperature", temperature=-1)
    refused("input", input=[{"type": "function_call_output", "output": "22 C"}])  # no call_id
    refused("input", input=[{"role": "wizard", "content": "hi"}])
    refused("input", input=3)
    refused("text", text={"format": {"type": "json_schema", "name": "x"}})  # no schema
    refused("text", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}})
    refused("stream_options", stream_options={"include_obfuscation": False})  # without stream: true
    for name, value in [("conversation", "conv_1"), ("background", True), ("include", ["file_search_call.results"]),
                        ("truncation", "auto"), ("prompt", {"id": "pmpt_1"})]:
        assert name in refused(name, **{name: value})
    # reasoning.effort is the template's reasoning_effort (tests/server/test_reasoning_effort.py);
    # summaries are accepted and not written (test_reasoning_effort.py); values outside OpenAI's are refused.
    assert "'detailed'" in refused("reasoning.summary", reasoning={"effort": "high", "summary": "long"})
    assert "'extreme'" in refused("reasoning.effort", reasoning={"effort": "extreme"})
    with pytest.raises(openai.BadRequestError) as e:  # an unknown key inside stream_options, named by its path
        client.responses.create(model=MODEL, input="hi", stream=True, extra_body={"stream_options": {"frobnicate": 1}})
    assert e.value.body["param"] == "stream_options.frobnicate"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


def test_json_schema_and_json_object_outputs(client):
    r = client.responses.create(
        model=MODEL, input="Give the weather in Paris as JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"
    r = client.responses.create(model=MODEL, input='Return a JSON object with the key "city" set to the capital '
                                'of France.', temperature=0, max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_forced_tool_call_then_function_call_output_round_trip(client):
    question = "What is the weather in Paris?"
    r = client.responses.create(model=MODEL, input=question, tools=TOOLS, temperature=0, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    # The call and its output go back as input items; the same turn as a chat request (the call as
    # an assistant tool_calls message, the output as a tool message) gives the same prompt and answer.
    result = '{"temperature": 22, "unit": "celsius", "sky": "sunny"}'
    r2 = client.responses.create(model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=TOKENS, input=[
        {"role": "user", "content": question}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    c = chat(client, [{"role": "user", "content": question},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": call.call_id, "type": "function",
                           "function": {"name": "get_weather", "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": result}],
             tools=CHAT_TOOLS, max_completion_tokens=TOKENS)
    assert r2.usage.input_tokens == c.usage.prompt_tokens > r.usage.input_tokens
    msg = c.choices[0].message
    if msg.tool_calls:
        assert [(o.name, o.arguments) for o in r2.output if o.type == "function_call"] == \
            [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    else:
        assert r2.output_text == msg.content


def test_forced_tool_call_wins_over_text_format(client):
    """pydantic-ai's NativeOutput with a forced tool sends tool_choice "required" (or a named
    function) and text.format together: the call's grammar wins and text.format is ignored for the
    request, so the calls are those of the same request without text.format, streamed or not."""
    from concurrent.futures import ThreadPoolExecutor

    answer = {"type": "json_schema", "name": "answer", "strict": True, "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}
    formats = (None, answer, {"type": "json_object"})

    def run(choice, fmt, stream=False):
        kw = dict(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice, temperature=0,
                  max_output_tokens=40, **({"text": {"format": fmt}} if fmt else {}))
        if not stream:
            return client.responses.create(**kw)
        with client.responses.stream(**kw) as s:
            return s.get_final_response()

    choices = ("required", {"type": "function", "name": "get_weather"})
    jobs = [(choice, fmt, False) for choice in choices for fmt in formats] + [(c, answer, True) for c in choices]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one batch on the server: greedy tokens do not depend on it
        got = list(pool.map(lambda job: run(*job), jobs))
    for i in (0, 1):
        plain, schema, obj = got[3 * i:3 * i + 3]
        streamed = got[6 + i]
        calls = [(o.type, o.name, o.arguments) for o in plain.output]
        assert [c[:2] for c in calls] == [("function_call", "get_weather")], calls
        jsonschema.validate(json.loads(calls[0][2]), WEATHER)
        for r, fmt in ((schema, answer), (obj, {"type": "json_object"}), (streamed, answer)):
            assert r.status == "completed" and [(o.type, o.name, o.arguments) for o in r.output] == calls, (i, fmt)
            assert r.text.format.type == fmt["type"]  # echoed as sent


def test_stream_events_in_order_and_equal_to_the_whole_response(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS)
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    n = len(deltas)
    assert n > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * n + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(deltas)
    assert text == events[-4].text == final.output_text == whole.output_text
    item_id = events[2].item.id
    assert all(getattr(e, "item_id", item_id) == item_id for e in events)
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.model_dump() == whole.usage.model_dump()

    # A forced call streams as function_call_arguments deltas.
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, temperature=0, max_output_tokens=40,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.function_call_arguments.delta"] * len(pieces) + [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    assert "".join(pieces) == events[-3].arguments == final.output[0].arguments == whole.output[0].arguments


def test_openapi_json_describes_the_request_types(server):
    with urllib.request.urlopen(server.url + "/openapi.json", timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.1")
    for path, name in [("/v1/responses", "ResponsesRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                       ("/v1/completions", "CompletionRequest"), ("/tokenize", "TokenizeRequest")]:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
    assert {"get"} <= set(doc["paths"]["/v1/models"]) and "/openapi.json" in doc["paths"]
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "max_output_tokens", "tools", "text", "store", "stream"} <= set(props)

    # The schema is the server's: what it accepts validates, what it refuses does not.
    def check(body: dict, name: str = "ChatCompletionRequest") -> None:
        jsonschema.validate(body, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})

    check({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5})
    check({"input": "hi", "max_output_tokens": 5, "store": False}, "ResponsesRequest")
    check({"messages": [{"role": "user", "content": "hi"}], "nope": 1})  # unknown top-level fields: ignored
    for bad in ({"messages": [], "n": 0}, {"messages": [], "temperature": "hot"},
                {"messages": [], "stream": True, "stream_options": {"nope": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            check(bad)
        post = urllib.request.Request(server.url + "/v1/chat/completions", json.dumps(bad).encode(),
                                      {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(post, timeout=30)
        assert e.value.code == 400


# --- the event stream on recorded outputs (no server) ------------------------------------------
class _Recorder:
    """Stands in for the HTTP side of a streamed response: collects the events."""

    def __init__(self, run):
        self.events: list[dict] = []
        self.ended = False

        async def send(kind, **fields):
            run.resp = self
            self.events.append({"type": kind, **fields})
        run._send = send

    async def write_eof(self):
        self.ended = True


def _stream(texts, finish_reason="stop", tool_choice="auto", fail: Exception = None):
    """Stream a recorded output (its text after each step) through a Responses run with TOOLS."""
    import asyncio

    from zpp.outputs import CompletionOutput, RequestOutput
    from zpp.sampling_params import SamplingParams
    from zpp.server.responses import _Run
    from zpp.server.responses_protocol import ResponsesRequest
    from zpp.server.tools import parse_tools

    req = ResponsesRequest(input="hi", tools=TOOLS, tool_choice=tool_choice, stream=True)
    plan = parse_tools(CHAT_TOOLS, tool_choice, None)
    server = type("S", (), {"model_name": MODEL})()
    run = _Run(server, req, plan, [1, 2, 3], SamplingParams(temperature=0))
    rec = _Recorder(run)

    async def outs():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            if last and fail is not None:
                raise fail
            yield 0, RequestOutput("r", None, [1, 2, 3], [CompletionOutput(
                0, text, list(range(i + 1)), finish_reason if last else None)], finished=last)

    asyncio.run(run.stream(None, outs()))
    assert rec.ended
    return rec.events, run


def test_streamed_text_then_tool_call_gives_the_items_of_the_whole_response():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    steps = ["Let me ", "Let me check. ", "Let me check. <tool", "Let me check. " + call]
    events, run = _stream(steps)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    whole = run.finish(type("C", (), {"text": steps[-1], "finish_reason": "stop", "token_ids": [0] * 4})())
    strip = lambda items: [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in items]  # noqa: E731
    assert strip(final["output"]) == strip(whole["output"])
    assert final["output"][0]["content"][0]["text"] == "Let me check. "
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert final["usage"]["output_tokens"] == 4 and final["status"] == "completed"


def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed():
    from zpp.errors import EngineDeadError
    events, _ = _stream(["Hello", "Hello there"], tool_choice="none", fail=EngineDeadError("stage 1 died"))
    kinds = [e["type"] for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-2:] == ["error", "response.failed"]
    assert "stage 1 died" in events[-2]["message"] and events[-1]["response"]["status"] == "failed"


def test_openapi_document_marks_v1_routes_with_the_api_key():
    from aiohttp import web

    from zpp.server.openapi import openapi_document

    async def nothing(request):
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/responses", nothing)
    app.router.add_get("/health", nothing)
    doc = openapi_document(app, api_key="k")
    assert doc["paths"]["/v1/responses"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"] and "head" not in doc["paths"]["/health"]
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert "securitySchemes" not in openapi_document(app)["components"]
