"""A request's structured-output constraint and options, from OpenAI's ``response_format``, vLLM's
``structured_outputs`` object and its older ``guided_*`` fields (:func:`structured_outputs_of`,
:func:`structured_output_options`). One constraint per request; the options (whitespace) combine
with whichever constraint it has, a forced tool call's included (:func:`zpp.server.tools.tool_constraint`).
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from zpp.errors import SamplingParamsError
from zpp.sampling_params import StructuredOutputsParams
from zpp.server.protocol import ProtocolError, _SamplingFields

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
"""The keys of a ``structured_outputs`` object that constrain the output (one per request)."""
SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern")
"""Its keys that only tune the JSON grammars: they combine with any constraint (``response_format``,
a tool call's), as in vLLM. vLLM's ``disable_fallback`` / ``disable_additional_properties`` are
accepted too and change nothing (xgrammar has no fallback; its schemas are strict)."""
_SO_NO_EFFECT = ("disable_fallback", "disable_additional_properties")


def structured_output_options(req: _SamplingFields) -> dict[str, Any]:
    """The request's structured-output *options* (SO_OPTIONS present in ``structured_outputs``, and
    ``guided_whitespace_pattern`` as ``whitespace_pattern``), which apply to whatever constraint the
    request runs with.

    Raises:
        ProtocolError: ``structured_outputs`` that is not an object, or an option of the wrong type."""
    so = req.structured_outputs
    out: dict[str, Any] = {}
    if so is not None:
        for k in SO_OPTIONS + _SO_NO_EFFECT:
            v = so.get(k)
            if v is None:
                continue
            if k == "whitespace_pattern" and not isinstance(v, str):
                raise ProtocolError("structured_outputs: whitespace_pattern must be a string (a regular "
                                    "expression)", "structured_outputs")
            if k != "whitespace_pattern" and not isinstance(v, bool):
                raise ProtocolError(f"structured_outputs: {k} must be a boolean", "structured_outputs")
            if k in SO_OPTIONS:
                out[k] = v
    if req.guided_whitespace_pattern is not None:
        if "whitespace_pattern" in out and out["whitespace_pattern"] != req.guided_whitespace_pattern:
            raise ProtocolError("give one whitespace pattern: structured_outputs.whitespace_pattern and "
                                "guided_whitespace_pattern differ", "guided_whitespace_pattern")
        out["whitespace_pattern"] = req.guided_whitespace_pattern
    return out


def structured_outputs_of(req: _SamplingFields) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The request's output constraint and the field it came from: ``response_format``
    (``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``; ``{"type": "text"}`` is no constraint), ``structured_outputs`` (vLLM's object:
    ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``) or vLLM's older ``guided_json``
    / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``. ``(None, None)`` when there is none.
    The options (:func:`structured_output_options`: ``structured_outputs.disable_any_whitespace`` /
    ``whitespace_pattern``, ``guided_whitespace_pattern``) are no constraint: they are set on the
    constraint, whichever field gave it (``structured_outputs: {"disable_any_whitespace": true}``
    next to a ``response_format`` is compact JSON of that format, as in vLLM).

    Raises:
        ProtocolError: a malformed constraint, or more than one given (``param`` names the field).
    """
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ProtocolError("response_format: a json_schema response format needs \"json_schema\": "
                                    "{\"name\": ..., \"schema\": {...}} with the schema as an object",
                                    "response_format")
            if js.get("strict") not in (None, True, False):
                raise ProtocolError("response_format: json_schema.strict must be a boolean", "response_format")
            found.append(("response_format", {"json": js["schema"]}))
        elif kind != "text":
            raise ProtocolError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got "
                                f"{str(kind)[:50]!r}", "response_format")
    for name in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {name.removeprefix("guided_"): value}))
    options = structured_output_options(req)
    so = req.structured_outputs
    if so is not None:
        rest = {k: v for k, v in so.items() if k not in SO_OPTIONS + _SO_NO_EFFECT}
        if rest or not options and not any(k in so for k in _SO_NO_EFFECT):
            found.append(("structured_outputs", rest))  # a constraint (or a malformed object: refused below)
    if not found:
        return None, None
    if len(found) > 1:
        raise ProtocolError(f"give one output constraint, not {len(found)}: "
                            f"{', '.join(n for n, _ in found)}", found[1][0])
    name, fields = found[0]
    try:
        return msgspec.convert({**fields, **options}, StructuredOutputsParams), name
    except (msgspec.ValidationError, SamplingParamsError) as e:
        msg = str(e).removeprefix("structured_outputs: ")
        raise ProtocolError(f"{name}: {msg}", name) from None
