"""Front-end output processing: the core's per-step deltas -> each request's outputs.

For every :class:`~zpp.transport.core_messages.SeqDelta`: append the token and its logprobs, run the
incremental detokenizer and the stop strings (a hit ends the sequence here and aborts it in the
core), collect prompt logprobs, and publish a :class:`~zpp.outputs.RequestOutput` to the
request's stream. Metrics observers see every request through the ``on_*`` hooks. No engine
state is read: everything arrives in the deltas.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from zpp.transport.core_messages import StepOutputs
from zpp.frontend.detokenizer import IncrementalDetokenizer
from zpp.outputs import CompletionOutput, Logprob, RequestOutput
from zpp.transport.messages import TokenLogprobs
from zpp.sampling_params import SamplingParams


@dataclass
class _Seq:
    """One sequence: ``out`` holds every token received; a stream is shown its first ``shown``
    tokens (whole tokens whose text is final, see :meth:`IncrementalDetokenizer.stream_cut`), with
    ``out.text`` their text and ``cum_logprob`` the sum of their logprobs."""

    req_id: str
    detok: Optional[IncrementalDetokenizer]
    out: CompletionOutput
    cum_logprob: float = 0.0
    shown: int = 0


@dataclass
class _Group:
    """A user request: one prompt, ``n`` sequences, one output stream."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seqs: list[_Seq]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_logprobs: Optional[list] = None
    prompt_logprobs_missing: int = 0
    """Prompt positions (after the first) whose logprobs were asked for and are not in yet."""
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    stream: bool = True
    """Publish every step (False: only the final output, for offline use)."""
    num_unfinished: int = 0

    def __post_init__(self):
        self.num_unfinished = len(self.seqs)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    """Per-request output state in the front end.

    Args:
        tokenizer: HF tokenizer, or None (outputs then have no text and stop strings never match).
        abort_in_core: called with sequence ids the core must stop (stop strings, failed requests).
    """

    def __init__(self, tokenizer, abort_in_core: Callable[[list[str]], None]):
        self.tokenizer = tokenizer
        self.abort_in_core = abort_in_core
        self.groups: dict[str, _Group] = {}
        self.seq_to_group: dict[str, tuple[_Group, _Seq]] = {}
        self.metrics = None  # optional observer with on_* hooks (server/metrics.py)
        self._texts: dict[int, str] = {}  # token id -> decoded alone (logprobs' decoded_token)

    def new_group(self, request_id: str, prompt: Optional[str], ids: list[int], sampling: SamplingParams,
                  seq_ids: list[str], stream: bool) -> _Group:
        seqs = []
        for i, sid in enumerate(seq_ids):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, sampling.stop, sampling.skip_special_tokens,
                                               sampling.include_stop_str_in_output, sampling.min_tokens)
            out = CompletionOutput(index=i, logprobs=[] if sampling.logprobs is not None else None)
            seqs.append(_Seq(sid, detok, out))
        group = _Group(request_id, prompt, ids, sampling, seqs, stream=stream)
        if sampling.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
            group.prompt_logprobs_missing = len(ids) - 1
        return group

    def add(self, group: _Group) -> None:
        """Track a request whose sequences the core runs."""
        self.groups[group.request_id] = group
        for s in group.seqs:
            self.seq_to_group[s.req_id] = (group, s)
        if self.metrics:
            self.metrics.on_request_added(group)

    def finish_empty(self, group: _Group) -> None:
        """A request prepared with ``max_tokens == 0`` (completions' ``echo`` with ``max_tokens`` 0):
        finished at once with no output. Metrics see it
        added as well as finished, so that its prompt counts in ``prompt_tokens`` as it does in
        the finished requests' prompt-length histogram."""
        for s in group.seqs:
            s.out.finish_reason = "length"
        group.num_unfinished = 0
        self.groups[group.request_id] = group
        if self.metrics:
            self.metrics.on_request_added(group)
        self._publish(group)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return the ids of its sequences the core still runs."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        live = []
        for s in group.seqs:
            self.seq_to_group.pop(s.req_id, None)
            if s.out.finish_reason is None:
                s.out.finish_reason = "abort"
                live.append(s.req_id)
        if self.metrics:
            self.metrics.on_request_finished(group, aborted=True)
        return live

    def end_all(self, error: Exception) -> None:
        """Hand ``error`` to every request's stream (its ``generate`` raises it)."""
        for g in list(self.groups.values()):
            g.queue.put_nowait(error)

    def process(self, step: StepOutputs) -> None:
        """Apply one step's deltas and publish the requests they touched."""
        now = time.monotonic()
        touched: dict[str, _Group] = {}
        stopped: list[str] = []
        for d in step.deltas:
            entry = self.seq_to_group.get(d.req_id)
            if entry is None:
                continue  # aborted or already finished by a stop string
            group, seq = entry
            touched[group.request_id] = group
            p = d.prompt_logprobs
            if p is not None and group.prompt_logprobs is not None:
                # Any of the n sequences may deliver them (they share the prompt; whichever is
                # scheduled first computes it); a recompute after preemption gives the same values.
                for j, e in enumerate(p.entries):
                    group.prompt_logprobs_missing -= group.prompt_logprobs[p.start + j] is None
                    group.prompt_logprobs[p.start + j] = self._logprob_dict(e)
            if d.token_id < 0 and d.finish_reason is None:
                continue  # a prefill chunk
            out = seq.out
            finish, stop_reason = d.finish_reason, d.stop_reason
            if d.token_id >= 0:
                if group.first_token_time is None:
                    group.first_token_time = now
                    if self.metrics:
                        self.metrics.on_first_token(group, now)
                elif self.metrics:
                    self.metrics.on_token(group, now)
                group.last_token_time = now
                out.token_ids.append(d.token_id)
                if out.logprobs is not None and d.logprobs is not None:
                    out.logprobs.append(self._logprob_dict(d.logprobs))
            if seq.detok is not None and d.token_id >= 0:
                # As in vLLM, a token that stopped the sequence (EOS, stop_token_ids) adds no text
                # unless include_stop_str_in_output.
                hide = finish == "stop" and not group.sampling.include_stop_str_in_output
                stop = seq.detok.add_tokens([] if hide else [d.token_id])
                if stop is not None:
                    # A stop string outranks a stop token, EOS or length met on the same token.
                    if finish is None:
                        stopped.append(seq.req_id)
                    finish, stop_reason = "stop", stop
            if finish is not None:
                group.num_unfinished -= 1
                out.finish_reason, out.stop_reason = finish, stop_reason
                self.seq_to_group.pop(seq.req_id, None)
                if seq.detok is not None:
                    seq.detok.flush()
            shown = len(out.token_ids)  # finished: all, a stop token that added no text too
            if seq.detok is not None:
                cut, out.text = seq.detok.stream_cut(finish is not None)
                if finish is None:
                    shown = cut
            self._show(seq, shown)
        if stopped:
            self.abort_in_core(stopped)
        for group in touched.values():
            if group.stream or group.num_unfinished == 0:
                self._publish(group)

    @staticmethod
    def _show(seq: _Seq, n: int) -> None:
        """Let streams see the sequence's first ``n`` tokens (and their logprobs)."""
        out = seq.out
        if out.logprobs is not None:
            for j in range(seq.shown, min(n, len(out.logprobs))):
                e = out.logprobs[j].get(out.token_ids[j])
                seq.cum_logprob += e.logprob if e is not None else 0.0
        seq.shown = max(seq.shown, n)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """One position's logprobs in vLLM's form: ``{token_id: Logprob}``, the chosen token's
        entry first, then the top-k with ranks 1..k. As in vLLM, a chosen token that is among the
        top-k keeps its first place and takes its top-k rank."""
        text = self._token_text
        d = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
            d[t] = Logprob(v, rank, text(t))
        return d

    def _token_text(self, token_id: int) -> Optional[str]:
        """A token decoded alone (cached), as vLLM's ``decoded_token``; None without a tokenizer."""
        s = self._texts.get(token_id)
        if s is None and self.tokenizer is not None:
            s = self._texts[token_id] = self.tokenizer.decode([token_id])
        return s

    def _publish(self, group: _Group) -> None:
        if group.prompt_logprobs is not None and group.prompt_logprobs_missing \
                and any(s.out.token_ids for s in group.seqs):
            # A sampled token means the whole prompt was computed, so every prompt logprob must be
            # in: never answer a value that was asked for with null.
            group.queue.put_nowait(RuntimeError(
                f"request {group.request_id}: {group.prompt_logprobs_missing} prompt logprobs were not "
                "computed (an engine bug)"))
            live = self.abort(group.request_id)
            if live:
                self.abort_in_core(live)
            return
        finished = group.finished
        # Each sequence as far as it may be streamed: whole tokens, their text and logprobs
        # (everything once it finished).
        outs = [CompletionOutput(index=s.out.index, text=s.out.text, token_ids=s.out.token_ids[:s.shown],
                                 finish_reason=s.out.finish_reason, stop_reason=s.out.stop_reason,
                                 logprobs=s.out.logprobs[:s.shown] if s.out.logprobs is not None else None,
                                 cumulative_logprob=s.cum_logprob if s.out.logprobs is not None else None)
                for s in group.seqs]
        group.queue.put_nowait(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                                             finished, list(group.prompt_logprobs) if group.prompt_logprobs else None))
        if finished:
            self.groups.pop(group.request_id, None)
            for s in group.seqs:
                self.seq_to_group.pop(s.req_id, None)
            if self.metrics:
                self.metrics.on_request_finished(group, aborted=False)


