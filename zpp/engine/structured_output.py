"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar.

The shape vLLM V1 uses, kept to zpp's size:

* **Front end** (:class:`zpp.frontend.grammar.GrammarCompiler`): a request's :class:`~zpp.sampling_params.StructuredOutputsParams`
  is compiled by xgrammar in a process of its own, forked for that compile by the compile host
  (:mod:`zpp.frontend.compile_host`) and killed when ``--structured-outputs-compile-timeout`` is up,
  whether or not a request still waits for it: a slow grammar never holds a core past the timeout,
  and small specifications have a compile slot of their own, so slow ones never starve them. A
  size limit on the specification (``--max-structured-outputs-spec-bytes``) and one on the
  compiled grammar (``--max-structured-outputs-grammar-bytes``, checked before the grammar is
  serialized: its serialization takes a few times its size in memory) apply; compiled grammars
  are cached by a hash of the specification, and so are refusals (a compile error, a grammar too
  large, a timeout: the latter for ``REFUSED_TIMEOUT_TTL`` seconds), so a copy of a refused
  specification is refused at once instead of compiling again. A grammar that does not compile
  is a :class:`~zpp.errors.RequestError` (HTTP 400) carrying xgrammar's message. The
  compiled grammar travels to the core serialized (:class:`~zpp.transport.core_messages.GrammarSpec`,
  msgpack text, no pickle).
* **Engine core** (:class:`GrammarStore`, :class:`RequestGrammar`, :class:`PendingBitmask`): the
  *only* grammar matcher of a sequence lives in the core, which alone decides the micro-batches,
  so no two ranks can disagree about a grammar state (the pipeline-parallel hang of vLLM #8237 /
  sglang #28424). A micro-batch goes to the stages at once, its constrained rows named; the token
  bitmask of those rows follows to the result rank in a message of its own
  (:class:`~zpp.transport.messages.GrammarBitmask`) as soon as the tokens it depends on are back
  and accepted: the result rank needs it only when it samples the batch, after every stage's
  forward, so the grammar work (xgrammar's batched accept, and its batched fill on C++ threads
  into one preallocated bitmask) overlaps the stages' compute instead of delaying stage 0. (Not
  on a Python thread of the core's: its wrapper code would wait for the GIL, up to the 5 ms switch
  interval, while the core schedules.) The ordering argument (why every bitmask can
  be computed in time and nothing deadlocks, with pipeline parallelism and with async
  scheduling) is in ``EngineCore._apply_result``. This follows vLLM V1's split (the scheduler
  output names the constrained requests, the bitmask is computed for the scheduled batch and
  applied with the logits) and SGLang's overlap of the grammar with the forward pass.
* **Last stage**: :func:`zpp.workers.sampler.unpack_bitmask` turns the rows into a boolean mask
  that the sampler applies to the logits before sampling.

