"""Structured outputs on the result rank: each constrained sequence's xgrammar matcher.

The result rank (TP rank 0 of the last stage) is the only rank that samples, so it holds the
matchers (:class:`SlotGrammars`, one per request slot). A constrained request's compiled grammar
comes with the micro-batch that first sends the request to the workers
(``ExecuteBatch.grammars``: xgrammar's ``CompiledGrammar.serialize_json`` text, once per grammar
key, and the tokenizer info once), and so does its stop token ids. Per micro-batch:

* before sampling, the bitmask of its constrained rows is filled from the matchers (xgrammar's
  batched fill, on its C++ threads, into one preallocated array), with the batch's forward already
  queued on the device, so the fill overlaps it;
* once its sampled tokens are on the host, the matchers accept them (xgrammar's batched accept),
  and the StepResult says which rows completed their grammar (``grammar_stopped``) or had their
  token refused (``grammar_refused``), for the engine core to end those sequences as it always did.

Consistency: a matcher is created when its request's slot is (re)filled, and accepts at once the
request's output tokens that the engine sent with it (a request resent after preemption by
recompute, or after a stage restart, replays exactly the tokens the engine kept; a fresh matcher,
so nothing is accepted twice). A slot freed by the engine (finished, aborted, preempted) drops its
matcher. The engine frees a slot only after the result of every batch that sampled it, and the
result rank accepts a batch's tokens before it sends the result, so a matcher always sees its
sequence's tokens in order. Each bitmask row is filled when the matcher has accepted exactly the
tokens before the one its chunk samples (checked: a mismatch is an engine bug, raised). A matcher
that ended (complete, dead end, or unreadable) gets an all-ones row: the engine drops its token.

xgrammar is imported on a background thread while the result rank loads its weights
(:func:`import_in_background`), never by the other ranks or the engine core.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Optional

import numpy as np

from zpp.transport import messages as m

logger = logging.getLogger(__name__)

_BATCH_ACCEPT_MIN_ROWS = 64
"""Rows from which the sampled tokens are accepted on several threads (when there are several),
at least half of this per thread (an accept is microseconds: fewer rows are not worth a thread)."""


def default_fill_threads() -> int:
    """Threads for the bitmask fill and the accept: ``ZPP_GRAMMAR_THREADS``, else a quarter of the
    host's cores, 1 to 8 (1 on the 2-core CPU machines; 4 on a 16-core GPU host)."""
    from zpp import envs
    n = envs.ZPP_GRAMMAR_THREADS
    return max(1, n) if n is not None else max(1, min(8, (os.cpu_count() or 1) // 4))


def import_in_background() -> None:
    """Import xgrammar on a daemon thread (about 1.5 s of CPU), so that the first constrained
    request does not stop every stream while it imports. An import error is left for the first
    grammar to raise."""
    import threading

    def run():
        try:
            import xgrammar  # noqa: F401
        except Exception:
            pass
    threading.Thread(target=run, name="zpp-import-xgrammar", daemon=True).start()


_raw_batch_accept = None


def _batch_accept(handles: list, tokens: list[int]):
    """xgrammar's ``BatchGrammarMatcher.batch_accept_token`` on the matchers' C++ objects, its
    result left as xgrammar's array of 0/1 (``0 in result`` is one C++ call). The public wrapper
    converts the result element by element through Python, which cost more than the accepts
    themselves (256 rows: 0.24 ms of accepts, 0.55 ms of conversion on the 2-core VM); it is the
    fallback when xgrammar's layout differs from the one this was written for (0.2.x)."""
    global _raw_batch_accept
    if _raw_batch_accept is None:
        try:
            from xgrammar.base import _core
            _raw_batch_accept = _core.BatchGrammarMatcher.batch_accept_token
        except (ImportError, AttributeError):
            _raw_batch_accept = False
    if _raw_batch_accept:
        return _raw_batch_accept([h._handle for h in handles], tokens, False)
    import xgrammar as xgr
    return [int(a) for a in xgr.BatchGrammarMatcher.batch_accept_token(handles, tokens)]


class SlotGrammars:
    """The result rank's matchers, by request slot, and the compiled grammars they use.

    Args:
        num_slots: request slots (``--max-num-seqs``).
        vocab_size: logits per row. The bitmask has ``ceil(V / 32)`` int32 words per row, ``V`` the
            vocabulary of the tokenizer info (at most ``vocab_size``: the tokenizer's tokens,
            :func:`zpp.frontend.compile_host.grammar_vocab_size`); logits past ``32 * words`` are
            disallowed by the sampler.
        fill_threads: threads of the batched fill (xgrammar's C++ threads) and of the batched
            accept (from ``_BATCH_ACCEPT_MIN_ROWS`` rows); 1 = all on the worker's thread.
    """

    def __init__(self, num_slots: int, vocab_size: int, fill_threads: int = 1):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.fill_threads = fill_threads
        self.matchers: list = [None] * num_slots
        self.constrained = np.zeros(num_slots, dtype=bool)
        """Slots holding a constrained request (ended or not)."""
        self.ended = np.zeros(num_slots, dtype=bool)
        """Slots whose grammar is complete or dead (or unreadable): all-ones rows, no accepts."""
        self.unreadable = np.zeros(num_slots, dtype=bool)
        self.num_accepted = np.zeros(num_slots, dtype=np.int64)
        self.stop = [frozenset()] * num_slots
        self.num_live = 0
        self._tokenizer_info = None
        self._compiled: OrderedDict = OrderedDict()
        self._buf = np.zeros((0, self.words), dtype="<i4")  # preallocated rows, grown as needed
        self._batch = None  # xgrammar's BatchGrammarMatcher (the fill)
        self._pool = None  # threads of the batched accept (fill_threads > 1)

    # --- state ---------------------------------------------------------------------------------
    def forget(self) -> None:
        """After a stage restart: drop every matcher, compiled grammar and the tokenizer info (the
        engine sends them again)."""
        self.__init__(len(self.matchers), self.vocab_size, self.fill_threads)

    def _drop(self, slot: int) -> None:
        if self.constrained[slot]:
            self.num_live -= 1
        self.matchers[slot] = None
        self.constrained[slot] = self.ended[slot] = self.unreadable[slot] = False
        self.num_accepted[slot] = 0

    def apply(self, batch: m.ExecuteBatch, table) -> None:
        """Apply a micro-batch's grammar changes after the slot table applied it (``table``: the
        worker's :class:`~zpp.workers.slots.SlotTable`): freed slots drop their matcher, each
        :class:`~zpp.transport.messages.GrammarInit` makes its slot's matcher, which accepts the
        request's output tokens known so far, then evicted grammars go (a matcher keeps its own).

        Raises:
            RuntimeError: a replayed token refused (the engine kept a token the grammar refuses:
                an engine bug).
        """
        if self.num_live:
            for s in m.int32s(batch.freed_slots).tolist():
                if self.constrained[s]:
                    self._drop(s)
        if batch.grammar_tokenizer:
            import xgrammar as xgr
            self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(batch.grammar_tokenizer)
            words = (min(self.vocab_size, self._tokenizer_info.vocab_size) + 31) // 32
            if words != self.words:
                self.words, self._buf = words, np.zeros((0, words), dtype="<i4")
        for g in batch.grammars:
            self._new(g, table)
        for key in batch.grammar_evict:
            self._compiled.pop(key, None)

    def _new(self, g: m.GrammarInit, table) -> None:
        s = g.slot
        if self.constrained[s]:
            self._drop(s)
        self.constrained[s] = True
        self.num_live += 1
        self.stop[s] = frozenset(g.stop_token_ids)
        try:
            import xgrammar as xgr
            compiled = self._compiled.get(g.key)
            if g.compiled:
                if self._tokenizer_info is None:
                    raise RuntimeError("a grammar came before the tokenizer info")
                compiled = xgr.CompiledGrammar.deserialize_json(g.compiled, self._tokenizer_info)
                self._compiled[g.key] = compiled
            elif compiled is None:
                raise RuntimeError(f"grammar {g.key[:16]} was neither sent nor kept")
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(g.stop_token_ids))
        except Exception:
            logger.exception("sequence %s: its grammar cannot be read; it ends with its next token",
                             table.req_ids[s])
            self.ended[s] = self.unreadable[s] = True
            return
        self.matchers[s] = matcher
        start, end = int(table.num_prompt[s]), int(table.num_tokens[s])
        for t in table.tokens[s, start:end].tolist():  # a resent request: its outputs so far
            if not matcher.accept_token(t):
                raise RuntimeError(f"sequence {table.req_ids[s]}: its grammar refuses output token {t} "
                                   f"it was resent with")
        self.num_accepted[s] = end - start
        if end > start and matcher.is_terminated():
            self.ended[s] = True

    # --- per micro-batch -----------------------------------------------------------------------
    def _rows(self, n: int) -> np.ndarray:
        if self._buf.shape[0] < n:
            self._buf = np.zeros((max(n, 2 * self._buf.shape[0]), self.words), dtype="<i4")
        return self._buf[:n]

    def fill(self, slots: np.ndarray, needs: np.ndarray) -> np.ndarray:
        """The allowed next tokens of the constrained rows ``slots`` (``needs``: how many output
        tokens precede the token each row samples), one row each, into a preallocated buffer:
        ``int32[len(slots), words]`` little-endian, xgrammar's layout, valid until the next fill.
        Ended slots get all ones.

        Raises:
            RuntimeError: a matcher that has not accepted exactly ``needs`` tokens (an engine bug:
                the row would constrain the wrong position).
        """
        bitmask = self._rows(len(slots))
        live = ~self.ended[slots]
        bad = live & (self.num_accepted[slots] != needs)
        if bad.any():
            i = int(np.argmax(bad))
            raise RuntimeError(f"slot {int(slots[i])}: its grammar accepted {int(self.num_accepted[slots[i]])} "
                               f"tokens, but its row samples output token {int(needs[i])}")
        index = np.flatnonzero(live).tolist()
        if len(index) < len(slots):
            bitmask[~live] = -1
        matchers = [self.matchers[s] for s in slots[index].tolist()]
        if len(index) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, index[0])
        elif index:
            # One batched call even on one thread: 2.5x faster than a call per row (the bitmask
            # crosses into C++ once; 256 rows of scripts/bench_structured.py's schema: 0.47 ms
            # against 1.14 ms on the 2-core VM).
            if self._batch is None:
                import xgrammar as xgr
                self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, index)
        return bitmask

    def fill_drafts(self, slots: np.ndarray, needs: np.ndarray, drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Speculative decoding: the bitmask rows of constrained verify chunks, ``1 + k`` per chunk
        (row ``j``: the allowed tokens after the chunk's first ``j`` drafts). Each matcher walks its
        chunk's drafts (``drafts[i]``, ``k`` of them), filling the row after each one it accepts; it
        stops at the first draft its grammar refuses (the draft is cut there: the row before it
        disallows it, so no later draft can be accepted) or once the grammar is complete. Rows
        past the walk, and the row after a draft that completed the grammar, are all ones (their
        tokens are never kept). The walk is undone by :meth:`rollback`.

        Returns ``(bitmask int32[sum(k_i + 1), words], walked int64[len(slots)])``: the rows
        (valid until the next fill) and how many drafts each matcher accepted.

        Raises:
            RuntimeError: as :meth:`fill` (a matcher that has not accepted exactly ``needs`` tokens).
        """
        sizes = [len(d) + 1 for d in drafts]
        bitmask = self._rows(sum(sizes))
        live = ~self.ended[slots]
        bad = live & (self.num_accepted[slots] != needs)
        if bad.any():
            i = int(np.argmax(bad))
            raise RuntimeError(f"slot {int(slots[i])}: its grammar accepted {int(self.num_accepted[slots[i]])} "
                               f"tokens, but its verify chunk samples output token {int(needs[i])}")
        walked = np.zeros(len(slots), dtype=np.int64)
        row = 0
        for i, (s, d) in enumerate(zip(slots.tolist(), drafts)):
            end = row + len(d) + 1
            if not live[i]:
                bitmask[row:end] = -1
                row = end
                continue
            matcher = self.matchers[s]
            matcher.fill_next_token_bitmask(bitmask, row)
            w = 0
            for t in d:
                if not matcher.accept_token(t):
                    break
                w += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row + w)
            if matcher.is_terminated() and w:
                bitmask[row + w:end] = -1
            else:
                bitmask[row + w + 1:end] = -1
            walked[i] = w
            row = end
        return bitmask, walked

    def rollback(self, slots: np.ndarray, walked: np.ndarray) -> None:
        """Undo :meth:`fill_drafts`' walk: each matcher of ``slots`` goes back by its ``walked``
        tokens (xgrammar's ``GrammarMatcher.rollback``)."""
        for s, w in zip(slots.tolist(), walked.tolist()):
            if w:
                self.matchers[s].rollback(w)

    def accept(self, slots: np.ndarray, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Advance the matchers of the constrained rows ``slots`` by their sampled ``tokens``
        (xgrammar's batched accept: one call, or one call per slice on ``fill_threads`` threads,
        xgrammar releasing the GIL). Returns the indices (into ``slots``) of the rows whose grammar
        is now complete (the token is one of its stop tokens and was accepted) and of those whose
        token was refused (a dead end; an unreadable grammar's row counts as one, once)."""
        live = ~self.ended[slots]
        refused = np.flatnonzero(self.unreadable[slots]).tolist()
        if refused:
            self.unreadable[slots[refused]] = False
        index = np.flatnonzero(live).tolist()
        if not index:
            return [], refused
        sl = slots[index].tolist()
        toks = [tokens[i] for i in index]
        ok = self._accept([self.matchers[s] for s in sl], toks)
        stopped = []
        for j, (i, s, t) in enumerate(zip(index, sl, toks)):
            if ok is not True and not ok[j]:
                self.ended[s] = True
                refused.append(i)
                continue
            self.num_accepted[s] += 1
            # A grammar completes only by accepting one of its stop tokens: the matcher is asked only then.
            if t in self.stop[s] and self.matchers[s].is_terminated():
                self.ended[s] = True
                stopped.append(i)
        return stopped, sorted(refused)

    def _accept(self, matchers: list, tokens: list[int]):
        """True when every token was accepted (the usual case, one check), else a 0/1 per row."""
        n = len(matchers)
        if n == 1:
            return True if matchers[0].accept_token(tokens[0]) else [0]
        if self.fill_threads > 1 and n >= _BATCH_ACCEPT_MIN_ROWS:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(self.fill_threads, thread_name_prefix="zpp-grammar")
            k = min(self.fill_threads, n // (_BATCH_ACCEPT_MIN_ROWS // 2))
            cuts = [n * i // k for i in range(k + 1)]
            parts = [self._pool.submit(_batch_accept, matchers[a:b], tokens[a:b]) for a, b in zip(cuts, cuts[1:])]
            results = [f.result() for f in parts]
        else:
            results = [_batch_accept(matchers, tokens)]
        if not any(0 in r for r in results):
            return True
        return [int(x) for r in results for x in r]


def sampled_rows(grammars: Optional[SlotGrammars], cols: m.BatchColumns, num_prompt: np.ndarray):
    """The constrained rows among a batch's sampling chunks: ``(rows, slots, needs)`` -- indices
    into the sampling chunks (increasing), their slots, and how many output tokens precede the
    token each samples; None when none is constrained. ``num_prompt``: the slot table's."""
    if grammars is None or not grammars.num_live:
        return None
    chunks = np.flatnonzero(cols.sample)
    slots = cols.slots[chunks]
    con = grammars.constrained[slots]
    if not con.any():
        return None
    rows = np.flatnonzero(con)
    c, s = chunks[rows], slots[rows]
    needs = cols.starts[c].astype(np.int64) + cols.num_tokens[c] - num_prompt[s]
    return rows, s.astype(np.int64), needs
