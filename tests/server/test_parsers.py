"""Tool-call and reasoning parsers (``--tool-call-parser``, ``--reasoning-parser``) on outputs in each
model family's format: every output parsed whole and streamed in small pieces gives the same
OpenAI message (checked against the official client's types). Also: which requests keep special
tokens, ``--generation-config`` files, and how request fields meet the model's sampling defaults.
(The server end to end: tests/server/test_serving_parsers.py.)

The recorded outputs are written in the formats the families' chat templates teach (and that their
models emit): Hermes / Qwen2.5 ``<tool_call>`` blocks, Llama 3.1 JSON (with and without
``<|python_tag|>``), Mistral's ``[TOOL_CALLS]`` (JSON-array and v11 ``[ARGS]`` forms), DeepSeek-V3's
fenced calls and V3.1's, DeepSeek-R1 / Qwen3 ``<think>`` blocks.
"""
from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from zpp.parsers.chat import ChatParsers
from zpp.parsers.reasoning import REASONING_PARSERS
from zpp.parsers.tool import TOOL_PARSERS
from zpp.server.tools import parse_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
PLAN = parse_tools(TOOLS, "auto", None)
PARIS, CET = ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})

# (parser, output, expected content, expected calls (name, arguments as an object))
TOOL_CASES = [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "I will check.\n", [PARIS, CET]),
    ("hermes", '{"name": "get_time", "arguments": {"zone": "CET"}}', None, [CET]),
    ("hermes", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("hermes", '<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>',  # not an offered tool
     '<tool_call>{"name": "send_mail", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [PARIS, CET]),
    ("llama3_json", "The weather in Paris is {mild}.", "The weather in Paris is {mild}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [PARIS, CET]),
    ("mistral", 'Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "Let me look that up.", [PARIS, CET]),
    ("mistral", "Paris is at 48.9 N [TOOL] not a call.", "Paris is at 48.9 N [TOOL] not a call.", []),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Checking.", [PARIS, CET]),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [CET]),  # V3.1's form
    ("deepseek_v3", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]


def _stream(parsers: ChatParsers, text: str, step: int, plan=PLAN, reasons=False, opened=False) -> list[dict]:
    s = parsers.stream(plan, reasons, opened)
    deltas = []
    for end in range(step, len(text), step):
        deltas += s.feed(text[:end], False)
    return deltas + s.feed(text, True)


def _assemble(deltas: list[dict]) -> dict:
    """The message a client builds from stream deltas (as the openai client's helpers do)."""
    msg: dict = {"role": "assistant"}
    calls: dict[int, dict] = {}
    for d in deltas:
        ChoiceDelta.model_validate(d)  # each delta has OpenAI's shape
        for key in ("content", "reasoning_content"):
            if key in d:
                msg[key] = msg.get(key, "") + d[key]
        for tc in d.get("tool_calls", ()):
            c = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            if "id" in tc:
                assert c["id"] is None, "a call's id is sent once"
                c["id"], c["function"]["name"] = tc["id"], tc["function"]["name"]
            c["function"]["arguments"] += tc["function"].get("arguments", "")
    if calls:
        assert sorted(calls) == list(range(len(calls)))
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


def _calls(msg: dict) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", ())]


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(TOOL_CASES)])
def test_tool_parser_whole_and_streamed(name, text, content, calls):
    parsers = ChatParsers(name)
    msg, called = parsers.message(text, PLAN, False, False)
    ChatCompletionMessage.model_validate(msg)
    assert msg["content"] == content and _calls(msg) == calls and called == bool(calls)
    for c in msg.get("tool_calls", ()):
        assert c["type"] == "function" and c["id"]
        if name == "mistral":  # Mistral's templates accept only 9-character alphanumeric ids
            assert len(c["id"]) == 9 and c["id"].isalnum()
    for step in (1, 2, 5, 11, len(text)):
        got = _assemble(_stream(parsers, text, step))
        assert got.get("content") == (content or None), step
        assert _calls(got) == calls, step


def test_tool_calls_stream_as_soon_as_complete():
    """A call goes out when the parser has all of it, not at the end of the output."""
    text = TOOL_CASES[0][1]
    first_end = text.index("</tool_call>") + len("</tool_call>")
    s = ChatParsers("hermes").stream(PLAN, False, False)
    early = s.feed(text[:first_end], False)
    assert _calls(_assemble(early)) == [PARIS] and s.calls == 1
    rest = s.feed(text, True)
    assert _calls(_assemble(early + rest)) == [PARIS, CET]


# (parser, output, opened by the prompt, expected reasoning, expected content)
REASONING_CASES = [
    ("deepseek_r1", "Paris is in France, so\nthe answer is Paris.\n</think>\n\nThe capital is Paris.", True,
     "Paris is in France, so\nthe answer is Paris.\n", "\n\nThe capital is Paris."),
    ("deepseek_r1", "<think>\nShort thought.\n</think>Answer.", True, "\nShort thought.\n", "Answer."),
    ("deepseek_r1", "Still thinking when max_tokens ran out", True, "Still thinking when max_tokens ran out", None),
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", False,
     "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ("qwen3", "Hello! How can I help?", False, None, "Hello! How can I help?"),  # enable_thinking false
    ("qwen3", "Two and two.\n</think>\n\n4", True, "Two and two.\n", "\n\n4"),  # template opened <think>
    ("qwen3", "<thinking is fun> but this is content", False, None, "<thinking is fun> but this is content"),
]


@pytest.mark.parametrize("name,text,opened,reasoning,content", REASONING_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_parser_whole_and_streamed(name, text, opened, reasoning, content):
    parsers = ChatParsers(None, name)
    msg, _ = parsers.message(text, None, True, opened)
    ChatCompletionMessage.model_validate(msg)
    assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
    for step in (1, 2, 3, 7, len(text)):
        got = _assemble(_stream(parsers, text, step, plan=None, reasons=True, opened=opened))
        assert (got.get("reasoning_content"), got.get("content")) == (reasoning, content), step
    hidden, _ = parsers.message(text, None, True, opened, include_reasoning=False)
    assert hidden["reasoning_content"] is None and hidden["content"] == content


def test_reasoning_then_tool_calls():
    """Qwen3 thinking, then a Hermes call: the reasoning is split off first, the rest parsed for calls."""
    text = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    parsers = ChatParsers("hermes", "qwen3")
    msg, called = parsers.message(text, PLAN, True, False)
    assert called and msg["reasoning_content"] == "\nThe user wants the weather.\n"
    assert msg["content"] == "\n\n" and _calls(msg) == [PARIS]
    for step in (1, 4, len(text)):
        got = _assemble(_stream(parsers, text, step, reasons=True))
        assert got["reasoning_content"] == msg["reasoning_content"] and _calls(got) == [PARIS]


def test_opened_by_prompt():
    qwen3, r1 = ChatParsers(None, "qwen3"), ChatParsers(None, "deepseek_r1")
    assert qwen3.opened("<|im_start|>assistant\n<think>\n") and not qwen3.opened("<|im_start|>assistant\n")
    assert not qwen3.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false
    assert r1.opened("<｜Assistant｜>")  # R1: always starts in its reasoning


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, deepseek_v3"):
        ChatParsers("pythonic")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ChatParsers(None, "granite")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3"}
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}


def test_special_token_tags_keep_special_tokens():
    """A parser whose tag is a special token of the tokenizer (Mistral's [TOOL_CALLS], Llama's
    <|python_tag|>) needs the request's text to keep special tokens; other tags change nothing."""
    from types import SimpleNamespace
    tok = SimpleNamespace(all_special_tokens=["</s>", "[TOOL_CALLS]", "<think>"])
    assert ChatParsers("mistral", tokenizer=tok).keep_special_tokens(PLAN, False)
    assert not ChatParsers("mistral", tokenizer=tok).keep_special_tokens(None, False)  # no tools: nothing to parse
    assert not ChatParsers("hermes", tokenizer=tok).keep_special_tokens(PLAN, False)
    assert ChatParsers(None, "qwen3", tokenizer=tok).keep_special_tokens(None, True)


def test_generation_config_values(tmp_path):
    from zpp.config import ConfigError
    from zpp.generation_config import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.05,
         "max_new_tokens": 512, "typical_p": 0.9, "bos_token_id": 1}))
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05, "max_tokens": 512}
    assert generation_defaults(str(tmp_path), "auto") == want  # Qwen3's recommendation
    assert generation_defaults("/nonexistent", str(tmp_path)) == want
    assert generation_defaults(str(tmp_path), "vllm") == {}
    assert generation_defaults(str(tmp_path / "x"), "auto") == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ConfigError, match="--generation-config auto: .*top_p: must be in"):
        generation_defaults(str(tmp_path), "auto")
    (tmp_path / "generation_config.json").write_text('{"top_k": 2.5}')
    with pytest.raises(ConfigError, match="top_k .* must be a whole number"):
        generation_defaults(str(tmp_path), "auto")


def test_request_fields_override_generation_defaults():
    """A field the request sends wins; one it leaves out or sends as null takes the model's default
    (vLLM's rule: null is "use the default", and the default is the model's)."""
    from zpp.server.http_body import decode_request
    from zpp.server.protocol import ChatCompletionRequest, to_sampling_params
    d = {"temperature": 0.6, "top_k": 20, "max_tokens": 7}

    def sp(body):
        req = decode_request(json.dumps({"messages": [], **body}).encode(), ChatCompletionRequest)
        return to_sampling_params(req, req.max_tokens, None, defaults=d)

    assert (sp({}).temperature, sp({}).top_k, sp({}).max_tokens, sp({}).top_p) == (0.6, 20, 7, 1.0)
    assert (sp({"temperature": None}).temperature, sp({"top_k": None}).top_k) == (0.6, 20)
    assert (sp({"temperature": 1.0}).temperature, sp({"temperature": 0}).temperature) == (1.0, 0.0)
    assert (sp({"top_k": -1}).top_k, sp({"max_tokens": 3}).max_tokens) == (0, 3)
