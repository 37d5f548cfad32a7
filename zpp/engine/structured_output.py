"""Structured outputs (JSON schema, JSON object, regex, choice, EBNF grammar) with xgrammar.

The shape vLLM V1 uses, kept to zpp's size:

* **Front end** (:class:`GrammarCompiler`): a request's :class:`~zpp.sampling_params.StructuredOutputsParams`
  is compiled by xgrammar in a thread (never on the event loop), with a bounded time
  (``--structured-outputs-compile-timeout``), a size limit on the specification
  (``--max-structured-outputs-spec-bytes``) and one on the compiled grammar
  (``--max-structured-outputs-grammar-bytes``, checked before the grammar is serialized: its
  serialization takes a few times its size in memory); compiled grammars are cached by a hash of
  the specification. The compile threads are daemon threads, so a compile still running never
  keeps a stopping server alive. A grammar that does not compile is a :class:`~zpp.engine.inputs.RequestError`
  (HTTP 400) carrying xgrammar's message. The compiled grammar travels to the core serialized
  (:class:`~zpp.engine.core_messages.GrammarSpec`, msgpack text, no pickle).
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

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from typing import Optional

import msgspec
import numpy as np

from zpp.engine.core_messages import GrammarSpec
from zpp.engine.inputs import RequestError
from zpp.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 256
"""Compiled grammars kept (front end: serialized text; core: deserialized), least recently used out."""

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^:\s]+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_ERROR_CHARS = 500


def _library_message(e: BaseException) -> str:
    """xgrammar's error text without its ``[time] file.cc:line:`` prefix, cut to 500 characters."""
    msg = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    return msg if len(msg) <= _MAX_ERROR_CHARS else msg[:_MAX_ERROR_CHARS] + "..."


