"""JSON that ends (issue 51): every JSON grammar bounds each run of whitespace by default
(``max_whitespace_cnt`` 16), ``--structured-outputs-config`` takes vLLM's ``disable_any_whitespace``
server-wide, and a request's whitespace *options* (``structured_outputs.disable_any_whitespace`` /
``whitespace_pattern``, ``guided_whitespace_pattern``) combine with ``response_format`` and tool
calls, while two *constraints* still conflict. In-process: the request translation, the
compiler's whitespace rule, and the compile host's grammars on a 100-token vocabulary (no model).
The real demo model on the issue's request: ``test_structured_outputs.py::test_issue_request_json_ends``."""
from __future__ import annotations

import msgspec
import pytest
import xgrammar as xgr

from zpp.config import ConfigError
from zpp.errors import RequestError
from zpp.frontend.compile_host import _compile
from zpp.frontend.grammar import GrammarCompiler
from zpp.sampling_params import StructuredOutputsParams as SO
from zpp.server.http_body import decode_request
from zpp.server.protocol import ChatCompletionRequest
from zpp.server.structured_outputs import structured_output_options, structured_outputs_of
from zpp.server.tools import parse_tools, tool_constraint
from zpp.structured_outputs_config import DEFAULT_MAX_WHITESPACE_CNT, JsonWhitespace, parse_structured_outputs_config

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"]}
RF = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": CITY}}]


def _req(**fields) -> ChatCompletionRequest:
    return decode_request(msgspec.json.encode({"messages": [], **fields}), ChatCompletionRequest)