A sequence's matcher only ever moves forward: each bitmask row is filled when the matcher has
accepted exactly the tokens before the one its chunk samples (checked); preemption by recompute
keeps the generated tokens, and with them the matcher's state.
"""
from __future__ import annotations

from typing import Optional

import logging
import os
from collections import OrderedDict

import numpy as np

from zpp.transport.core_messages import GrammarSpec

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 256
"""Deserialized grammars kept, least recently used out."""


class RequestGrammar:
    """One sequence's grammar matcher in the engine core.

    ``num_accepted`` counts the tokens the matcher has accepted: it must equal the sequence's
    generated tokens whenever the sequence is scheduled to sample (checked by the core).
    """

    __slots__ = ("matcher", "handle", "num_accepted")

    def __init__(self, matcher):
        self.matcher = matcher
        self.handle = matcher._handle  # the C++ object, for the batched calls (_batch_accept)
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar does not allow it (a dead end)."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()


_BATCH_ACCEPT_MIN_ROWS = 64
"""Rows from which the core accepts sampled tokens on several threads (when it has them), at
least half of this per thread (an accept is microseconds: fewer rows are not worth a thread)."""


def default_fill_threads() -> int:
    """Threads for the core's bitmask fill: ``ZPP_GRAMMAR_THREADS``, else a quarter of the host's
    cores, 1 to 8 (1 on the 2-core CPU machines, where the workers need the cores; 4 on a 16-core
    GPU host)."""
    from zpp import envs
    n = envs.ZPP_GRAMMAR_THREADS
    return max(1, n) if n is not None else max(1, min(8, (os.cpu_count() or 1) // 4))


def _batch_accept(grammars: list, tokens: list[int]):
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
        return _raw_batch_accept([g.handle for g in grammars], tokens, False)
    import xgrammar as xgr
    return [int(a) for a in xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens)]


_raw_batch_accept = None


def import_xgrammar_in_background() -> None:
    """Import xgrammar on a daemon thread (about 1.5 s of CPU), so that the core's first
    structured-output request does not stop every stream while it imports: a fresh server's
    first constrained request took about 2 s longer than later ones, the core blocked meanwhile.
    The engine core calls this before its workers load; an import error is left for the first
    grammar to raise."""
    import threading

    def run():
        try:
            import xgrammar  # noqa: F401
        except Exception:
            pass
    threading.Thread(target=run, name="zpp-import-xgrammar", daemon=True).start()


class PendingBitmask:
    """A micro-batch sent with constrained rows whose token bitmask is not sent yet.

    ``rows[i]`` is a constrained sampling chunk of request ``reqs[i]``; its bitmask row is computable
    once the request's matcher has accepted ``needs[i]`` tokens (the request's output tokens before
    the one the chunk samples), or at once when the request has finished (the row is then all
    ones: its token is dropped)."""

    __slots__ = ("batch_id", "reqs", "needs")

    def __init__(self, batch_id: int, reqs: list, needs: list[int]):
        self.batch_id, self.reqs, self.needs = batch_id, reqs, needs

    def ready(self) -> bool:
        """Whether every row is computable. Raises RuntimeError when a matcher has accepted more
        tokens than its row's chunk has seen (an engine bug: the row would constrain the wrong
        position)."""
        ok = True
        for req, need in zip(self.reqs, self.needs):
            if req.status.finished:
                continue
            n = req.grammar.num_accepted
            if n > need:
                raise RuntimeError(f"sequence {req.req_id}: its grammar accepted {n} tokens, but micro-batch "
                                   f"{self.batch_id} samples its token {need}")
            ok = ok and n == need
        return ok


class GrammarStore:
    """The engine core's grammars: deserialized once per grammar key (LRU), a matcher per sequence.

    Args:
        vocab_size: logits per row. The bitmask has ``ceil(V / 32)`` int32 words per row, ``V`` the
            vocabulary of the front end's ``TokenizerInfo`` (at most ``vocab_size``: the tokenizer's
            tokens, :func:`zpp.frontend.compile_host.grammar_vocab_size`), known once the first
            grammar arrives; logits past ``32 * words`` are disallowed by the last stage.
        fill_threads: threads filling a batch's bitmask rows (xgrammar's ``BatchGrammarMatcher``,
            C++ threads) and accepting its sampled tokens
            (from ``_BATCH_ACCEPT_MIN_ROWS`` rows); 1 = all on the core's thread.
    """

    def __init__(self, vocab_size: int, fill_threads: int = 1):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.fill_threads = fill_threads
        self._batch = None
        self._tokenizer_info = None
        self._grammars: OrderedDict = OrderedDict()
        self._buf = np.zeros((0, self.words), dtype="<i4")  # preallocated rows, grown as needed
        self._pool = None  # threads of the batched accept (fill_threads > 1)

    def new_matcher(self, spec: GrammarSpec, stop_token_ids: list[int]) -> RequestGrammar:
        """A fresh matcher for one sequence; ``stop_token_ids`` are the tokens that end the
        sequence once the grammar is complete (EOS and the request's stop_token_ids).

        Raises:
            RuntimeError: no tokenizer info has reached the core yet (a front-end bug), or the
                grammar cannot be read.
        """
        import xgrammar as xgr
        if self._tokenizer_info is None:
            if not spec.tokenizer_info:
                raise RuntimeError("a grammar arrived before the front end's tokenizer info")
            self._tokenizer_info = xgr.TokenizerInfo.deserialize_json(spec.tokenizer_info)
            words = (min(self.vocab_size, self._tokenizer_info.vocab_size) + 31) // 32
            if words != self.words:
                self.words = words
                self._buf = np.zeros((0, words), dtype="<i4")
        g = self._grammars.get(spec.key)
        if g is None:
            g = xgr.CompiledGrammar.deserialize_json(spec.compiled, self._tokenizer_info)
            self._grammars[spec.key] = g
            while len(self._grammars) > _CACHE_ENTRIES:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(spec.key)
        return RequestGrammar(xgr.GrammarMatcher(g, override_stop_tokens=stop_token_ids))

    def accept_tokens(self, grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
        """Advance each grammar by its sampled token (xgrammar's ``batch_accept_token``: one call,
        or from ``_BATCH_ACCEPT_MIN_ROWS`` rows one call per slice on ``fill_threads`` threads,
        xgrammar releasing the GIL in its C++ while this thread waits); False where the grammar
        refuses the token (a dead end: the matcher stays where it was)."""
        if len(grammars) < 2:
            return [g.accept(t) for g, t in zip(grammars, tokens)]
        n = len(grammars)
        if self.fill_threads > 1 and n >= _BATCH_ACCEPT_MIN_ROWS:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(self.fill_threads, thread_name_prefix="zpp-grammar")
            k = min(self.fill_threads, n // (_BATCH_ACCEPT_MIN_ROWS // 2))
            cuts = [n * i // k for i in range(k + 1)]
            parts = [self._pool.submit(_batch_accept, grammars[a:b], tokens[a:b]) for a, b in zip(cuts, cuts[1:])]
            results = [f.result() for f in parts]
        else:
            results = [_batch_accept(grammars, tokens)]
        if not any(0 in r for r in results):  # the usual case: every token allowed
            for g in grammars:
                g.num_accepted += 1
            return [True] * n
        ok = [bool(x) for r in results for x in r]
        for g, a in zip(grammars, ok):
            if a:
                g.num_accepted += 1
        return ok

    def _rows(self, n: int) -> np.ndarray:
        if self._buf.shape[0] < n:
            self._buf = np.zeros((max(n, 2 * self._buf.shape[0]), self.words), dtype="<i4")
        return self._buf[:n]

    def fill_rows(self, grammars: list[Optional[RequestGrammar]]) -> np.ndarray:
        """The allowed next tokens of each grammar, one row each (None: every token), into the
        store's preallocated buffer: ``int32[len(grammars), ceil(vocab_size / 32)]`` little-endian
        (the layout of ``ExecuteBatch.grammar_bitmask``), valid until the next fill."""
        bitmask = self._rows(len(grammars))
        index = [i for i, g in enumerate(grammars) if g is not None]
        if len(index) < len(grammars):
            bitmask[[i for i, g in enumerate(grammars) if g is None]] = -1
        if len(index) == 1:
            grammars[index[0]].matcher.fill_next_token_bitmask(bitmask, index[0])
        elif index:
            # One batched call even on one thread: 2.5x faster than a call per row (the bitmask
            # crosses into C++ once; 256 rows of scripts/bench_structured.py's schema: 0.47 ms
            # against 1.14 ms on the 2-core VM).
            if self._batch is None:
                import xgrammar as xgr
                self._batch = xgr.BatchGrammarMatcher(self.fill_threads if self.fill_threads > 1 else 1)
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in index], bitmask, index)
        return bitmask

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """:meth:`fill_rows` as bytes (a copy)."""
        return self.fill_rows(grammars).tobytes()