def spec_of(params: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, text)``: the constraint's kind and its specification as text (a dict schema as
    JSON, keys in their order: the order of ``properties`` is the order generated; choices as a
    JSON list), what the size limit and the cache key see."""
    kind = params.kind
    if kind == "json":
        js = params.json
        return kind, js if isinstance(js, str) else msgspec.json.encode(js).decode()
    if kind == "choice":
        return kind, json.dumps(params.choice, ensure_ascii=False)
    if kind == "json_object":
        return kind, ""
    return kind, getattr(params, kind)


class GrammarCompiler:
    """Compiles structured-output constraints in the front end (one per :class:`AsyncEngine`).

    Args:
        tokenizer: the HF tokenizer (None: structured outputs are refused).
        vocab_size: the model's vocabulary size (``config.json``), which may exceed the
            tokenizer's: the bitmask covers every logit.
        stop_token_ids: the engine's EOS ids, the tokens a complete grammar allows.
        compile_timeout: seconds a compile may take, queueing for a thread included.
        max_spec_bytes: largest specification (UTF-8 bytes) accepted.
        max_grammar_bytes: largest compiled grammar (xgrammar's ``memory_size_bytes``) accepted.

    xgrammar's ``TokenizerInfo`` (about 0.6 s for a 49k vocabulary) is built on first use, in the
    compile thread.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], compile_timeout: float,
                 max_spec_bytes: int, max_grammar_bytes: int = 16 << 20):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.max_spec_bytes = max_spec_bytes
        self.max_grammar_bytes = max_grammar_bytes
        self._pool = _DaemonPool(2, "zpp-grammar")
        self._lock = threading.Lock()
        self._compiler = None
        self.tokenizer_info_json = ""
        self._tokenizer_info_sent = False
        self._cache: OrderedDict[str, str] = OrderedDict()  # key -> serialized CompiledGrammar
        self._inflight: dict[str, tuple[asyncio.Future, threading.Event]] = {}  # key -> (compile, started)

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self.tokenizer_info_json = info.serialize_json()
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    async def warm_up(self) -> None:
        """Import xgrammar and build the tokenizer info now, in the compile thread (a few seconds
        on a loaded CPU), so that the first structured-output request does not wait for it. A
        failure is logged; structured-output requests are then refused with its message."""
        if self.tokenizer is None:
            return
        try:
            await asyncio.wrap_future(self._pool.submit(self._xgr_compiler))
        except Exception as e:
            logger.warning("structured outputs are unavailable: xgrammar failed on this tokenizer: %s",
                           _library_message(e))

    def _compile(self, kind: str, text: str, any_whitespace: bool, started: threading.Event) -> str:
        """Compile in a worker thread; returns the serialized CompiledGrammar.

        Raises:
            GrammarTooLarge: the compiled grammar exceeds ``max_grammar_bytes`` (not serialized)."""
        started.set()
        c = self._xgr_compiler()
        if kind == "json":
            g = c.compile_json_schema(text, any_whitespace=any_whitespace, strict_mode=True)
        elif kind == "json_object":  # any object: not strict, else {"type": "object"} admits only {}
            g = c.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        elif kind == "regex":
            g = c.compile_regex(text)
        elif kind == "choice":
            g = c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False)
                                                           for x in json.loads(text)))
        else:
            g = c.compile_grammar(text)
        size = g.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise GrammarTooLarge(f"the compiled {kind} grammar takes {size / 2**20:.1f} MiB; this server accepts at "
                                  f"most {self.max_grammar_bytes / 2**20:.1f} MiB "
                                  f"(--max-structured-outputs-grammar-bytes): simplify it")
        return g.serialize_json()

    async def compile(self, params: StructuredOutputsParams) -> GrammarSpec:
        """The compiled grammar of ``params`` (cached by its specification).

        Raises:
            RequestError: (``param`` = ``"structured_outputs"``) the specification is larger than
                ``max_spec_bytes``, xgrammar cannot compile it (its message is given), or the
                compile took longer than ``compile_timeout`` seconds.
        """
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer, and this model has none", "structured_outputs")
        kind, text = spec_of(params)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            raise RequestError(f"the {kind} specification has {size} bytes; this server accepts at most "
                               f"{self.max_spec_bytes} (--max-structured-outputs-spec-bytes)", "structured_outputs")
        any_ws = not params.disable_any_whitespace
        key = hashlib.sha256(f"{kind}\0{int(any_ws)}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return GrammarSpec(key, compiled)
        entry = self._inflight.get(key)
        if entry is None:  # one compile per specification at a time, however many requests wait for it
            started = threading.Event()
            fut = asyncio.wrap_future(self._pool.submit(self._compile, kind, text, any_ws, started))
            entry = self._inflight[key] = (fut, started)
            fut.add_done_callback(lambda f, key=key: self._compiled(key, f))
        fut, started = entry
        try:
            compiled = await asyncio.wait_for(asyncio.shield(fut), self.compile_timeout)
        except asyncio.TimeoutError:
            if not started.is_set():
                raise RequestError(f"the {kind} waited {self.compile_timeout:g} s for a compile thread, all busy with "
                                   "other grammars (--structured-outputs-compile-timeout): retry later",
                                   "structured_outputs") from None
            raise RequestError(f"the {kind} did not compile within {self.compile_timeout:g} s "
                               "(--structured-outputs-compile-timeout): simplify it", "structured_outputs") from None
        except GrammarTooLarge as e:
            raise RequestError(str(e), "structured_outputs") from None
        except Exception as e:
            raise RequestError(f"the {kind} could not be compiled: {_library_message(e)}",
                               "structured_outputs") from None
        return GrammarSpec(key, compiled)

    def _compiled(self, key: str, fut: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if fut.cancelled() or fut.exception() is not None:
            return
        self._cache[key] = fut.result()
        self._cache.move_to_end(key)
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)

    def for_core(self, spec: GrammarSpec) -> GrammarSpec:
        """``spec`` as sent to the core: the first one carries the tokenizer info the core needs to
        read grammars (call when the request is handed to the core, in order)."""
        if self._tokenizer_info_sent:
            return spec
        self._tokenizer_info_sent = True
        return GrammarSpec(spec.key, spec.compiled, self.tokenizer_info_json)

    def close(self) -> None:
        self._pool.shutdown()


class GrammarTooLarge(Exception):
    """A compiled grammar over ``--max-structured-outputs-grammar-bytes`` (its message says so)."""


class _DaemonPool:
    """A fixed set of daemon threads running submitted calls in order (``submit`` returns a
    ``concurrent.futures.Future``). Unlike ``ThreadPoolExecutor``, whose threads the interpreter
    joins at exit, a compile still running here (xgrammar's C++ cannot be interrupted) does not
    keep a stopping process alive."""

    def __init__(self, num_threads: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._num_threads = num_threads
        for i in range(num_threads):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # delivered to the waiting request
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel the calls not started and let the threads end (a running call finishes in the
        background)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self._num_threads):
            self._queue.put(None)


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
