"""Reasoning parsers: a thinking model's output -> ``reasoning_content`` + ``content``
(``--reasoning-parser``, vLLM's flag and field names).

Both families think between ``<think>`` and ``</think>``:

* ``deepseek_r1``: the output starts in its reasoning, whether or not the model writes
  ``<think>`` (DeepSeek-R1's template opens the block in the prompt): everything up to ``</think>``
  is reasoning, the rest content; an output without ``</think>`` (cut off) is all reasoning.
* ``qwen3``: an output that opens with ``<think>``, or whose prompt ends inside an open
  ``<think>`` block (Qwen3-2507 Thinking's template), reasons up to ``</think>``; any other
  output (``enable_thinking: false``, whose template closes an empty block in the prompt) is all
  content.

:meth:`ReasoningParser.split` reads a finished output; :class:`ReasoningStream` turns a growing
output into ``reasoning_content`` pieces and the content so far (which goes on to a tool
parser), holding back a tag that may be arriving, so that a stream carries the same message as
the non-streamed response.
"""
from __future__ import annotations

from typing import Optional

from zpp.parsers.tool import partial_suffix


class ReasoningParser:
    """Base: ``<think>...</think>`` reasoning.

    Attributes:
        name: the ``--reasoning-parser`` value.
        always_open: the output starts inside the reasoning block (DeepSeek-R1).
        markers: the tags (a tokenizer that has one as a special token needs
            ``skip_special_tokens=False``; the server sets it).
    """

    name = ""
    START, END = "<think>", "</think>"
    markers = (START, END)
    always_open = False

    def opened_by_prompt(self, prompt_tail: str) -> bool:
        """Does the output start inside a reasoning block? ``prompt_tail``: the end of the
        rendered prompt (a few tokens are enough)."""
        if self.always_open:
            return True
        k = prompt_tail.rfind(self.START)
        return k >= 0 and prompt_tail.find(self.END, k) < 0

    def _start(self, text: str, opened: bool) -> Optional[int]:
        """Where the reasoning starts in ``text`` (after a leading ``<think>``), None: no reasoning."""
        s = text.lstrip()
        if s.startswith(self.START):
            return len(text) - len(s) + len(self.START)
        return 0 if opened else None

    def split(self, text: str, opened: bool) -> tuple[Optional[str], Optional[str]]:
        """A finished output -> ``(reasoning_content, content)``; either is None when absent
        (content also when empty). ``opened``: from :meth:`opened_by_prompt`."""
        i = self._start(text, opened)
        if i is None:
            return None, text or None
        j = text.find(self.END, i)
        if j < 0:
            return text[i:], None
        return text[i:j], text[j + len(self.END):] or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_open = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
"""``--reasoning-parser`` name -> parser class."""


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``. Raises ValueError (listing the names) for an unknown one."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"--reasoning-parser {name!r}: not one of {', '.join(REASONING_PARSERS)}") from None


class ReasoningStream:
    """One streamed choice: ``feed(text, final)`` with the whole output so far returns
    ``(reasoning_delta, content_so_far)``: the new piece of reasoning (``""`` if none) and the
    content text so far (``""`` while the output reasons or might still open ``<think>``)."""

    def __init__(self, parser: ReasoningParser, opened: bool):
        self.parser, self.opened = parser, opened
        self.sent = 0  # characters of reasoning sent

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        p = self.parser
        if final:
            reasoning, content = p.split(text, self.opened)
            reasoning = reasoning or ""
        else:
            s = text.lstrip()
            if not s or (p.START.startswith(s) and s != p.START):
                return "", ""  # <think> may be arriving
            i = p._start(text, self.opened)
            if i is None:
                return "", text
            j = text.find(p.END, i)
            if j < 0:
                reasoning, content = text[i:len(text) - partial_suffix(text, p.END)], None
            else:
                reasoning, content = text[i:j], text[j + len(p.END):]
        delta = reasoning[self.sent:] if len(reasoning) > self.sent else ""
        self.sent = max(self.sent, len(reasoning))
        return delta, content or ""