@dataclass
class ChoiceDelta:
    """What one choice of a streamed request has new since the previous chunk sent for it.

    Attributes:
        output: the choice's cumulative output (as :class:`~zpp.outputs.CompletionOutput`).
        text: the generated text not sent yet; ``text_start``: its offset in ``output.text``.
        token_ids / logprobs: the generated tokens (and their logprobs, when asked) not sent yet;
            ``token_start``: their offset in ``output.token_ids``.
    """

    output: CompletionOutput
    text: str
    text_start: int
    token_ids: list[int]
    logprobs: Optional[list]
    token_start: int

    @property
    def finish_reason(self) -> Optional[str]:
        return self.output.finish_reason


class StreamDeltas:
    """Turns a request's cumulative outputs (what :meth:`AsyncEngine.generate` yields: several
    engine steps may arrive as one) into per-choice deltas, the one place streams are cut.

    The outputs hold whole tokens only (the output processor publishes a running sequence up to
    its last token whose text is final and cannot start a stop string), so a delta's ``text`` is
    exactly the text of its ``token_ids`` and its ``logprobs`` are theirs. The one exception is
    the finished delta of a sequence a stop string ended: its text stops at the stop string (or
    after it, with ``include_stop_str_in_output``) and a token that went past it, or a stop token
    (EOS, ``stop_token_ids``) that adds no text, is still among its tokens and logprobs, as in vLLM.

    ``deltas(out.outputs)`` gives a :class:`ChoiceDelta` per choice not finished-and-sent; ``sent(delta)``
    records that it went out (a consumer may hold a delta back, e.g. one with no text yet, and
    get it again, with more, next time); ``sent_tokens`` is the tokens sent over all choices.
    Keys are the choice index, or ``(prompt index, choice index)`` for several prompts.
    """

    def __init__(self):
        self._text: dict = {}
        self._tokens: dict = {}
        self._finished: set = set()

    def deltas(self, outputs, prompt: Optional[int] = None) -> list[tuple[object, ChoiceDelta]]:
        """(key, delta) for each of ``outputs`` (a RequestOutput's choices) not finished and sent."""
        res = []
        for c in outputs:
            key = c.index if prompt is None else (prompt, c.index)
            if key in self._finished:
                continue
            start, t0 = self._text.get(key, 0), self._tokens.get(key, 0)
            res.append((key, ChoiceDelta(c, c.text[start:], start, c.token_ids[t0:],
                                         (c.logprobs or [])[t0:] if c.logprobs is not None else None, t0)))
        return res

    def sent(self, key, d: ChoiceDelta) -> None:
        self._text[key], self._tokens[key] = len(d.output.text), len(d.output.token_ids)
        if d.output.finish_reason is not None:
            self._finished.add(key)

    @property
    def sent_tokens(self) -> int:
        return sum(self._tokens.values())
