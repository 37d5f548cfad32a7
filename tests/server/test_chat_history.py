"""Multi-turn histories reach the chat template as vLLM hands them over (issue 51): an earlier
assistant turn's tool-call ``function.arguments`` (OpenAI's JSON text) as a mapping (a text that
is not a JSON object stays the text), its ``reasoning_content`` / ``reasoning`` as
``reasoning_content``, and text parts joined with "\\n"; on chat, /tokenize and /v1/responses
(``function_call`` and ``reasoning`` input items).

The templates are small ones written with the real templates' constructs: Qwen3-Coder's
``arguments|items``, Llama-3.1's / Qwen2.5's ``arguments|tojson``, Qwen3's re-render of the
reasoning of the turns after the last user query. In-process (:mod:`echo_engine`: the reply is the
rendered prompt)."""
from __future__ import annotations

import json

import aiohttp
from echo_engine import MODEL, serve

# Qwen3-Coder's construct: iterate the arguments.
ITEMS = ("{%- for m in messages %}{{ m.role }}: {{ m.content }}"
         "{%- for tc in m.tool_calls or [] %}<function={{ tc.function.name }}>"
         "{%- for k, v in tc.function.arguments|items %}<parameter={{ k }}>{{ v }}</parameter>{%- endfor %}"
         "</function>{%- endfor %}{{ '\\n' }}{% endfor %}assistant:")
# Llama-3.1's / Qwen2.5's construct: arguments|tojson (a string would be encoded twice).
TOJSON = ("{%- for m in messages %}{{ m.role }}: {{ m.content }}"
          "{%- for tc in m.tool_calls or [] %}{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
          "{{ tc.function.arguments|tojson }}}{%- endfor %}{{ '\\n' }}{% endfor %}assistant:")
# Qwen3's construct: an assistant turn after the last user message re-renders its reasoning_content.
QWEN3 = ("{%- set ns = namespace(last_query=0) %}"
         "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
         "{%- endfor %}"
         "{%- for m in messages %}{%- if m.role == 'assistant' %}"
         "{%- set reasoning_content = '' %}"
         "{%- if m.reasoning_content is string %}{%- set reasoning_content = m.reasoning_content %}{%- endif %}"
         "{%- if loop.index0 > ns.last_query and reasoning_content %}"
         "assistant: <think>\n{{ reasoning_content.strip('\n') }}\n</think>\n\n{{ m.content }}"
         "{%- else %}assistant: {{ m.content }}{%- endif %}"
         "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}</tool_call>{%- endfor %}"
         "{%- else %}{{ m.role }}: {{ m.content }}{%- endif %}{{ '\\n' }}{% endfor %}assistant:")

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}
ODD = {"id": "call_2", "type": "function", "function": {"name": "note", "arguments": "not json"}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "I should call it."},
           {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]


async def _post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def test_tool_call_arguments_reach_the_template_as_a_mapping(tokenizer):
    """``arguments|items`` works (it was a 400 "Can only get item pairs from a mapping") and
    ``tojson`` writes the object once; a text that is not JSON stays the text; chat and /tokenize
    render the same."""
    items = ("user: Weather in Paris?\nassistant: <function=get_weather><parameter=city>Paris</parameter>"
             "<parameter=unit>C</parameter></function>\ntool: 22 C\nassistant:")
    tojson = ("user: Weather in Paris?\nassistant: {\"name\": \"get_weather\", \"arguments\": "
              "{\"city\": \"Paris\", \"unit\": \"C\"}}\ntool: 22 C\nassistant:")

    async def test(client, url):
        for template, want in ((ITEMS, items), (TOJSON, tojson)):
            body = {"model": MODEL, "messages": HISTORY, "chat_template": template}
            got = await _post(url, "/v1/chat/completions", body)
            assert got["choices"][0]["message"]["content"] == want
            ids = (await _post(url, "/tokenize", body))["tokens"]
            assert ids == tokenizer.encode(want, add_special_tokens=False)
        odd = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [ODD]}]
        got = await _post(url, "/v1/chat/completions", {"messages": odd, "chat_template": TOJSON})
        assert "\"arguments\": \"not json\"}" in got["choices"][0]["message"]["content"]
        empty = [HISTORY[0], {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": ""}}]}]
        got = await _post(url, "/v1/chat/completions", {"messages": empty, "chat_template": ITEMS})
        assert "<function=f></function>" in got["choices"][0]["message"]["content"]
    serve(tokenizer, test, trust_request_chat_template=True)


def test_reasoning_and_text_parts_reach_the_template_as_vllm_renders_them(tokenizer):
    """Qwen3's re-render of the current tool loop's thinking sees ``reasoning_content`` (sent as
    ``reasoning_content`` or as vLLM's newer ``reasoning``); text parts are joined with "\\n"."""
    want = ("user: Weather in Paris?\nassistant: <think>\nI should call it.\n</think>\n\n"
            "<tool_call>get_weather</tool_call>\ntool: 22 C\nassistant:")

    async def test(client, url):
        for key in ("reasoning_content", "reasoning"):
            hist = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [CALL],
                                 key: "I should call it."}, HISTORY[2]]
            got = await _post(url, "/v1/chat/completions", {"messages": hist, "chat_template": QWEN3})
            assert got["choices"][0]["message"]["content"] == want, key
            ids = (await _post(url, "/tokenize", {"messages": hist, "chat_template": QWEN3}))["tokens"]
            assert ids == tokenizer.encode(want, add_special_tokens=False)
        parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
        got = await _post(url, "/v1/chat/completions", {"messages": parts, "chat_template": ITEMS})
        assert got["choices"][0]["message"]["content"] == "user: first\nsecond\nassistant:"
    serve(tokenizer, test, trust_request_chat_template=True)


def test_responses_function_call_and_reasoning_items_render_as_chat(tokenizer):
    """A /v1/responses input with a reasoning item, its function_call and the call's output renders
    as the chat history above: the reasoning joins the call's assistant message, the arguments are
    a mapping; output_text parts are joined with "\\n"."""
    items_in = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "I should call it."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": CALL["function"]["arguments"]},
                {"type": "function_call_output", "call_id": "call_1", "output": "22 C"}]
    template = QWEN3.replace("<tool_call>{{ tc.function.name }}</tool_call>",
                             "<tool_call>{{ tc.function.arguments|tojson }}</tool_call>")
    want = ("user: Weather in Paris?\nassistant: <think>\nI should call it.\n</think>\n\n"
            "<tool_call>{\"city\": \"Paris\", \"unit\": \"C\"}</tool_call>\ntool: 22 C\nassistant:")

    async def test(client, url):
        r = await client.responses.create(model=MODEL, input=items_in)
        assert r.output_text == want
        chat = await _post(url, "/v1/chat/completions", {"messages": HISTORY})
        assert chat["choices"][0]["message"]["content"] == want  # the same history through chat
        r = await client.responses.create(model=MODEL, input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]}])
        assert r.output_text == "user: a\nb\nassistant:"
    serve(tokenizer, test, chat_template=template)
