"""Chat tool calls: checking ``tools`` / ``tool_choice``, describing the tools to the model,
constraining the output and turning it into OpenAI ``tool_calls``.

* ``tool_choice: "none"``: the tools are not shown to the model; plain text.
* ``"auto"`` (the default with tools): the tools go to the chat template (``tools=``); the output
  is free and is parsed by the server's tool-call parser (``--tool-call-parser``, see
  :mod:`zpp.parsers.tool`; default ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the format many templates teach, or an output that is just such a JSON object); the calls
  become ``tool_calls``, the text before them the message content.
* ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects,
  one ``anyOf`` branch per tool (vLLM's schema), and every element becomes a call.
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's
  ``parameters`` schema and is the call's ``arguments``.

A forced call (``"required"`` or named) wins over a ``response_format``, which is then ignored
(:func:`tool_constraint`).

An output that ends early (``max_tokens``, a stop string, a grammar dead end) has the same message
shape streamed or not: a named function's output is always its call, with the arguments as far as
they were generated and the ``finish_reason`` saying why they stop (``"length"``, ``"stop"``,
``"abort"``); ``required`` and ``auto`` outputs that do not parse as calls are content.

A chat template that ignores ``tools`` (renders the same text with and without them, as
SmolLM2's does) gets a short system text listing the tools and the parser's call format instead.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from zpp.parsers.tool import HermesToolParser, ToolParser
from zpp.sampling_params import StructuredOutputsParams
from zpp.server.protocol import ProtocolError

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_HERMES = HermesToolParser()


@dataclass
class ToolPlan:
    """What the request's ``tools`` / ``tool_choice`` ask for.

    Attributes:
        tools: the function tools as sent (OpenAI's shape), checked.
        mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        name: the function of ``"named"``.
        parallel: more than one call allowed (``parallel_tool_calls``, default true).
    """

    tools: list[dict]
    mode: str
    name: Optional[str] = None
    parallel: bool = True
    names: set[str] = field(default_factory=set)

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or _EMPTY_PARAMETERS
        raise KeyError(name)

    def structured_outputs(self, **options) -> Optional[StructuredOutputsParams]:
        """The output constraint: ``named``: the function's parameters schema; ``required``: an
        array of ``{"name", "parameters"}`` objects (``anyOf`` over the tools, at least one, at
        most one without ``parallel``); None for ``auto`` and ``none``. ``options``: the request's
        structured-output options (``disable_any_whitespace``, ``whitespace_pattern``)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters(self.name), **options)
        if self.mode != "required":
            return None
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": t["function"].get("parameters") or _EMPTY_PARAMETERS},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, **options)

    def system_text(self, call_format: Optional[str] = None) -> str:
        """The tools described for a chat template that does not render ``tools`` itself;
        ``call_format``: how a call is written (the tool-call parser's; default Hermes')."""
        funcs = [{k: v for k, v in t["function"].items() if k in ("name", "description", "parameters")}
                 for t in self.tools]
        return ("You can call these functions (JSON Schema of their parameters):\n"
                + json.dumps(funcs, ensure_ascii=False)
                + f"\nTo call one, answer with {call_format or _HERMES.call_format}.")


def parse_tools(tools: Optional[list], tool_choice, parallel_tool_calls: Optional[bool]) -> Optional[ToolPlan]:
    """Check ``tools`` and ``tool_choice``; None when the request has no tools.

    Raises:
        ProtocolError: (``param`` ``"tools"`` or ``"tool_choice"``) a tool that is not a function
            tool with a valid name, a duplicated name, a ``tool_choice`` that is not
            none / auto / required / a named function, a named function not in ``tools``, or a
            ``tool_choice`` other than ``"none"`` without tools.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", "tool_choice")
        return None
    names: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ProtocolError(f"tools[{i}]: only function tools are supported: "
                                '{"type": "function", "function": {"name": ..., "parameters": {...}}}', "tools")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ProtocolError(f"tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _, . or -",
                                "tools")
        if name in names:
            raise ProtocolError(f"tools[{i}]: the function name {name!r} is given twice", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ProtocolError(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ProtocolError(f"tools[{i}].function.description must be a string", "tools")
        names.add(name)
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(list(tools), tool_choice or "auto", parallel=parallel, names=names)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ProtocolError(f"tool_choice names the function {str(name)[:64]!r}, which is not in tools",
                                "tool_choice")
        return ToolPlan(list(tools), "named", name, parallel, names)
    raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")


def tool_constraint(plan: Optional[ToolPlan], so: Optional[StructuredOutputsParams], so_param: Optional[str],
                    options: Optional[dict] = None) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The output constraint a request runs with, and the field it came from, given its tool
    plan and the constraint of its other fields (``so`` from ``so_param``, as
    :func:`zpp.server.protocol.structured_outputs_of` returns them).

    A ``tool_choice`` that forces a call (``"required"`` or a named function) constrains the
    output to the call: its grammar wins over ``response_format`` (``json_object`` or
    ``json_schema``), which is ignored for that request, as vLLM does and OpenAI accepts
    (pydantic-ai's ``NativeOutput`` with a forced tool sends both). The result is then
    ``(the tool grammar, "tools")``, compiled with the request's structured-output ``options``
    (:func:`zpp.server.protocol.structured_output_options`); with no forcing tool plan,
    ``(so, so_param)`` unchanged.

    Raises:
        ProtocolError: (``param`` ``"tool_choice"``) a forced call together with vLLM's explicit
            constraints (``structured_outputs``, ``guided_*``): two grammars, no way to honour both.
    """
    tool_so = plan.structured_outputs(**(options or {})) if plan is not None else None
    if tool_so is None:
        return so, so_param
    if so is not None and so_param != "response_format":
        raise ProtocolError(f"tool_choice {plan.mode!r} constrains the output, so {so_param} cannot "
                            "be given too", "tool_choice")
    return tool_so, "tools"


