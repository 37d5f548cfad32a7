"""Structured outputs in the front end: a request's constraint compiled by xgrammar.

a request's :class:`~zpp.sampling_params.StructuredOutputsParams`
is compiled by xgrammar in a process of its own, forked for that compile by the compile host
(:mod:`zpp.frontend.compile_host`) and killed when ``--structured-outputs-compile-timeout`` is up,
whether or not a request still waits for it: a slow grammar never holds a core past the timeout,
and past its first second it gives its compile slot up and runs at the lowest CPU priority, so
slow ones (of any size) never starve a later request for long. A
size limit on the specification (``--max-structured-outputs-spec-bytes``) and one on the
compiled grammar (``--max-structured-outputs-grammar-bytes``, checked before the grammar is
serialized: its serialization takes a few times its size in memory) apply; compiled grammars
are cached by a hash of the specification, and so are refusals (a compile error, a grammar too
large, a timeout: the latter for ``REFUSED_TIMEOUT_TTL`` seconds), so a copy of a refused
specification is refused at once instead of compiling again. A grammar that does not compile
is a :class:`~zpp.frontend.inputs.RequestError` (HTTP 400) carrying xgrammar's message. The
compiled grammar travels to the core serialized (:class:`~zpp.transport.core_messages.GrammarSpec`,
msgpack text, no pickle).

The engine core's half (the matchers, the token bitmasks) is :mod:`zpp.engine.structured_output`.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import re
import time
from collections import OrderedDict
from typing import Optional, Union

import msgspec

from zpp.structured_outputs_config import JsonWhitespace
from zpp.errors import RequestError
from zpp.frontend.compile_host import CompileFailed, CompileHost, CompileHostDied, CompileTimedOut
from zpp.sampling_params import StructuredOutputsParams
from zpp.transport.core_messages import GrammarSpec

logger = logging.getLogger(__name__)

_CACHE_ENTRIES = 256
"""Compiled grammars (and refusals) kept, by specification."""

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


REFUSED_TIMEOUT_TTL = 600.0
"""Seconds a specification whose compile timed out is refused at once without compiling again
(timeouts depend on the load; compile errors are remembered for as long as the cache keeps them)."""


class _Compile:
    """A compile in flight: the host's job, its future and how many requests wait for it."""

    __slots__ = ("job_id", "future", "waiters")

    def __init__(self, job_id: int, future: asyncio.Future):
        self.job_id, self.future, self.waiters = job_id, future, 0


