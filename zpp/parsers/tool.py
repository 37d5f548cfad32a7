"""Tool-call parsers: a model's tool-call text -> OpenAI ``tool_calls`` (``--tool-call-parser``).

Each model family writes its calls in its own format; the chat template teaches it (the tools go
to the template as ``tools=``). A parser finds where the calls start in the output (the text before
is the message ``content``) and reads each call's function name and arguments:

* ``hermes`` (Hermes 2 Pro, Qwen2.5/3, and zpp's own tool prompt): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks, or an output that is just such a JSON object.
* ``llama3_json`` (Llama 3.1-3.3 JSON tool calling): the output is ``{"name": ..., "parameters":
  {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``; anything else is content.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (tokenizers before
  v11) or ``name[ARGS]{...}`` per call (v11 and later, each call after its own ``[TOOL_CALLS]``).
  Call ids are 9 letters and digits (Mistral's templates refuse others).
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜>`` then per call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\nARGS\\n```<｜tool▁call▁end｜>`` (DeepSeek-V3, R1), also V3.1's
  ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``.

Only calls of functions the request offers become ``tool_calls``; an output with none is all
content. vLLM's parsers of the same names were the reference for the formats; the code is zpp's.

Every parser answers two questions about an output (``text``, the whole output so far):
:meth:`ToolParser.extract` for a finished output, and :meth:`ToolParser.partial` while it streams:
how much of it is certainly content and which calls are already complete. The streamed calls
are always the first calls of the finished output, and the streamed content a prefix of its
content, so a stream and a non-streamed response carry the same message.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from typing import Any, Optional

Call = tuple[str, str]
"""One parsed call: (function name, arguments as JSON text)."""


def _args_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def json_prefix(text: str) -> tuple[Any, int]:
    """The JSON value at the start of ``text`` (after whitespace) and the index just past it;
    ``(None, -1)`` when there is no complete value there."""
    i = len(text) - len(text.lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, i)
    except ValueError:
        return None, -1


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (a marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def safe_end(text: str, marker: str) -> int:
    """Where the text before ``marker`` (found, or possibly starting at the end) ends."""
    k = text.find(marker)
    return k if k >= 0 else len(text) - partial_suffix(text, marker)


def object_call(obj: Any, names: set[str], args_keys=("arguments", "parameters")) -> Optional[Call]:
    """``{"name": N, "arguments"|"parameters": {...}}`` with N in ``names`` -> a call, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    for k in args_keys:
        if k in obj:
            return obj["name"], _args_text(obj[k])
    return obj["name"], "{}"


class ToolParser:
    """Base of the tool-call parsers (see the module docstring).

    Attributes:
        name: the ``--tool-call-parser`` value.
        markers: the strings that open a tool call; a tokenizer that has one of them as a special
            token needs ``skip_special_tokens=False`` for the request (the server sets it).
    """

    name = ""
    markers: tuple[str, ...] = ()
    call_format = ""
    """How a call looks, for the tool prompt zpp writes when the chat template ignores ``tools``."""

    def extract(self, text: str, names: set[str]) -> tuple[int, list[Call]]:
        """A finished output -> ``(content_end, calls)``: the content is ``text[:content_end]``
        (None when empty); no calls: the whole text is content (``content_end == len(text)``)."""
        raise NotImplementedError

    def partial(self, text: str, names: set[str]) -> tuple[int, list[Call]]:
        """An output still streaming -> ``(content_end, complete_calls)``: ``text[:content_end]``
        is content whatever comes next; the calls are complete (the first calls of any finished
        output that continues this text)."""
        raise NotImplementedError

    def new_id(self) -> str:
        """A fresh tool call id."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def format_calls(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls ``(name, arguments JSON text)`` written as the model is told to write them
        (:attr:`call_format`): the assistant turn of a chat template that ignores ``tools`` (and so
        its ``tool_calls``) gets this text, so the conversation shows the call its tool answers."""
        raise NotImplementedError