def test_options_combine_with_any_constraint_and_two_constraints_conflict():
    so, param = structured_outputs_of(_req(response_format=RF, structured_outputs={"disable_any_whitespace": True}))
    assert (so.json, so.disable_any_whitespace, param) == (CITY, True, "response_format")
    so, _ = structured_outputs_of(_req(response_format={"type": "json_object"}, guided_whitespace_pattern="[ ]?"))
    assert so.json_object and so.whitespace_pattern == "[ ]?"
    so, _ = structured_outputs_of(_req(guided_json=CITY, structured_outputs={"whitespace_pattern": " ?"}))
    assert so.json == CITY and so.whitespace_pattern == " ?"
    so, param = structured_outputs_of(_req(structured_outputs={"json": CITY, "disable_any_whitespace": True}))
    assert (so.json, so.disable_any_whitespace, param) == (CITY, True, "structured_outputs")
    # vLLM's options with no effect here are accepted; options alone constrain nothing.
    assert structured_outputs_of(_req(structured_outputs={"disable_fallback": True})) == (None, None)
    assert structured_outputs_of(_req(structured_outputs={"disable_any_whitespace": True})) == (None, None)
    # A forced tool call keeps the request's options (and wins over response_format, as before).
    req = _req(response_format=RF, structured_outputs={"disable_any_whitespace": True}, tools=TOOLS,
               tool_choice="required")
    so, param = tool_constraint(parse_tools(req.tools, req.tool_choice, None), *structured_outputs_of(req),
                                structured_output_options(req))
    assert param == "tools" and so.disable_any_whitespace and so.json["type"] == "array"
    for fields, param in [({"response_format": RF, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
                          ({"response_format": RF, "guided_json": CITY}, "guided_json"),
                          ({"structured_outputs": {}}, "structured_outputs"),
                          ({"structured_outputs": {"json": CITY, "disable_any_whitespace": "yes"}}, "structured_outputs"),
                          ({"structured_outputs": {"json": CITY, "whitespace_pattern": 3}}, "structured_outputs"),
                          ({"structured_outputs": {"whitespace_pattern": "a"}, "guided_whitespace_pattern": "b"},
                           "guided_whitespace_pattern")]:
        with pytest.raises(RequestError) as e:
            structured_outputs_of(_req(**fields))
        assert e.value.param == param, (fields, e.value)


def test_the_whitespace_rule_of_each_request():
    default = GrammarCompiler(None, 10, set(), 1.0, 100)
    compact = GrammarCompiler(None, 10, set(), 1.0, 100, whitespace=JsonWhitespace(disable_any_whitespace=True))
    unbounded = GrammarCompiler(None, 10, set(), 1.0, 100, whitespace=JsonWhitespace(max_whitespace_cnt=None))
    assert default.whitespace_of(SO(json=CITY)) == DEFAULT_MAX_WHITESPACE_CNT == 16
    assert default.whitespace_of(SO(json_object=True)) == 16
    assert default.whitespace_of(SO(regex="a+")) is None  # not JSON: no rule (and one cache key)
    assert default.whitespace_of(SO(json=CITY, disable_any_whitespace=True)) is False
    assert default.whitespace_of(SO(json=CITY, whitespace_pattern="[ ]?")) == "[ ]?"
    assert default.whitespace_of(SO(json=CITY, whitespace_pattern="[ ]?", disable_any_whitespace=True)) is False
    assert compact.whitespace_of(SO(json=CITY)) is False
    assert compact.whitespace_of(SO(json=CITY, whitespace_pattern=" ?")) == " ?"  # the request's own wins
    assert unbounded.whitespace_of(SO(json=CITY)) is True


def test_structured_outputs_config_takes_vllms_keys(demo_model):
    flag = "--structured-outputs-config"
    assert parse_structured_outputs_config('{"disable_any_whitespace": true, "backend": "xgrammar", '
                                           '"disable_fallback": false}', flag) == JsonWhitespace(True, 16)
    assert parse_structured_outputs_config({"max_whitespace_cnt": None}, flag) == JsonWhitespace(False, None)
    assert parse_structured_outputs_config(None, flag) is None
    for bad, words in [('{"disable_any_whitespace": 1}', "true or false"), ('{"max_whitespace_cnt": 0}', ">= 1"),
                       ('{"backend": "guidance"}', "xgrammar"), ('{"whitespace": 1}', "unknown key 'whitespace'"),
                       ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ConfigError, match=words) as e:
            parse_structured_outputs_config(bad, flag)
        assert flag in str(e.value) and "\n" not in str(e.value)
    from zpp.args import engine_config
    cfg = engine_config(demo_model, streaming=True, structured_outputs_config={"disable_any_whitespace": True})
    assert cfg.structured_outputs.json_whitespace == JsonWhitespace(True, 16)


@pytest.fixture(scope="module")
def small_vocab():
    vocab = [chr(i) for i in range(32, 127)] + ["\n", "\t", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    return info, xgr.GrammarCompiler(info, cache_enabled=False)


def _accepts(info, compiler, kind, text, ws, out: str) -> bool:
    status, serialized = _compile(compiler, kind, text, ws, 1 << 30)
    assert status == "ok", serialized
    m = xgr.GrammarMatcher(xgr.CompiledGrammar.deserialize_json(serialized, info))
    return m.accept_string(out) and m.is_completed()


def test_compiled_json_grammars_bound_the_whitespace(small_vocab):
    """16 characters of whitespace between two tokens are allowed (pretty-printed JSON: a newline
    and 15 spaces), 17 are not; compact JSON allows none; a pattern is the whole rule."""
    info, c = small_vocab
    schema = msgspec.json.encode(CITY).decode()

    def city(gap: str) -> str:
        return "{" + gap + '"name": "Paris",' + gap + '"country": "France"' + gap + "}"

    pretty = '{\n    "name": "Paris",\n    "country": "France"\n}'
    for kind, text in (("json", schema), ("json_object", "")):
        assert _accepts(info, c, kind, text, 16, pretty)
        assert _accepts(info, c, kind, text, 16, city("\n" + " " * 15))
        assert not _accepts(info, c, kind, text, 16, city("\n" + " " * 16))
        assert _accepts(info, c, kind, text, True, city("\n" * 100))  # max_whitespace_cnt null: unbounded
        assert _accepts(info, c, kind, text, False, '{"name": "Paris", "country": "France"}')
        assert not _accepts(info, c, kind, text, False, pretty)
        assert _accepts(info, c, kind, text, "[ ]?", '{ "name": "Paris", "country": "France" }')
        assert not _accepts(info, c, kind, text, "[ ]?", pretty)
    assert _accepts(info, c, "regex", "a+", None, "aaa")