class GrammarCompiler:
    """Compiles structured-output constraints in the front end (one per :class:`AsyncEngine`).

    Args:
        tokenizer: the HF tokenizer (None: structured outputs are refused).
        vocab_size: the model's vocabulary size (``config.json``), which may exceed the
            tokenizer's: the bitmask covers every logit.
        stop_token_ids: the engine's EOS ids, the tokens a complete grammar allows.
        compile_timeout: seconds a compile may take, waiting for a compile slot included; a compile
            still running then is killed.
        max_spec_bytes: largest specification (UTF-8 bytes) accepted.
        max_grammar_bytes: largest compiled grammar (xgrammar's ``memory_size_bytes``) accepted.
        whitespace: the server-wide whitespace rule of JSON grammars (``--structured-outputs-config``;
            default: each run of whitespace at most DEFAULT_MAX_WHITESPACE_CNT characters), see
            :meth:`whitespace_of`.

    The compile host (:class:`~zpp.frontend.compile_host.CompileHost`: it imports xgrammar and builds
    its ``TokenizerInfo`` from the tokenizer's directory, a few seconds) is started by
    :meth:`warm_up` (``zpp serve``: while the workers load) or by the first structured-output
    request (the offline ``LLM``), and again by the next request after it died; its start does not
    count against a compile timeout.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], compile_timeout: float,
                 max_spec_bytes: int, max_grammar_bytes: int = 16 << 20, whitespace: Optional[JsonWhitespace] = None):
        self.whitespace = whitespace or JsonWhitespace()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = compile_timeout
        self.max_spec_bytes = max_spec_bytes
        self.max_grammar_bytes = max_grammar_bytes
        self.tokenizer_info_json = ""
        self._tokenizer_info_sent = False
        self._host: Optional[CompileHost] = None
        self._job_ids = itertools.count()
        self._cache: OrderedDict[str, str] = OrderedDict()  # key -> serialized CompiledGrammar
        self._refused: OrderedDict[str, tuple[str, Optional[float]]] = OrderedDict()  # key -> (message, until)
        self._inflight: dict[str, _Compile] = {}

    async def warm_up(self) -> None:
        """Start the compile host now (it imports xgrammar and builds the tokenizer info: a few
        seconds on a loaded CPU), so that the first structured-output request does not wait for it.
        A failure is logged; structured-output requests then try again, and are refused with its
        message."""
        if self.tokenizer is None:
            return
        try:
            await self._started_host()
        except Exception as e:
            logger.warning("structured outputs are unavailable: %s", _library_message(e))

    async def _started_host(self) -> CompileHost:
        if self._host is None:
            self._host = CompileHost(self.tokenizer.name_or_path, self.vocab_size, self.stop_token_ids)
        self.tokenizer_info_json = await self._host.start()
        return self._host

    async def compile(self, params: StructuredOutputsParams) -> GrammarSpec:
        """The compiled grammar of ``params`` (cached by its specification).

        Raises:
            RequestError: (``param`` = ``"structured_outputs"``) the specification is larger than
                ``max_spec_bytes``, xgrammar cannot compile it (its message is given), the compiled
                grammar is over ``max_grammar_bytes``, the compile took longer than
                ``compile_timeout`` seconds (or no compile slot freed up in that time), or the same
                specification was refused so before (at once, without compiling again).
        """
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer, and this model has none", "structured_outputs")
        kind, text = spec_of(params)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_spec_bytes:
            raise RequestError(f"the {kind} specification has {size} bytes; this server accepts at most "
                               f"{self.max_spec_bytes} (--max-structured-outputs-spec-bytes)", "structured_outputs")
        ws = self.whitespace_of(params)
        key = hashlib.sha256(f"{kind}\0{ws!r}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return GrammarSpec(key, compiled)
        refused = self._refused.get(key)
        if refused is not None:
            message, until = refused
            if until is None or time.monotonic() < until:
                self._refused.move_to_end(key)
                raise RequestError(message, "structured_outputs")
            del self._refused[key]
        try:
            host = await self._started_host()
        except Exception as e:
            raise RequestError(f"structured outputs are unavailable: {_library_message(e)}",
                               "structured_outputs") from None
        entry = self._inflight.get(key)
        if entry is None:  # one compile per specification at a time, however many requests wait for it
            job_id = next(self._job_ids)
            entry = self._inflight[key] = _Compile(job_id, host.submit(
                job_id, kind, text, ws, self.max_grammar_bytes, self.compile_timeout))
            entry.future.add_done_callback(lambda f, key=key, e=entry, k=kind: self._compiled(key, e, k))
        entry.waiters += 1
        try:
            compiled = await asyncio.wait_for(asyncio.shield(entry.future), self.compile_timeout)
        except asyncio.TimeoutError:
            started = host.started_at(entry.job_id)
            if started is None:
                raise RequestError(f"the {kind} waited {self.compile_timeout:g} s for a compile slot, all busy with "
                                   "other grammars (--structured-outputs-compile-timeout): retry later",
                                   "structured_outputs") from None
            ran = time.monotonic() - started
            if ran < 0.9 * self.compile_timeout:  # most of the time went waiting for a slot
                raise RequestError(f"the {kind} did not compile within {self.compile_timeout:g} s, of which it waited "
                                   f"{self.compile_timeout - ran:.1f} s for a compile slot, all busy with other "
                                   "grammars (--structured-outputs-compile-timeout): retry later",
                                   "structured_outputs") from None
            self._remember_timeout(key, kind)
            self._log_timeout(kind, size)
            raise RequestError(self._timeout_message(kind), "structured_outputs") from None
        except CompileTimedOut:
            self._log_timeout(kind, size)
            raise RequestError(self._timeout_message(kind), "structured_outputs") from None
        except CompileFailed as e:
            raise RequestError(self._failed_message(kind, e), "structured_outputs") from None
        except CompileHostDied as e:
            raise RequestError(f"the {kind} could not be compiled: {e}", "structured_outputs") from None
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.future.done():
                # Nobody waits for it any more (timed out, or the clients went away): the host
                # unqueues it, or kills it if it runs. A copy sent later compiles afresh, unless
                # this one timed out (remembered above).
                host.drop(entry.job_id)
                if self._inflight.get(key) is entry:
                    del self._inflight[key]
        return GrammarSpec(key, compiled)

    def whitespace_of(self, params: StructuredOutputsParams) -> Union[None, bool, int, str]:
        """The whitespace rule ``params`` compiles with (what the compile host's ``_compile`` takes):
        None for a grammar that is not JSON; False: compact (the request's
        ``disable_any_whitespace``, else the server's); a str: the request's ``whitespace_pattern``
        (a regex every run of whitespace matches; the request's ``disable_any_whitespace`` wins
        over it, it wins over the server's); an int: each run at most that many characters (the
        server's ``max_whitespace_cnt``); True: any whitespace (``max_whitespace_cnt`` null)."""
        if params.kind not in ("json", "json_object"):
            return None
        if params.disable_any_whitespace:
            return False
        if params.whitespace_pattern is not None:
            return params.whitespace_pattern
        if self.whitespace.disable_any_whitespace:
            return False
        return self.whitespace.max_whitespace_cnt or True

    def _log_timeout(self, kind: str, size: int) -> None:
        """The operator's record of a grammar refused for its compile time (the client gets a 400)."""
        logger.warning("structured outputs: a %s of %d bytes did not compile within %g s "
                       "(--structured-outputs-compile-timeout); the request was refused", kind, size,
                       self.compile_timeout)

    def _timeout_message(self, kind: str) -> str:
        return (f"the {kind} did not compile within {self.compile_timeout:g} s "
                "(--structured-outputs-compile-timeout): simplify it")

    @staticmethod
    def _failed_message(kind: str, e: "CompileFailed") -> str:
        return str(e) if e.too_large else f"the {kind} could not be compiled: {_library_message(e)}"

    def _compiled(self, key: str, entry: _Compile, kind: str) -> None:
        """A compile ended: cache its grammar, or remember its refusal."""
        if self._inflight.get(key) is entry:
            del self._inflight[key]
        fut = entry.future
        if fut.cancelled():
            return
        e = fut.exception()
        if e is None:
            self._cache[key] = fut.result()
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return
        if isinstance(e, CompileTimedOut):
            self._remember_timeout(key, kind)
        elif isinstance(e, CompileFailed):
            self._remember(key, self._failed_message(kind, e), None)

    def _remember_timeout(self, key: str, kind: str) -> None:
        self._remember(key, self._timeout_message(kind) + " (it timed out before: not compiled again for now)",
                       time.monotonic() + REFUSED_TIMEOUT_TTL)

    def _remember(self, key: str, message: str, until: Optional[float]) -> None:
        self._refused[key] = (message, until)
        self._refused.move_to_end(key)
        while len(self._refused) > _CACHE_ENTRIES:
            self._refused.popitem(last=False)

    def for_core(self, spec: GrammarSpec) -> GrammarSpec:
        """``spec`` as sent to the core: the first one carries the tokenizer info the core needs to
        read grammars (call when the request is handed to the core, in order)."""
        if self._tokenizer_info_sent:
            return spec
        self._tokenizer_info_sent = True
        return GrammarSpec(spec.key, spec.compiled, self.tokenizer_info_json)

    @property
    def host_pid(self) -> Optional[int]:
        """The compile host's process id while it runs (tests, diagnostics)."""
        return self._host.pid if self._host is not None else None

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