def _call(name: str, arguments, call_id: Optional[str] = None) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _json_prefix(text: str):
    """The JSON value at the start of ``text`` (after whitespace), or None."""
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())[0]
    except ValueError:
        return None


def _as_call(obj, names: set[str]) -> Optional[dict]:
    if isinstance(obj, dict) and obj.get("name") in names:
        args = obj.get("arguments", obj.get("parameters", {}))
        return _call(obj["name"], args)
    return None


def parse_output(plan: ToolPlan, text: str, parser: Optional[ToolParser] = None) -> tuple[Optional[str], list[dict]]:
    """``(content, tool_calls)`` of a finished output (``tool_calls`` empty: plain content), the
    same message :class:`ToolStream` streams for that text, however the output ended.

    ``named``: always the function's call, the text its arguments as generated -- incomplete JSON
    when the output was cut off (``finish_reason`` ``"length"``, a stop string, a grammar dead end),
    as vLLM gives it; ``required``: a JSON array of ``{"name", "parameters"}`` (an output cut off
    before the array is complete stays content); ``auto``: the calls ``parser`` (``--tool-call-parser``,
    default hermes: ``<tool_call>`` blocks or a bare ``{"name", "arguments"}`` object) finds, the text
    before the first (as generated) being the content (None when empty)."""
    if plan.mode == "named":
        return None, [_call(plan.name, text)]
    if plan.mode == "required":
        arr = _json_prefix(text)
        calls = [c for c in (_as_call(o, plan.names) for o in arr) if c] if isinstance(arr, list) else []
        return (None, calls) if calls else (text, [])
    if plan.mode != "auto":
        return text, []
    parser = parser or _HERMES
    end, calls = parser.extract(text, plan.names)
    if not calls:
        return text, []
    return text[:end] or None, [_call(n, a, parser.new_id()) for n, a in calls]


class ToolStream:
    """Turns one streamed choice's growing text into chat deltas for a request with tools.

    ``feed(text, final)`` takes the whole text so far and returns the new deltas
    (``{"content": ...}`` or ``{"tool_calls": [...]}``); ``calls`` counts the tool calls sent.
    ``named``: the call's id and name go out with the first text, then the text as argument
    pieces; ``required``: the calls go out when the output is complete; ``auto``: text is streamed
    as content up to where ``parser`` (default hermes) sees a tool call might start (held from
    there), and each call goes out (id and name, then its arguments) as soon as the parser has
    read all of it; at the end, held text that holds no call is content.
    """

    def __init__(self, plan: ToolPlan, parser: Optional[ToolParser] = None):
        self.plan = plan
        self.parser = parser or _HERMES
        self.sent = 0  # characters of text handled
        self.calls = 0
        self._named_id: Optional[str] = None

    def feed(self, text: str, final: bool) -> list[dict]:
        mode = self.plan.mode
        if mode == "named":
            return self._named(text, final)
        if mode == "required":
            if not final:
                return []
            content, calls = parse_output(self.plan, text)
            if not calls:
                return self._content(text, len(text))
            self.sent = len(text)
            return self._send_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls],
                                    [c["id"] for c in calls])
        if mode != "auto":
            return self._content(text, len(text))
        if final:
            end, calls = self.parser.extract(text, self.plan.names)
            if not calls:
                end = len(text)
        else:
            end, calls = self.parser.partial(text, self.plan.names)
        out = self._content(text, end)
        if calls:
            self.sent = max(self.sent, end)
        return out + self._send_calls(calls)

    def _send_calls(self, calls: list, ids: Optional[list] = None) -> list[dict]:
        out = []
        for j in range(self.calls, len(calls)):
            name, args = calls[j]
            call_id = ids[j] if ids else self.parser.new_id()
            out.append({"tool_calls": [{"index": self.calls, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": args}}]})
            self.calls += 1
        return out

    def _content(self, text: str, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        piece, self.sent = text[self.sent:end], end
        return [{"content": piece}]

    def _named(self, text: str, final: bool) -> list[dict]:
        out = []
        if self._named_id is None and (text or final):
            self._named_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
            out.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                        "function": {"name": self.plan.name, "arguments": ""}}]})
            self.calls = 1
        if len(text) > self.sent:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[self.sent:]}}]})
            self.sent = len(text)
        return out