def call_object(name: str, arguments: str, args_key: str = "arguments") -> str:
    """``{"name": name, args_key: arguments}`` as JSON; ``arguments`` inlined when it is a JSON
    text (as OpenAI sends it), else as a string."""
    try:
        args = json.loads(arguments)
    except (TypeError, ValueError):
        args = arguments
    return json.dumps({"name": name, args_key: args}, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks, or an output that is just a ``{"name", "arguments"}``
    object (the text before the first block is content)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)
    call_format = '<tool_call>{"name": "<function name>", "arguments": {...}}</tool_call>'

    def format_calls(self, calls):
        return "\n".join(self.OPEN + call_object(n, a) + self.CLOSE for n, a in calls)

    def _blocks(self, text: str, start: int, names: set[str], final: bool) -> list[Call]:
        calls = []
        for block in text[start:].split(self.OPEN)[1:]:
            if self.CLOSE not in block and not final:
                break
            c = object_call(json_prefix(block.split(self.CLOSE, 1)[0])[0], names)
            if c:
                calls.append(c)
        return calls

    def extract(self, text, names):
        start = text.find(self.OPEN)
        if start >= 0:
            calls = self._blocks(text, start, names, True)
            return (start, calls) if calls else (len(text), [])
        if text.lstrip().startswith("{"):
            c = object_call(json_prefix(text)[0], names)
            if c:
                return 0, [c]
        return len(text), []

    def partial(self, text, names):
        start = text.find(self.OPEN)
        if start >= 0:
            return start, self._blocks(text, start, names, False)
        if not text.strip() or text.lstrip().startswith("{"):
            return 0, []  # may be a bare JSON call: hold it
        return len(text) - partial_suffix(text, self.OPEN), []


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)
    call_format = '{"name": "<function name>", "parameters": {...}}'

    def format_calls(self, calls):
        return "; ".join(call_object(n, a, "parameters") for n, a in calls)

    def _body(self, text: str) -> Optional[int]:
        """Index of the first call's JSON (after whitespace and the tag), None if not a call output."""
        s = text.lstrip()
        i = len(text) - len(s)
        if s.startswith(self.TAG):
            i += len(self.TAG)
            s = text[i:].lstrip()
            i = len(text) - len(s)
        return i if s.startswith("{") else None

    def _calls(self, text: str, i: int, names: set[str]) -> list[Call]:
        calls = []
        while True:
            obj, end = json_prefix(text[i:])
            if end < 0:
                return calls
            c = object_call(obj, names, ("parameters", "arguments"))
            if c is None:
                return calls
            calls.append(c)
            i += end
            rest = text[i:].lstrip()
            if not rest.startswith(";"):
                return calls
            i = len(text) - len(rest) + 1

    def extract(self, text, names):
        i = self._body(text)
        calls = self._calls(text, i, names) if i is not None else []
        return (0, calls) if calls else (len(text), [])

    def partial(self, text, names):
        s = text.lstrip()
        if not s or self.TAG.startswith(s) or s.startswith(self.TAG) or s.startswith("{"):
            i = self._body(text)
            return 0, self._calls(text, i, names) if i is not None else []
        return len(text), []


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{"name", "arguments"}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name = "mistral"
    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (BOT,)
    call_format = '[TOOL_CALLS][{"name": "<function name>", "arguments": {...}}]'

    def format_calls(self, calls):
        return self.BOT + "[" + ", ".join(call_object(n, a) for n, a in calls) + "]"
    _ALNUM = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))

    def _calls(self, text: str, start: int, names: set[str], final: bool) -> list[Call]:
        calls: list[Call] = []
        pieces = text[start:].split(self.BOT)[1:]
        for n, piece in enumerate(pieces):
            arriving = not final and n == len(pieces) - 1  # this call may still be growing
            s = piece.lstrip()
            if s.startswith("[") or s.startswith("{"):  # a JSON array (or one object) of calls
                obj, end = json_prefix(piece)
                if end < 0:
                    if arriving:
                        break
                    continue
                for o in obj if isinstance(obj, list) else [obj]:
                    c = object_call(o, names)
                    if c:
                        calls.append(c)
            elif self.ARGS in piece:
                fname, args = piece.split(self.ARGS, 1)
                obj, end = json_prefix(args)
                if end < 0 and arriving:
                    break
                if fname.strip() in names:
                    calls.append((fname.strip(), _args_text(obj) if end >= 0 else args.strip()))
            elif arriving:
                break
        return calls

    def extract(self, text, names):
        start = text.find(self.BOT)
        calls = self._calls(text, start, names, True) if start >= 0 else []
        return (start, calls) if calls else (len(text), [])

    def partial(self, text, names):
        start = text.find(self.BOT)
        if start < 0:
            return len(text) - partial_suffix(text, self.BOT), []
        return start, self._calls(text, start, names, False)


class DeepSeekV3ToolParser(ToolParser):
    """DeepSeek-V3 / R1 (and V3.1) tool calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (CALLS_BEGIN,)
    call_format = (CALLS_BEGIN + BEGIN + "function" + SEP + "<function name>\n```json\n{...}\n```" + END
                   + CALLS_END)

    def format_calls(self, calls):
        return self.CALLS_BEGIN + "".join(self.BEGIN + "function" + self.SEP + n + "\n```json\n" + a + "\n```"
                                          + self.END for n, a in calls) + self.CALLS_END

    def _call(self, block: str, names: set[str]) -> Optional[Call]:
        if self.SEP not in block:
            return None
        head, body = block.split(self.SEP, 1)
        if head.strip() == "function" and "\n" in body:  # V3: NAME\n```json\nARGS\n```
            fname, args = body.split("\n", 1)
            args = args.strip()
            if args.startswith("```json"):
                args = args[len("```json"):]
            elif args.startswith("```"):
                args = args[3:]
            args = args.strip()
            if args.endswith("```"):
                args = args[:-3].rstrip()
        else:  # V3.1: NAME<sep>ARGS
            fname, args = head, body.strip()
        fname = fname.strip()
        if fname not in names:
            return None
        obj, end = json_prefix(args)
        return fname, _args_text(obj) if end >= 0 else args

    def _calls(self, text: str, start: int, names: set[str], final: bool) -> list[Call]:
        section = text[start + len(self.CALLS_BEGIN):].split(self.CALLS_END, 1)[0]
        calls = []
        for block in section.split(self.BEGIN)[1:]:
            if self.END not in block and not final:
                break
            c = self._call(block.split(self.END, 1)[0], names)
            if c:
                calls.append(c)
        return calls

    def extract(self, text, names):
        start = text.find(self.CALLS_BEGIN)
        if start < 0:  # some outputs skip the section marker
            start = text.find(self.BEGIN)
            if start >= 0:
                text = text[:start] + self.CALLS_BEGIN + text[start:]
        calls = self._calls(text, start, names, True) if start >= 0 else []
        return (start, calls) if calls else (len(text), [])

    def partial(self, text, names):
        start = text.find(self.CALLS_BEGIN)
        if start < 0:
            return min(len(text) - partial_suffix(text, self.CALLS_BEGIN),
                       safe_end(text, self.BEGIN)), []
        return start, self._calls(text, start, names, False)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, DeepSeekV3ToolParser)}
"""``--tool-call-parser`` name -> parser class."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``. Raises ValueError (listing the names) for an unknown one."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--tool-call-parser {name!r}: not one of {', '.join(TOOL_PARSERS)}") from None
