"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar.

The shape vLLM V1 uses, kept to zpp's size:

* **Front end** (:class:`zpp.frontend.grammar.GrammarCompiler`): compiles a request's
  constraint once, in a process of its own; the compiled grammar travels to the core serialized.
* **Engine core** (:class:`GrammarStore`, :class:`RequestGrammar`): the *only* grammar matcher of
  a sequence lives in the core, which alone decides the micro-batches, so no two ranks can
  disagree about a grammar state (the pipeline-parallel hang of vLLM #8237 / sglang #28424). When
  a sequence is scheduled to sample, the core fills its row of a token bitmask from its matcher
  (:meth:`GrammarStore.fill_bitmask`) and sends the rows of the constrained sequences with the
  micro-batch to the result rank; when the sampled token comes back, the matcher accepts it.
* **Last stage**: :func:`zpp.workers.sampler.unpack_bitmask` turns the rows into a boolean mask
  that the sampler applies to the logits before sampling.

A sequence's matcher only ever moves forward: a decoding sequence is in at most one micro-batch
in flight (the scheduler's rule), so when it is scheduled to sample every token it has produced
has already been accepted; preemption by recompute keeps the generated tokens, and with them the
matcher's state.
"""
from __future__ import annotations

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

    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher):
        self.matcher = matcher
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


_BATCH_FILL_MIN_ROWS = 16
"""Rows from which the core fills bitmasks on several threads (when it has them)."""


def default_fill_threads() -> int:
    """Threads for the core's bitmask fill: a quarter of the host's cores, 1 to 8 (1 on the
    2-core CPU machines, where the workers need the cores; 4 on a 16-core GPU host)."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


class GrammarStore:
    """The engine core's grammars: deserialized once per grammar key (LRU), a matcher per sequence.

    Args:
        vocab_size: logits per row; the bitmask has ``ceil(vocab_size / 32)`` int32 words per row.
        fill_threads: threads filling a batch's bitmask rows (xgrammar's ``BatchGrammarMatcher``,
            C++ threads, from ``_BATCH_FILL_MIN_ROWS`` rows); 1 = one row after the other.
    """

    def __init__(self, vocab_size: int, fill_threads: int = 1):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.fill_threads = fill_threads
        self._batch = None
        self._tokenizer_info = None
        self._grammars: OrderedDict = OrderedDict()

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
        g = self._grammars.get(spec.key)
        if g is None:
            g = xgr.CompiledGrammar.deserialize_json(spec.compiled, self._tokenizer_info)
            self._grammars[spec.key] = g
            while len(self._grammars) > _CACHE_ENTRIES:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(spec.key)
        return RequestGrammar(xgr.GrammarMatcher(g, override_stop_tokens=stop_token_ids))

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """The allowed next tokens of each grammar, one row each: ``int32[len(grammars),
        ceil(vocab_size / 32)]`` little-endian, as bytes (the layout of
        ``ExecuteBatch.grammar_bitmask``)."""
        bitmask = np.zeros((len(grammars), self.words), dtype="<i4")
        if self.fill_threads > 1 and len(grammars) >= _BATCH_FILL_MIN_ROWS:
            if self._batch is None:
                import xgrammar as xgr
                self._batch = xgr.BatchGrammarMatcher(self.fill_threads)
            self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
        else:
            for i, g in enumerate(grammars):
                g.matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask.tobytes()
