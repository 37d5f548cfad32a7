"""Incremental detokenization with stop strings.

Text is decoded over a sliding window of token ids (the prefix/read offsets of HF's
``TextStreamer`` and vLLM's ``detokenize_incrementally``): each step decodes the window with and
without the new tokens and appends the difference, so a tokenizer that drops a leading space on
the first token of a decode (SentencePiece) still yields exact text. A decode that ends in U+FFFD
is an incomplete UTF-8 sequence and is held back until the next token completes it.

What may be streamed is cut at token boundaries (:meth:`IncrementalDetokenizer.stream_cut`): the
longest run of whole tokens whose text is complete (no incomplete character pending) and holds no
suffix that could be the start of a stop string. So a client never receives text that is later
taken back (concatenated deltas equal the final text), and every streamed piece of text is exactly
the text of the tokens streamed with it. Only the final piece may end inside a token: a stop string
that ends mid-token cuts the text there while its token is still reported (as vLLM does).
"""
from __future__ import annotations

from typing import Optional

_PROMPT_WINDOW = 6


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text.

    Args:
        tokenizer: an HF tokenizer.
        prompt_token_ids: the prompt (its last few tokens seed the decode window).
        stop: stop strings (may be empty).
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the matched stop string.
        min_tokens: stop strings are looked for only once more than this many tokens were added
            (as vLLM: the first ``min_tokens`` tokens are never cut; a stop string that ends
            inside them does not count later either).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: Optional[list[str]] = None,
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_added = 0  # output tokens added so far
        window = list(prompt_token_ids[-_PROMPT_WINDOW:])
        # A prompt cut mid-character would merge its partial bytes into the first output
        # characters; start the window after the prompt then, so no prompt text leaks out.
        if window and self._decode(window).endswith("\ufffd"):
            window = []
        self.ids = window
        self.prefix_offset = 0
        self.read_offset = len(window)
        self.text = ""           # all decoded output text (after stop truncation)
        self.stop_reason: Optional[str] = None
        # (tokens added, len(text)) after each add whose text came out whole (no pending partial
        # character): the points a stream may be cut at. Older ones than the last cut are dropped.
        self._bounds: list[tuple[int, int]] = [(0, 0)]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> Optional[str]:
        """Append generated tokens. Returns the stop string if one now appears in the text (the
        text is then truncated before it, or after it with ``include_stop_str_in_output``)."""
        self.ids.extend(token_ids)
        self.num_added += len(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text):
            return None  # incomplete character (or nothing visible yet): wait for more tokens
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        old_len = len(self.text)
        self.text += delta
        self._bounds.append((self.num_added, len(self.text)))
        if self.stop and self.num_added > self.min_tokens:
            best = None
            for s in self.stop:
                # only a match ending in the new text: one inside the old text was found before, or
                # ended within the first min_tokens tokens and does not count
                i = self.text.find(s, max(0, old_len - len(s) + 1))
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
                self.stop_reason = s
                return s
        return None

    def flush(self) -> None:
        """At the end: include a trailing incomplete character (as U+FFFD), as a full decode would."""
        if self.stop_reason is not None:
            return
        tail = self._decode(self.ids[self.prefix_offset:])
        head = self._decode(self.ids[self.prefix_offset:self.read_offset])
        if len(tail) > len(head) and self.read_offset < len(self.ids):
            self.text += tail[len(head):]
            self.read_offset = len(self.ids)

    def stream_cut(self, finished: bool) -> tuple[int, str]:
        """What may be sent now: ``(number of output tokens, their text)``.

        Finished: every token added and all the text (cut at the stop string, if one matched;
        the token that held it is counted in full). Otherwise the longest prefix of whole tokens
        such that (1) no token in it waits on an incomplete UTF-8 character (or on a following
        token to show its text) and (2) its text leaves out every suffix of :attr:`text` that may
        be the start of a stop string (none is held with ``include_stop_str_in_output``: the text
        up to a match's end is kept then). The text returned is exactly those tokens' text, and
        the cut never moves back between calls.
        """
        if finished:
            return self.num_added, self.text
        t = self.text
        limit = len(t)
        if self.stop and not self.include_stop:
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(t)), hold, -1):
                    if t.endswith(s[:k]):
                        hold = k
                        break
            limit -= hold
        b = self._bounds
        j = len(b) - 1
        while j and b[j][1] > limit:  # b[0], the last cut, is within it: the limit never moves back
            j -= 1
        if j:
            del b[:j]
        n, end = b[0]
        return n, t[:end]

