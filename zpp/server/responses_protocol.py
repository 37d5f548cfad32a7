"""The request side of ``POST /v1/responses`` (see :mod:`zpp.server.responses` for the API):
the request type :class:`ResponsesRequest`, the refusals of what needs stored state or what zpp
does not implement (:func:`_check_stateless`), and the conversion of a Responses request into the
chat completion request it runs as (:func:`to_chat_request`: input items -> chat messages, function
tools, ``tool_choice``, ``text.format`` -> ``response_format``), with ``_PARAMS`` mapping the chat
path's error params back to the Responses fields (``RequestError.renamed``)."""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from zpp.server.protocol import REASONING_EFFORTS, VERBOSITIES, ChatCompletionRequest, ChatMessage, Int64, ProtocolError, \
    _Request, check_one_of


class ResponsesStreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options`` of a Responses request: ``include_obfuscation`` is accepted (zpp adds no
    obfuscation field)."""

    include_obfuscation: Optional[bool] = None


class ResponsesRequest(_Request, kw_only=True):
    """``POST /v1/responses`` (OpenAI's Responses API, stateless: see the module docstring).

    ``input`` is a string or a list of input items (messages, ``function_call``,
    ``function_call_output``, ``reasoning``: ignored); ``tools`` are function tools;
    ``text.format`` is ``text``, ``json_object`` or ``json_schema``. Fields that need stored state
    (``store: true``, ``previous_response_id``, ``conversation``, ``background: true``) or that zpp
    does not implement (``prompt``,
    ``top_logprobs``, ``include`` other than ``reasoning.encrypted_content``, ``truncation:
    "auto"``) are refused with HTTP 400 naming them. ``reasoning.effort`` (one of
    :data:`~zpp.server.protocol.REASONING_EFFORTS`) is handed to the chat template as the variable
    ``reasoning_effort``, as chat's ``reasoning_effort`` is; ``reasoning.summary`` (one of
    :data:`REASONING_SUMMARIES`) is accepted and writes no summary, as in vLLM (the server's
    ``--reasoning-parser`` decides what is reasoning).
    """

    input: Union[None, str, list[dict[str, Any]]] = None
    model: Optional[str] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int64] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    stream: Optional[bool] = False
    stream_options: Optional[ResponsesStreamOptions] = None
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Union[None, str, dict[str, Any]] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    prompt: Optional[dict[str, Any]] = None
    top_logprobs: Optional[Int64] = None
    max_tool_calls: Optional[Int64] = None
    # OpenAI fields with no effect on a self-hosted server, accepted and echoed.
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None
    # vLLM's sampling extensions
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[Int64] = None


_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _check_stateless(req: ResponsesRequest) -> None:
    """Refuse what needs stored responses or what zpp does not implement. Raises ProtocolError."""
    if req.store:
        raise ProtocolError("store: true is not supported: this server keeps no responses (it serves the Responses "
                            "API statelessly); send store: false, or leave it out, and pass the whole conversation "
                            "in input", "store")
    if req.previous_response_id is not None:
        raise ProtocolError("previous_response_id is not supported: this server keeps no responses; pass the "
                            "earlier turns (their output items) in input instead", "previous_response_id")
    if req.conversation is not None:
        raise ProtocolError("conversation is not supported: this server keeps no conversations; pass the "
                            "earlier turns in input instead", "conversation")
    if req.background:
        raise ProtocolError("background: true is not supported: this server keeps no responses to poll",
                            "background")
    if req.prompt is not None:
        raise ProtocolError("prompt (a stored prompt template) is not supported by this server", "prompt")
    for key, value in (req.reasoning or {}).items():
        if value is None:
            continue
        if key == "effort":
            check_one_of(value, REASONING_EFFORTS, "reasoning.effort")
        elif key in ("summary", "generate_summary"):
            # accepted and ignored, as vLLM does (clients such as Codex send "auto" by default): no
            # summaries are written, the reasoning itself is a reasoning item with a --reasoning-parser
            check_one_of(value, REASONING_SUMMARIES, f"reasoning.{key}")
        else:
            raise ProtocolError(f"reasoning.{key[:40]} is not supported by this server", "reasoning")
    if req.top_logprobs:
        raise ProtocolError("top_logprobs is not supported by this server's Responses API", "top_logprobs")
    if req.max_tool_calls is not None:
        raise ProtocolError("max_tool_calls is not supported by this server", "max_tool_calls")
    for name in req.include or ():
        if name != "reasoning.encrypted_content":  # accepted: reasoning items here carry no encrypted_content
            raise ProtocolError(f"include {name[:60]!r} is not supported by this server", "include")
    if req.truncation not in (None, "disabled"):
        raise ProtocolError(f"truncation {str(req.truncation)[:30]!r} is not supported: an input longer than the "
                            "model's context is refused (truncation: \"disabled\")", "truncation")
    if req.text is not None:  # text.verbosity: accepted, no effect (as chat's verbosity)
        check_one_of(req.text.get("verbosity"), VERBOSITIES, "text.verbosity")


def _content_text(content, where: str) -> str:
    """The text of a message's ``content``: a string or a list of text parts. Raises ProtocolError."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where}.content must be a string or a list of content parts", "input")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in _TEXT_PARTS and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            out.append(p["refusal"])
        else:
            raise ProtocolError(f"{where}.content[{j}]: only text parts (input_text, output_text) are supported, "
                                f"got {str(kind)[:40]!r}", "input")
    return "\n".join(out)  # as vLLM joins a message's text parts


