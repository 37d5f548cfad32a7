"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar.

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
* **Engine core** (:class:`GrammarSender`): holds no matcher and does no grammar work. When a
  constrained request is sent to the workers (first, or again after preemption or a stage
  restart), its grammar goes with that micro-batch to the result rank
  (``ExecuteBatch.grammars``; the compiled text once per grammar key, the tokenizer info once);
  each StepResult names the rows whose grammar completed or refused its token, and the core ends
  those sequences (``EngineCore._grammar_ends``).
* **Result rank** (TP rank 0 of the last stage, :mod:`zpp.workers.grammar`): the matchers, by
  request slot; it fills a batch's bitmask with the batch's forward queued and accepts the sampled
  tokens before it sends the result. Only it samples, so no two ranks can disagree about a grammar
  state (the pipeline-parallel hang of vLLM #8237 / sglang #28424); the core stays out of the
  chain from one step's tokens to the next step's mask.
"""
from __future__ import annotations

from collections import OrderedDict

from zpp.transport import messages as m
from zpp.transport.core_messages import GrammarSpec

_CACHE_ENTRIES = 256
"""Compiled grammars the result rank keeps, least recently used out (the core decides which)."""


class GrammarSender:
    """The core's side of structured outputs: what to send with each micro-batch so that the
    result rank holds the grammars of the constrained requests it samples.

    The core mirrors the result rank's cache of compiled grammars (an LRU of ``_CACHE_ENTRIES``
    keys it alone updates), so a grammar's compiled text goes once per key, and an eviction is
    named in the batch that causes it. After a stage restart (:meth:`reset`) everything is sent
    again: the result rank forgets it all (``ModelRunner.forget_requests``).
    """

    def __init__(self):
        self.tokenizer_info = ""
        """The front end's xgrammar tokenizer info (the first a grammar came with)."""
        self._sent_tokenizer = False
        self._keys: OrderedDict = OrderedDict()

    def reset(self) -> None:
        """A stage restart: the result rank holds nothing."""
        self._sent_tokenizer = False
        self._keys.clear()

    def check(self, spec: GrammarSpec) -> None:
        """Take a request's grammar as it arrives (keeps the first tokenizer info). Raises
        RuntimeError when no tokenizer info has come yet (a front-end bug)."""
        if spec.tokenizer_info and not self.tokenizer_info:
            self.tokenizer_info = spec.tokenizer_info
        if not self.tokenizer_info:
            raise RuntimeError("a grammar arrived before the front end's tokenizer info")

    def batch_fields(self, new: list[tuple[int, GrammarSpec, list[int]]]) -> dict:
        """The ``ExecuteBatch`` fields for the result rank (``grammars``, ``grammar_tokenizer``,
        ``grammar_evict``) of a batch sending constrained requests ``new``: ``(slot, grammar,
        stop token ids)`` each; ``{}`` when there are none."""
        if not new:
            return {}
        out: dict = {"grammars": []}
        if not self._sent_tokenizer:
            out["grammar_tokenizer"] = self.tokenizer_info
            self._sent_tokenizer = True
        evict = []
        for slot, spec, stop in new:
            if spec.key in self._keys:
                self._keys.move_to_end(spec.key)
                out["grammars"].append(m.GrammarInit(slot, spec.key, stop))
                continue
            self._keys[spec.key] = None
            out["grammars"].append(m.GrammarInit(slot, spec.key, stop, spec.compiled))
            while len(self._keys) > _CACHE_ENTRIES:
                evict.append(self._keys.popitem(last=False)[0])
        evict = [k for k in evict if k not in self._keys]  # the result rank evicts after the batch's grammars
        if evict:
            out["grammar_evict"] = evict
        return out
