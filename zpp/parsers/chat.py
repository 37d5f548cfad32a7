"""Chat messages from a finished or streaming output, with the reasoning and tool parsers.

The server's hooks: :class:`ChatParsers` holds the configured parsers (``--tool-call-parser``,
``--reasoning-parser``) and builds, per request, the final message (:meth:`ChatParsers.message`)
or a :class:`ChatStream` of deltas. The reasoning is split off first; what is left (the content)
goes to the tool parser, as in vLLM.
"""
from __future__ import annotations

from typing import Optional

from zpp.parsers.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from zpp.parsers.tool import ToolParser, get_tool_parser
from zpp.server.tools import ToolPlan, ToolStream, parse_output


class ChatParsers:
    """The server's parsers.

    Args:
        tool_call_parser: ``--tool-call-parser`` name (None: ``hermes``, zpp's behaviour before the flag).
        reasoning_parser: ``--reasoning-parser`` name, or None (no reasoning split: no
            ``reasoning_content`` field at all).
        tokenizer: to find parser tags that are special tokens (then requests that use the
            parser keep special tokens in their text: ``skip_special_tokens=False``).

    Raises:
        ValueError: an unknown parser name (the message lists the known ones).
    """

    def __init__(self, tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 tokenizer=None):
        self.tool: ToolParser = get_tool_parser(tool_call_parser or "hermes")
        self.reasoning: Optional[ReasoningParser] = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        special = set(getattr(tokenizer, "all_special_tokens", None) or ())
        self.tool_needs_special = any(m in special for m in self.tool.markers)
        self.reasoning_needs_special = bool(self.reasoning) and any(m in special for m in self.reasoning.markers)

    def keep_special_tokens(self, plan: Optional[ToolPlan], reasons: bool) -> bool:
        """Must this request's text keep special tokens (a parser's tag is one)?"""
        return bool((plan is not None and plan.mode == "auto" and self.tool_needs_special)
                    or (reasons and self.reasoning_needs_special))

    def opened(self, prompt_tail: str) -> bool:
        """Does the output start inside a reasoning block (see ReasoningParser.opened_by_prompt)?"""
        return self.reasoning is not None and self.reasoning.opened_by_prompt(prompt_tail)

    def message(self, text: str, plan: Optional[ToolPlan], reasons: bool, opened: bool,
                include_reasoning: bool = True) -> tuple[dict, bool]:
        """The assistant message of a finished output and whether it holds tool calls.

        ``reasons``: split reasoning off (a reasoning parser is set and the output is not
        grammar-constrained); the message then has ``reasoning_content`` (None with
        ``include_reasoning`` false, or when the output has none) and a None ``content`` when empty."""
        msg: dict = {"role": "assistant"}
        if reasons:
            reasoning, content = self.reasoning.split(text, opened)
            msg["content"] = content
            msg["reasoning_content"] = reasoning if include_reasoning else None
            text = content or ""
        else:
            msg["content"] = text
            if self.reasoning is not None:
                msg["reasoning_content"] = None
        if plan is None:
            return msg, False
        content, calls = parse_output(plan, text, self.tool)
        if reasons and not content:
            content = None
        msg["content"] = content
        if calls:
            msg["tool_calls"] = calls
        return msg, bool(calls)

    def stream(self, plan: Optional[ToolPlan], reasons: bool, opened: bool,
               include_reasoning: bool = True) -> "ChatStream":
        """A :class:`ChatStream` for one choice."""
        return ChatStream(ToolStream(plan, self.tool) if plan is not None else None,
                          ReasoningStream(self.reasoning, opened) if reasons else None, include_reasoning)


class ChatStream:
    """One streamed choice: ``feed(text, final)`` with the whole output so far returns the new
    deltas (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [...]}``);
    ``calls`` counts the tool calls sent."""

    def __init__(self, tools: Optional[ToolStream], reasoning: Optional[ReasoningStream],
                 include_reasoning: bool = True):
        self.tools, self.reasoning, self.include_reasoning = tools, reasoning, include_reasoning
        self.sent = 0

    @property
    def calls(self) -> int:
        return self.tools.calls if self.tools is not None else 0

    def feed(self, text: str, final: bool) -> list[dict]:
        out = []
        if self.reasoning is not None:
            piece, text = self.reasoning.feed(text, final)
            if piece and self.include_reasoning:
                out.append({"reasoning_content": piece})
        if self.tools is not None:
            return out + self.tools.feed(text, final)
        if len(text) > self.sent:
            out.append({"content": text[self.sent:]})
            self.sent = len(text)
        return out