def _reasoning_text(item: dict) -> Optional[str]:
    """The text of a ``reasoning`` input item: its ``reasoning_text`` content parts, else its
    summary parts (joined with "\n"), None when it has neither."""
    for key in ("content", "summary"):
        parts = [p.get("text") for p in item.get(key) or () if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if parts:
            return "\n".join(parts)
    return None


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The chat messages of a Responses request: ``instructions`` first (system), then the input.

    Consecutive ``function_call`` items become one assistant message's ``tool_calls`` (joined to
    the assistant message just before them, if any); a ``function_call_output`` becomes a ``tool``
    message answering its ``call_id``; ``reasoning`` items (an earlier response's reasoning, sent
    back with its output) become the ``reasoning_content`` of the assistant message that follows
    them (vLLM joins a reasoning item and the call after it into one assistant message), which the
    chat template may re-render (Qwen3's does, for the current tool loop) or drop.

    Raises:
        ProtocolError: (``param`` ``"input"``) no input, an item of a type zpp does not serve
            (``item_reference``, images, files, built-in tool calls), a malformed item.
    """
    msgs: list[ChatMessage] = []
    if req.instructions:
        msgs.append(ChatMessage(role="system", content=req.instructions))
    if req.input is None or req.input == "" or req.input == []:
        raise ProtocolError("input is required (a string or a non-empty list of items)", "input")
    if isinstance(req.input, str):
        msgs.append(ChatMessage(role="user", content=req.input))
        return msgs
    reasoning: Optional[str] = None  # of a reasoning item, for the assistant message after it
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise ProtocolError(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}, got "
                                    f"{str(role)[:30]!r}", "input")
            if "content" not in item:
                raise ProtocolError(f"{where}.content is required", "input")
            msgs.append(ChatMessage(role=role, content=_content_text(item["content"], where),
                                    reasoning_content=reasoning if role == "assistant" else None))
            reasoning = None
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise ProtocolError(f"{where}: a function_call item needs call_id, name and arguments (strings)",
                                    "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant":
                last.tool_calls = (last.tool_calls or []) + [call]
                if last.reasoning_content is None:
                    last.reasoning_content = reasoning
            else:
                msgs.append(ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=reasoning))
            reasoning = None
        elif kind == "function_call_output":
            reasoning = None  # only an assistant turn right after a reasoning item takes it
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ProtocolError(f"{where}: a function_call_output item needs the call_id of its call", "input")
            if output is None:
                raise ProtocolError(f"{where}: a function_call_output item needs an output", "input")
            msgs.append(ChatMessage(role="tool", content=_content_text(output, where + ".output"),
                                    tool_call_id=call_id))
        elif kind == "reasoning":
            # A reasoning item of an earlier response, passed back with its output as clients do
            # (the openai-agents SDK, vLLM's example): the next assistant message's reasoning_content.
            reasoning = _reasoning_text(item)
            continue
        elif kind == "item_reference":
            raise ProtocolError(f"{where}: item_reference is not supported: this server keeps no items; pass the "
                                "item itself", "input")
        else:
            raise ProtocolError(f"{where}: input items of type {str(kind)[:40]!r} are not supported (message, "
                                "function_call, function_call_output and reasoning are)", "input")
    return msgs


def _chat_tools(tools: Optional[list]) -> Optional[list[dict]]:
    """Responses function tools -> chat tools. Raises ProtocolError for other tool types."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ProtocolError(f"tools[{i}]: only function tools are supported ({{\"type\": \"function\", \"name\": "
                                f"..., \"parameters\": {{...}}}}), got type {str(kind)[:40]!r}", "tools")
        f = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def _chat_tool_choice(choice):
    """Responses ``tool_choice`` -> chat's. Raises ProtocolError."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                        "tool_choice")


def _response_format(text: Optional[dict]) -> Optional[dict]:
    """``text.format`` -> chat's ``response_format``. Raises ProtocolError (param ``"text"``)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ProtocolError('text.format: a json_schema format needs "schema" (a JSON Schema object)', "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise ProtocolError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}",
                        "text")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses request runs as. Raises ProtocolError."""
    return ChatCompletionRequest(
        messages=input_messages(req), max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed,
        tools=_chat_tools(req.tools), tool_choice=_chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text),
        reasoning_effort=reasoning_effort(req))


REASONING_SUMMARIES = ("auto", "concise", "detailed")
"""OpenAI's ``reasoning.summary`` values: accepted, no summary written (``summary`` items stay empty)."""


def reasoning_effort(req: ResponsesRequest) -> Optional[str]:
    """``reasoning.effort`` (checked by :func:`_check_stateless`), None when not set."""
    return (req.reasoning or {}).get("effort")


# chat-path params -> the Responses fields they come from (``prompt``: the rendered input, not
# the Responses ``prompt`` field, a stored template refused before the chat path runs)
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "messages": "input", "prompt": "input"}
