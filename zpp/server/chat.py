"""OpenAI-compatible HTTP server on aiohttp: /v1/completions, /v1/chat/completions, /v1/models,
/health, /ping, /version, /metrics, and vLLM's /tokenize and /detokenize.

Bad requests get HTTP 4xx in OpenAI's error shape and never reach the engine. A client that goes
away aborts its requests: the runner is built with ``handler_cancellation=True``, so aiohttp
cancels the handler task, which closes the engine streams (``AsyncEngine.generate`` aborts an
unfinished request in its ``finally``) and the engine frees the request's KV blocks once no
micro-batch in flight still writes them.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from contextlib import aclosing
from typing import Any, AsyncIterator, Optional

from aiohttp import hdrs, web

import zpp
from zpp.utils.process import freeze_gc, main_module_hidden, sigint_blocked, watch_parent
from zpp.errors import ConfigError
from zpp.frontend.async_engine import AsyncEngine, EngineBusyError, EngineDeadError, EngineShutdownError, RequestError
from zpp.outputs import CompletionOutput, Logprob, RequestOutput
from zpp.sampling_params import SamplingParams, SamplingParamsError
from zpp.server.metrics import DEFAULT_LOG_STATS_INTERVAL_S, Metrics, StatsLogger
from zpp.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ProtocolError,
                                 check_unsupported_chat_fields,
                                 TokenizeRequest, body_too_large, content_codings, decode_request, error_body,
                                 new_id, now, structured_outputs_of, to_sampling_params, undo_content_encoding)
from zpp.server.tools import ToolPlan, ToolStream, parse_output, parse_tools

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20  # --max-request-body-bytes
DEFAULT_MAX_STOP_SEQUENCES = 64  # --max-stop-sequences
MAX_WARNED_FIELDS = 256  # distinct unknown field names logged; later new names are not
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, ensure_ascii=False), status=status, content_type="application/json")


def _error(message: str, status: int = 400, err_type: str = "invalid_request_error",
           param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return _json(error_body(message, err_type, param, code), status)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (the alphabet of
    byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


class TokenStrings:
    """Text and raw bytes of single tokens, for logprobs (cached per token id).

    ``text(id)`` is the token decoded alone (U+FFFD for a piece of a multi-byte character, as
    vLLM reports it); ``bytes(id)`` is the token's exact UTF-8 bytes for byte-level BPE
    tokenizers, so that a client can join the bytes of consecutive tokens into characters (the
    purpose of OpenAI's ``bytes`` field). Without a tokenizer a token reads ``token_id:<id>``.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._byte_of: Optional[dict[str, int]] = None
        try:
            if type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel":
                self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        except Exception:  # no fast backend / no decoder: fall back to the decoded text's bytes
            pass

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self.tok.decode([tid]) if self.tok is not None else f"token_id:{tid}"
            self._text[tid] = s
        return s

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            b = None
            if self._byte_of is not None and tid not in self.tok.all_special_ids:
                piece = self.tok.convert_ids_to_tokens(tid)
                if isinstance(piece, str) and all(ch in self._byte_of for ch in piece):
                    b = [self._byte_of[ch] for ch in piece]
            if b is None:
                b = list(self.text(tid).encode("utf-8"))
            self._bytes[tid] = b
        return b


def _top(lp: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) pairs of one position, most likely first."""
    return [(t, e.logprob) for t, e in sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]]


def _logprob_of(lp: Optional[dict[int, Logprob]], token_id: int) -> Optional[float]:
    """``token_id``'s logprob at a position (None when the position or the token has none)."""
    e = lp.get(token_id) if lp else None
    return e.logprob if e is not None else None


class _SSE:
    """A server-sent-events response prepared on its first event, so that an error raised before
    any output (engine dead, ...) still becomes an ordinary JSON error response."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: Optional[web.StreamResponse] = None

    @property
    def started(self) -> bool:
        return self.resp is not None

    async def _start(self) -> web.StreamResponse:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            await self.resp.prepare(self.request)
        return self.resp

    async def send(self, data: dict) -> None:
        resp = await self._start()
        await resp.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")

    async def fail(self, e: Exception) -> web.StreamResponse:
        """End the stream with an error event and [DONE] (OpenAI's client raises APIError on it);
        before the first event, re-raise so the client gets an ordinary JSON error response."""
        if not self.started:
            raise e
        if not isinstance(e, (EngineDeadError, RequestError)):
            logger.exception("error while streaming %s", self.request.path)
        status, err_type, param = _classify(e)
        await self.send(error_body(_message(e), err_type, param) | {"status_code": status})
        return await self.done()

    async def done(self) -> web.StreamResponse:
        resp = await self._start()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _message(e: BaseException) -> str:
    if isinstance(e, (EngineShutdownError, EngineBusyError)):
        return str(e)
    if isinstance(e, EngineDeadError):
        return f"the engine is dead: {e}"
    if isinstance(e, (ProtocolError, RequestError, SamplingParamsError)):
        return str(e)
    return f"internal error: {type(e).__name__}: {e}"


def _classify(e: BaseException) -> tuple[int, str, Optional[str]]:
    """(HTTP status, OpenAI error type, param) for an exception raised while serving."""
    if isinstance(e, ProtocolError):
        return e.status, e.err_type, e.param
    if isinstance(e, (RequestError, SamplingParamsError)):
        return 400, "invalid_request_error", e.param
    if isinstance(e, EngineDeadError):
        return 503, "server_error", None
    return 500, "server_error", None


class OpenAIServer:
    """Routes and request handling around one AsyncEngine.

    Args:
        engine: a started AsyncEngine.
        served_model_name: the only model name requests may use (unknown names get 404).
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>`` (401).
        chat_template: a Jinja chat template used instead of the tokenizer's.
        max_request_body_bytes: larger bodies (after any Content-Encoding is undone) get HTTP 413.
        max_stop_sequences: the most entries ``stop`` and ``stop_token_ids`` may each hold (400).
        trust_request_chat_template: accept a ``chat_template`` in the request (vLLM's flag of that
            name; off by default: a template is a program, and one with nested loops would hold the
            event loop, and with it every stream and the engine, for as long as it runs).
        log_requests: log one INFO line per finished request (off: ``--disable-log-requests``).
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: Optional[str] = None,
                 chat_template: Optional[str] = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES,
                 trust_request_chat_template: bool = False, log_requests: bool = True):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.chat_template = chat_template
        self.max_request_body_bytes = max_request_body_bytes
        self.max_stop_sequences = max_stop_sequences
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = engine.tokenizer
        self.tokens = TokenStrings(engine.tokenizer)
        self.max_prompt_chars = _max_prompt_chars(engine.tokenizer, engine.max_model_len)
        self.metrics = Metrics(engine, served_model_name, log_requests=log_requests)
        engine.metrics = self.metrics
        self._warned_fields: set[str] = set()

    def build_app(self) -> web.Application:
        """The aiohttp application. Serve it with ``auto_decompress=False`` (an ``AppRunner`` /
        ``TestServer`` keyword, as :func:`serve` does): request bodies' Content-Encoding is undone
        here, by :meth:`_read`; left to aiohttp it would be undone twice."""
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_request_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's (SageMaker's) liveness route
        app.router.add_post("/ping", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics.handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                return _error("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                              code="invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.reason or "error", e.status, "invalid_request_error" if e.status < 500 else "server_error")
            raise
        except (asyncio.CancelledError, ConnectionError):
            raise
        except (ProtocolError, RequestError, SamplingParamsError, EngineDeadError) as e:
            status, err_type, param = _classify(e)
            resp = _error(_message(e), status, err_type, param, getattr(e, "code", None))
            resp.headers.update(getattr(e, "headers", None) or {})
            return resp
        except Exception as e:  # a bug: answer in the API's shape and keep serving
            logger.exception("error handling %s", request.path)
            return _error(_message(e), 500, "server_error")

    # --- simple routes ------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "zpp",
                "root": self.engine.config.model.model, "parent": None, "max_model_len": self.engine.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return _json(self._model_card())

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine runs, also while a lost stage restarts (requests then wait; the
        body is ``{"status": "recovering"}``, else ``{"status": "ok"}``); 503 once the engine is
        dead (the server then exits)."""
        if not self.engine.is_healthy:
            return web.Response(status=503, text=f"engine dead: {self.engine.dead}")
        return _json({"status": "recovering" if self.engine.stats().recovering else "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": zpp.__version__})

    # --- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------
    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ProtocolError(f"this model has no tokenizer, so {what} is unavailable")

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": str}`` or ``{"messages": [...], ...}`` -> ``{"count", "max_model_len",
        "tokens", "token_strs"}``: the token ids ``/v1/completions`` or ``/v1/chat/completions``
        would run (``token_strs`` with ``return_token_strs: true``)."""
        req: TokenizeRequest = await self._read(request, TokenizeRequest)
        self._check_model(req.model)
        self._need_tokenizer("/tokenize")
        if req.prompt is not None and req.messages is not None:
            raise ProtocolError("give either prompt or messages, not both", "messages")
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=bool(req.add_special_tokens), chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs)
            ids = await _off_loop_if_large(self._chat_prompt, chat, _text_size(req.messages) + 100 * len(req.messages))
        elif req.prompt is not None:
            self._check_prompt_chars(req.prompt, "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await _off_loop_if_large(lambda p: self.tokenizer.encode(p, add_special_tokens=special),
                                           req.prompt, len(req.prompt))
        else:
            raise ProtocolError("prompt (a string) or messages is required", "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                      "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids outside the vocabulary get 400."""
        req: DetokenizeRequest = await self._read(request, DetokenizeRequest)
        self._check_model(req.model)
        self._need_tokenizer("/detokenize")
        bad = [t for t in req.tokens if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ProtocolError(f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})",
                                "tokens")
        text = await _off_loop_if_large(self.tokenizer.decode, req.tokens, len(req.tokens))
        return _json({"prompt": text})

    # --- helpers ------------------------------------------------------------------------------
    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise ProtocolError(f"the model {name!r} does not exist (this server serves {self.model_name!r})",
                                "model", 404, "invalid_request_error", "model_not_found")

    async def _read(self, request: web.Request, kind):
        """The request body, its ``Content-Encoding`` undone, decoded into ``kind``.

        Raises ProtocolError: 415 for a Content-Encoding other than identity, gzip, deflate (told
        before reading); 413 past --max-request-body-bytes (told from Content-Length before
        reading when it is sent; a chunked body is cut off as soon as it passes the limit, a
        compressed one as soon as its decoded bytes do); 400 for a body that cannot be read or
        decoded, or is not a valid request.
        """
        limit = self.max_request_body_bytes
        codings = content_codings(request.headers.getall(hdrs.CONTENT_ENCODING, ()))
        if request.content_length is not None and request.content_length > limit:
            raise body_too_large(limit)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise body_too_large(limit) from None
        except web.RequestPayloadError as e:  # the body arrived malformed (HTTP framing): the client's fault
            raise ProtocolError(f"the request body could not be read: {e}") from None
        if codings:
            body = undo_content_encoding(body, codings, limit)
        try:
            req = decode_request(body, kind)
        except ProtocolError as e:
            self._warn_unknown_fields(request.path, e.unknown_fields)
            raise
        self._check_stop_limits(req)
        return req

    def _warn_unknown_fields(self, path: str, names) -> None:
        """Log a warning the first time each unknown request field name is seen (as vLLM logs
        ignored fields; here the request still gets its 400). At most MAX_WARNED_FIELDS names."""
        for name in names:
            if name in self._warned_fields or len(self._warned_fields) >= MAX_WARNED_FIELDS:
                continue
            self._warned_fields.add(name)
            logger.warning("%s: unrecognized request field %r: refused with HTTP 400 (logged once per field "
                           "name)", path, name)

    def _check_stop_limits(self, req) -> None:
        for name in ("stop", "stop_token_ids"):
            value = getattr(req, name, None)
            if isinstance(value, list) and len(value) > self.max_stop_sequences:
                raise ProtocolError(f"{name} has {len(value)} entries; this server accepts at most "
                                    f"{self.max_stop_sequences} (--max-stop-sequences)", name)

    def _check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit in max_model_len tokens whatever it
        says: tokenizing megabytes would take seconds for a certain 400."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ProtocolError(f"the prompt has {len(text)} characters: more than max_model_len "
                                f"({self.engine.max_model_len}) tokens of this tokenizer can hold", param)

    def _check_stop_token_ids(self, sampling: SamplingParams) -> None:
        bad = [t for t in sampling.stop_token_ids or () if t >= self.engine.vocab_size]
        if bad:
            raise ProtocolError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})",
                                "stop_token_ids")

    async def _compile_grammar(self, sampling: SamplingParams, param: Optional[str]) -> None:
        """Compile a structured-output request's grammar before anything is sent (cached for the
        engine's own call). Raises ProtocolError naming ``param``, the field the constraint came
        from (``response_format``, ``structured_outputs``, ``guided_json``, ``tools``, ...)."""
        try:
            await self.engine.compile_grammar(sampling)
        except RequestError as e:
            raise ProtocolError(f"{param}: {e}", param) from None

    async def _run_all(self, prompts: list[list[int]], sampling: SamplingParams, base_id: str,
                       stream: bool = True) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt concurrently; yield (prompt index, cumulative output) as they progress
        (with ``stream=False`` only each prompt's final output).

        Use under ``contextlib.aclosing``: closing the generator (the handler was cancelled, the
        client went away, an error) cancels the per-prompt tasks, which aborts their requests.
        Raises whatever a request raised (EngineDeadError, RequestError).
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, ids: list[int]) -> None:
            try:
                async for out in self.engine.generate(ids, sampling, f"{base_id}-{i}", stream=stream):
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # forwarded to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(prompts)]
        done = 0
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    done += 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- /v1/completions ----------------------------------------------------------------------
    def _tokenize_prompts(self, prompt) -> list[tuple[Optional[str], list[int]]]:
        """OpenAI's four prompt forms -> [(text or None, token ids)]. Raises ProtocolError."""
        prompts = _normalize_prompt(prompt)
        for p in prompts:
            if isinstance(p, str):
                self._check_prompt_chars(p, "prompt")
        try:
            return [self.engine.tokenize_prompt(p) for p in prompts]
        except RequestError as e:
            raise ProtocolError(str(e), e.param) from None

    def _completion_logprobs(self, k: int, pairs: list[tuple[int, Optional[dict[int, Logprob]]]],
                             offset: int) -> dict:
        """OpenAI's completions ``logprobs`` object for (token id, {id: Logprob} or None) pairs;
        ``text_offset`` counts characters from ``offset``."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in pairs:
            s = self.tokens.text(tid)
            tokens.append(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_logprob_of(lp, tid))
                top = dict((self.tokens.text(t), v) for t, v in _top(lp, k))
                top.setdefault(s, _logprob_of(lp, tid))  # the chosen token is always listed, as in vLLM
                tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def completions(self, request: web.Request):
        req: CompletionRequest = await self._read(request, CompletionRequest)
        self._check_model(req.model)
        if req.suffix is not None:
            raise ProtocolError("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ProtocolError("best_of is not supported (only best_of == n)", "best_of")
        so, so_param = structured_outputs_of(req)
        prompts = await _off_loop_if_large(self._tokenize_prompts, req.prompt, _text_size(req.prompt))
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        sampling = to_sampling_params(req, max_tokens, req.logprobs, structured_outputs=so)
        want_prompt_lps = req.echo and req.logprobs is not None
        # echo + logprobs + max_tokens 0 scores the prompt: run one step for its logprobs and
        # drop the sampled token.
        prompt_only = want_prompt_lps and max_tokens == 0
        if want_prompt_lps:
            sampling = sampling.clone(prompt_logprobs=max(req.logprobs, sampling.prompt_logprobs or 0),
                                      max_tokens=1 if prompt_only else max_tokens)
        self._check_stop_token_ids(sampling)
        for _, ids in prompts:
            self.engine.validate(ids, sampling)
        await self._compile_grammar(sampling, so_param)
        cid, created, n = new_id("cmpl"), now(), sampling.n
        k = req.logprobs

        def shown(c: CompletionOutput) -> CompletionOutput:
            if not prompt_only:
                return c
            return CompletionOutput(index=c.index, text="", token_ids=[], logprobs=[] if k is not None else None,
                                    finish_reason="length" if c.finish_reason else None)

        def echo_text(i: int) -> str:
            text, ids = prompts[i]
            if text is not None:
                return text
            return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

        def prompt_pairs(i: int, o: RequestOutput) -> list:
            lps = o.prompt_logprobs or [None] * len(prompts[i][1])
            return list(zip(prompts[i][1], lps))

        def gen_pairs(c: CompletionOutput, t0: int = 0) -> list:
            return list(zip(c.token_ids[t0:], (c.logprobs or [])[t0:] + [None] * len(c.token_ids)))

        if not req.stream:
            finals: dict[int, RequestOutput] = {}
            async with aclosing(self._run_all([ids for _, ids in prompts], sampling, cid, stream=False)) as outs:
                async for i, out in outs:
                    if out.finished:
                        finals[i] = out
            choices = []
            for i in range(len(prompts)):
                o = finals[i]
                head = echo_text(i) if req.echo else ""
                for c in map(shown, o.outputs):
                    lp = None
                    if k is not None:
                        pairs = (prompt_pairs(i, o) if req.echo else []) + gen_pairs(c)
                        lp = self._completion_logprobs(k, pairs, 0)
                    choice = {"index": i * n + c.index, "text": head + c.text, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self._prompt_logprobs(prompts[i][1], o.prompt_logprobs)
                    choices.append(choice)
            return _json({"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                          "choices": choices, "usage": _usage(prompts, [map(shown, finals[i].outputs)
                                                                        for i in finals])})

        sse = _SSE(request)
        sent_text: dict[tuple[int, int], int] = {}   # characters of generated text sent
        sent_tok: dict[tuple[int, int], int] = {}    # generated tokens whose logprobs were sent
        base: dict[tuple[int, int], int] = {}        # length of the echoed prompt text
        finished: set[tuple[int, int]] = set()
        completion_tokens = 0

        continuous = bool(req.stream_options and req.stream_options.include_usage
                          and req.stream_options.continuous_usage_stats)
        prompt_total = sum(len(ids) for _, ids in prompts)

        def chunk(index: int, text: str, lp, finish_reason=None, stop_reason=None) -> dict:
            body = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                                 "stop_reason": stop_reason}]}
            if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                body["usage"] = _usage_counts(prompt_total, sum(sent_tok.values()))
            return body

        try:
            async with aclosing(self._run_all([ids for _, ids in prompts], sampling, cid)) as outs:
                async for i, out in outs:
                    for c in map(shown, out.outputs):
                        key = (i, c.index)
                        if key in finished or (not c.token_ids and c.finish_reason is None):
                            continue  # nothing new for this choice (or its prompt logprobs are not complete)
                        if key not in base:
                            base[key] = 0
                            if req.echo:
                                head = echo_text(i)
                                base[key] = len(head)
                                lp = self._completion_logprobs(k, prompt_pairs(i, out), 0) if k is not None else None
                                await sse.send(chunk(i * n + c.index, head, lp))
                        start, t0 = sent_text.get(key, 0), sent_tok.get(key, 0)
                        delta = c.text[start:]
                        lp = None
                        if k is not None:
                            lp = self._completion_logprobs(k, gen_pairs(c, t0), base[key] + start)
                        if not delta and c.finish_reason is None and not (lp and lp["tokens"]):
                            continue
                        sent_text[key], sent_tok[key] = len(c.text), len(c.token_ids)
                        if c.finish_reason is not None:
                            finished.add(key)
                            completion_tokens += len(c.token_ids)
                        await sse.send(chunk(i * n + c.index, delta, lp, c.finish_reason, c.stop_reason))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to tell it
        except Exception as e:
            return await sse.fail(e)
        if req.stream_options and req.stream_options.include_usage:
            await sse.send({"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage_counts(prompt_total, completion_tokens)})
        return await sse.done()

    # --- /v1/chat/completions -----------------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest, plan: Optional[ToolPlan] = None) -> list[int]:
        """Render the messages with the chat template and tokenize without adding special tokens
        (unless the request sets ``add_special_tokens``): the template writes any BOS itself, so
        there is never a second one. With tools (``plan``, unless ``tool_choice`` is ``"none"``)
        the template gets ``tools=``; a template that ignores them gets a system text describing
        them instead. Raises ProtocolError."""
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so chat is unavailable; use /v1/completions "
                                "with token ids", "messages")
        if not req.messages:
            raise ProtocolError("messages must be a non-empty list", "messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise ProtocolError("cannot set both continue_final_message and add_generation_prompt to true "
                                "(set add_generation_prompt: false to continue the last message)",
                                "continue_final_message")
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise ProtocolError("a chat_template in the request is refused: this server uses its own "
                                "(start it with --trust-request-chat-template to allow request templates)",
                                "chat_template")
        template = req.chat_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ProtocolError("this model has no chat template, so /v1/chat/completions cannot format "
                                "messages; start the server with --chat-template FILE or use /v1/completions",
                                "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            if m.role not in _CHAT_ROLES:
                raise ProtocolError(f"messages[{i}].role {m.role!r} is not one of {', '.join(_CHAT_ROLES)}",
                                    "messages")
            content = m.content
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ProtocolError(f"messages[{i}].content: only text parts are supported", "messages")
                    parts.append(p["text"])
                content = "".join(parts)
            elif content is None and m.role != "assistant":
                raise ProtocolError(f"messages[{i}].content is required for role {m.role!r}", "messages")
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls is not None:
                msg["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            msgs.append(msg)

        def render(msgs, **extra):
            return self.tokenizer.apply_chat_template(
                msgs, chat_template=template, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **extra, **(req.chat_template_kwargs or {}))

        try:
            text = render(msgs)
            if plan is not None and plan.mode != "none":
                with_tools = render(msgs, tools=plan.tools)
                if with_tools != text:
                    text = with_tools
                else:  # the template ignores tools: describe them in the system message
                    if msgs[0]["role"] == "system":
                        msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + plan.system_text()}
                    else:
                        msgs.insert(0, {"role": "system", "content": plan.system_text()})
                    text = render(msgs)
        except Exception as e:  # template errors are the request's fault (e.g. role order)
            raise ProtocolError(f"the chat template failed on these messages: {e}", "messages") from None
        if not isinstance(text, str):  # chat_template_kwargs such as return_dict / tokenize
            raise ProtocolError("chat_template_kwargs must not change what the template returns",
                                "chat_template_kwargs")
        self._check_prompt_chars(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    async def _send_tool_deltas(self, sse: _SSE, chunk, c: CompletionOutput, ts: ToolStream, logprobs: bool,
                                k: int, sent_tok: dict[int, int]) -> None:
        """Stream one choice of a request with tools: content and ``tool_calls`` deltas from its
        ToolStream, logprobs on the first delta of each step, the finish reason (``"tool_calls"``
        when calls were sent and the output ended normally) on the last."""
        final = c.finish_reason is not None
        deltas = ts.feed(c.text, final)
        t0 = sent_tok.get(c.index, 0)
        new_ids = c.token_ids[t0:]
        lp = self._chat_logprobs(k, new_ids, (c.logprobs or [])[t0:]) if logprobs and new_ids else None
        if lp is not None and not deltas:
            deltas = [{}]
        sent_tok[c.index] = len(c.token_ids)
        for i, d in enumerate(deltas):
            await sse.send(chunk([{"index": c.index, "delta": d, "logprobs": lp if i == 0 else None,
                                   "finish_reason": None}]))
        if final:
            reason = "tool_calls" if ts.calls and c.finish_reason == "stop" else c.finish_reason
            await sse.send(chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason,
                                   "stop_reason": c.stop_reason}]))

    def _prompt_logprobs(self, ids: list[int], lps) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
        ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the prompt token first, then the top-k;
        ``rank`` 1-based in the distribution at that position)."""
        out = []
        for j in range(len(ids)):
            lp = lps[j] if lps and j < len(lps) else None
            out.append(None if lp is None else
                       {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.tokens.text(t)}
                        for t, e in lp.items()})
        return out

    def _chat_logprobs(self, k: int, token_ids: list[int], lps) -> dict:
        content = []
        for tid, lp in zip(token_ids, lps or []):
            top = [{"token": self.tokens.text(t), "logprob": v, "bytes": self.tokens.bytes(t)}
                   for t, v in _top(lp, k)] if lp else []
            content.append({"token": self.tokens.text(tid), "logprob": _logprob_of(lp, tid),
                            "bytes": self.tokens.bytes(tid), "top_logprobs": top})
        return {"content": content}

    async def chat_completions(self, request: web.Request):
        req: ChatCompletionRequest = await self._read(request, ChatCompletionRequest)
        self._check_model(req.model)
        check_unsupported_chat_fields(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        use_mct = req.max_completion_tokens is not None
        plan = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        so, so_param = structured_outputs_of(req)
        tool_so = plan.structured_outputs() if plan is not None else None
        if tool_so is not None:
            if so is not None:
                raise ProtocolError(f"tool_choice {plan.mode!r} constrains the output, so {so_param} cannot "
                                    "be given too", "tool_choice")
            so, so_param = tool_so, "tools"
        sampling = to_sampling_params(req, req.max_completion_tokens if use_mct else req.max_tokens,
                                      (req.top_logprobs or 0) if req.logprobs else None,
                                      rename={"max_tokens": "max_completion_tokens" if use_mct else "max_tokens",
                                              "logprobs": "top_logprobs"}, structured_outputs=so)
        self._check_stop_token_ids(sampling)
        prompt_ids = await _off_loop_if_large(lambda r: self._chat_prompt(r, plan), req,
                                              _text_size(req.messages) + 100 * len(req.messages))
        try:
            self.engine.validate(prompt_ids, sampling)
        except RequestError as e:
            raise ProtocolError(str(e), "max_completion_tokens" if use_mct and e.param == "max_tokens"
                                else e.param) from None
        await self._compile_grammar(sampling, so_param)
        cid, created, k = new_id("chatcmpl"), now(), req.top_logprobs or 0
        if plan is not None and plan.mode == "none":
            plan = None

        def message(c: CompletionOutput) -> tuple[dict, Optional[str]]:
            if plan is None:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            content, calls = parse_output(plan, c.text)
            if not calls:
                return {"role": "assistant", "content": content}, c.finish_reason
            return ({"role": "assistant", "content": content, "tool_calls": calls},
                    "tool_calls" if c.finish_reason == "stop" else c.finish_reason)

        if not req.stream:
            final = None
            async with aclosing(self._run_all([prompt_ids], sampling, cid, stream=False)) as outs:
                async for _, out in outs:
                    final = out
            choices = []
            for c in final.outputs:
                msg, finish = message(c)
                choices.append({"index": c.index, "message": msg,
                                "logprobs": self._chat_logprobs(k, c.token_ids, c.logprobs) if req.logprobs else None,
                                "finish_reason": finish, "stop_reason": c.stop_reason})
            body = {"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                    "choices": choices, "usage": _usage([(None, prompt_ids)], [final.outputs])}
            if req.prompt_logprobs is not None:
                body["prompt_logprobs"] = self._prompt_logprobs(prompt_ids, final.prompt_logprobs)
            return _json(body)

        sse = _SSE(request)
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        finished: set[int] = set()
        completion_tokens = 0
        tool_streams = {j: ToolStream(plan) for j in range(sampling.n)} if plan is not None else {}

        continuous = bool(req.stream_options and req.stream_options.include_usage
                          and req.stream_options.continuous_usage_stats)

        def chunk(choices: list) -> dict:
            body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}
            if continuous and choices:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                body["usage"] = _usage_counts(len(prompt_ids), sum(sent_tok.values()))
            return body

        try:
            async with aclosing(self._run_all([prompt_ids], sampling, cid)) as outs:
                async for _, out in outs:
                    if not sse.started:  # the first chunk of every choice carries the role
                        for j in range(sampling.n):
                            await sse.send(chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]))
                    for c in out.outputs:
                        if c.index in finished:
                            continue
                        if tool_streams:
                            await self._send_tool_deltas(sse, chunk, c, tool_streams[c.index], req.logprobs,
                                                         k, sent_tok)
                            if c.finish_reason is not None:
                                finished.add(c.index)
                                completion_tokens += len(c.token_ids)
                            continue
                        start, t0 = sent_text.get(c.index, 0), sent_tok.get(c.index, 0)
                        delta, new_ids = c.text[start:], c.token_ids[t0:]
                        if not delta and c.finish_reason is None and not (req.logprobs and new_ids):
                            continue
                        sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                        choice = {"index": c.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": self._chat_logprobs(k, new_ids, (c.logprobs or [])[t0:])
                                  if req.logprobs and new_ids else None,
                                  "finish_reason": c.finish_reason}
                        if c.finish_reason is not None:
                            finished.add(c.index)
                            completion_tokens += len(c.token_ids)
                            choice["stop_reason"] = c.stop_reason
                        await sse.send(chunk([choice]))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to tell it
        except Exception as e:
            return await sse.fail(e)
        if req.stream_options and req.stream_options.include_usage:
            await sse.send({**chunk([]), "usage": _usage_counts(len(prompt_ids), completion_tokens)})
        return await sse.done()


def _usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_LARGE_TEXT = 100_000  # characters; tokenizing more than this runs in a thread, off the event loop


def _text_size(obj) -> int:
    """Rough number of characters in a prompt or message list."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(_text_size(x) for x in obj)
    content = getattr(obj, "content", None)
    return _text_size(content) if content is not None else 0


async def _off_loop_if_large(fn, arg, size: int):
    """Run ``fn(arg)`` in a worker thread when the text is large, so one huge prompt does not stall
    every other client while it is tokenized."""
    if size < _LARGE_TEXT:
        return fn(arg)
    return await asyncio.get_running_loop().run_in_executor(None, fn, arg)


def _max_prompt_chars(tokenizer, max_model_len: int) -> Optional[int]:
    """Characters above which a text cannot fit in ``max_model_len`` tokens: no token covers more
    characters than its longest vocabulary entry is long (a byte-level BPE entry has one character
    per byte, a SentencePiece one one per character), so a text needs at least
    ``len(text) / longest`` tokens. Doubled, for normalizers that shorten text. None without a
    tokenizer."""
    if tokenizer is None:
        return None
    try:
        pieces = list(tokenizer.get_vocab())
        pieces += [str(getattr(t, "content", t)) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        longest = max(map(len, pieces))
    except Exception:  # an unusual tokenizer: no shortcut, tokenize everything
        return None
    return 2 * max_model_len * max(longest, 1)


def _normalize_prompt(prompt) -> list:
    """OpenAI's four prompt forms -> a list of prompts (str or token-id list). Raises ProtocolError."""
    if prompt is None:
        raise ProtocolError("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ProtocolError("prompt must not be an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        if any(len(p) == 0 for p in prompt):
            raise ProtocolError("prompt token lists must not be empty", "prompt")
        return list(prompt)
    raise ProtocolError("prompt must be a string, a list of strings, a list of token ids or a list of those", "prompt")


def _usage(prompts: list[tuple[Optional[str], list[int]]], outputs) -> dict:
    """OpenAI's usage: each prompt counted once (whatever ``n``), every generated token counted."""
    prompt = sum(len(ids) for _, ids in prompts)
    completion = sum(len(c.token_ids) for outs in outputs for c in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def load_chat_template(path: Optional[str]) -> Optional[str]:
    """The text of a ``--chat-template`` file (None -> None). Raises ConfigError if unreadable."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--chat-template {path!r}: {e.strerror or e}") from None


# --- running the server ---------------------------------------------------------------------------
async def serve(config, host: str, port: int, api_key: Optional[str] = None,
                chat_template: Optional[str] = None,
                log_stats_interval: Optional[float] = DEFAULT_LOG_STATS_INTERVAL_S, api_server_count: int = 1,
                **server_options) -> int:
    """Start the engine core and the HTTP front end(s); run until SIGINT/SIGTERM or engine death.

    ``chat_template`` is a file path (read before any worker starts); ``log_stats_interval`` the
    seconds between stats log lines while busy (None: no stats lines, ``--disable-log-stats``);
    ``api_server_count`` the number of front-end processes sharing ``port`` (SO_REUSEPORT) and one
    engine core (vLLM's ``--api-server-count``; this process is the first); ``server_options`` go
    to :class:`OpenAIServer` (request limits, ``trust_request_chat_template``, ``log_requests``).

    On the first SIGINT/SIGTERM, requests in progress are ended at once (streams get an error event
    and ``[DONE]``, others HTTP 503) and the server stops within seconds; a second signal stops it
    immediately. During start-up (the core and workers starting, weights loading) the first
    SIGINT/SIGTERM aborts it: the core and every worker started so far are stopped, one line
    (``zpp: start-up interrupted (SIGINT); ...``) goes to stderr, and then SIGINT returns 130 while
    SIGTERM ends the process by its default action (as an unhandled SIGTERM did before); a second
    signal exits at once (the kernel then kills the core, and the core's death its workers:
    ``PR_SET_PDEATHSIG``).

    Returns the process exit status: 0 after a signal, 1 if the engine (or a front end) died,
    130 after SIGINT during start-up.
    Raises:
        ConfigError: the chat template file cannot be read, or the engine configuration is bad.
        WorkerDiedError: a worker or the engine core failed to start.
    """
    template = load_chat_template(chat_template)
    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()
    signalled: list[int] = []

    def on_signal_during_start_up(sig: int) -> None:
        if signalled:
            os._exit(128 + signalled[0])
        signalled.append(sig)
        starting.cancel()

    # Until _run_front_end installs its own handlers. Without these, SIGTERM killed this process
    # outright (leaving the core and workers to PR_SET_PDEATHSIG) and SIGINT left it waiting, at
    # exit, for a core that went on loading.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal_during_start_up, sig)
    extra: list = []
    try:
        engine = await AsyncEngine.start(config, in_process=False)  # cancelled: core and workers stopped
        freeze_gc()
        try:
            if api_server_count > 1:
                extra = _start_front_ends(config, engine.client.address, api_server_count, host, port, api_key,
                                          template, server_options)
            return await _run_front_end(engine, config, host, port, api_key, template, log_stats_interval,
                                        extra, reuse_port=api_server_count > 1, **server_options)
        finally:
            for p in extra:
                if p.is_alive():
                    p.terminate()
            for p in extra:
                p.join(10)
                if p.is_alive():
                    p.kill()
    except asyncio.CancelledError:
        if not signalled:
            raise
        sig = signalled[0]
        print(f"zpp: start-up interrupted ({signal.Signals(sig).name}); everything it started is stopped",
              file=sys.stderr, flush=True)
        if sig == signal.SIGTERM:  # end by the signal, as before: service managers read that as a clean stop
            loop.remove_signal_handler(sig)
            os.kill(os.getpid(), sig)
        return 128 + sig


async def _run_front_end(engine: AsyncEngine, config, host: str, port: int, api_key: Optional[str],
                         template: Optional[str], log_stats_interval: Optional[float], extra_front_ends=(),
                         reuse_port: bool = False, owner: bool = True, **server_options) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    lost: list[str] = []

    def on_signal() -> None:
        if stop.is_set() and owner:  # a second signal: stop the workers and leave now
            logger.warning("second signal: exiting now")
            for p in extra_front_ends:
                p.kill()
            engine.kill()
            os._exit(1)
        stop.set()

    for sig in ((signal.SIGINT, signal.SIGTERM) if owner else (signal.SIGTERM,)):
        loop.add_signal_handler(sig, on_signal)
    if not owner:  # the first front end decides when to stop (a terminal's Ctrl-C reaches us all)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    for p in extra_front_ends:
        def gone(p=p):
            loop.remove_reader(p.sentinel)
            lost.append(f"front end {p.name} exited (exit code {p.exitcode})")
            stop.set()
        loop.add_reader(p.sentinel, gone)
    server = OpenAIServer(engine, config.model.name, api_key, template, **server_options)
    # auto_decompress off: OpenAIServer._read undoes Content-Encoding itself, so that an unknown or
    # unsupported coding and a corrupt body get answers in OpenAI's shape (aiohttp's parser
    # answered br / zstd with plain text before any handler ran, took unknown codings for identity
    # and failed corrupt bodies as a payload error).
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           auto_decompress=False)
    status = 0
    stats_task = None
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None, backlog=4096)  # 1000 clients at once
        await site.start()
        if owner:
            logger.info("serving %s on http://%s:%d (pipeline-parallel-size %d, tensor-parallel-size %d, "
                        "%d API server process(es))", config.model.name, host, port,
                        config.parallel.pipeline_parallel_size, config.parallel.tensor_parallel_size,
                        1 + len(extra_front_ends))
            print(f"zpp: serving {config.model.name} on http://{host}:{port}", flush=True)
            if log_stats_interval:
                stats = StatsLogger(engine, server.metrics, log_stats_interval, config.cache.enable_prefix_caching)
                stats_task = asyncio.create_task(stats.run())
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass
            if engine.dead:
                logger.error("engine died: %s; exiting", engine.dead)
                await asyncio.sleep(1.0)  # let clients see the errors / 503 before we go
                status = 1
                break
        if lost:
            logger.error("%s; stopping", lost[0])
            status = 1
    finally:
        if owner:
            logger.info("shutting down")
        if stats_task is not None:
            stats_task.cancel()
        engine.abort_all()
        await asyncio.sleep(0.1)  # let the handlers write their error events
        await runner.cleanup()
        await engine.shutdown()
    return status


def _start_front_ends(config, core_address: str, count: int, host: str, port: int, api_key: Optional[str],
                      template: Optional[str], server_options: dict) -> list:
    """Spawn front ends 1..count-1 (each: aiohttp on ``port`` with SO_REUSEPORT, joined to the core)."""
    import json
    import multiprocessing as mp

    import msgspec

    ctx = mp.get_context("spawn")
    level = logging.getLogger("zpp").getEffectiveLevel()
    args = json.dumps({"host": host, "port": port, "api_key": api_key, "template": template,
                       "options": server_options, "level": level})
    procs = []
    with main_module_hidden(), sigint_blocked():  # the first front end decides when to stop
        for i in range(1, count):
            p = ctx.Process(target=_front_end_main, name=f"zpp-api-server-{i}", daemon=True,
                            args=(msgspec.msgpack.encode(config), core_address, i, args))
            p.start()
            procs.append(p)
    return procs


def _front_end_main(config_bytes: bytes, core_address: str, index: int, args_json: str) -> None:
    """Entry point of an extra front-end process (``--api-server-count`` > 1)."""
    import json

    import msgspec

    from zpp.config import EngineConfig
    watch_parent()
    a = json.loads(args_json)
    logging.basicConfig(level=a["level"], format=f"%(asctime)s %(levelname)s [api {index}] %(name)s: %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)

    async def main() -> int:
        engine = await AsyncEngine.start(config, in_process=False, core_address=core_address, front_end_index=index)
        freeze_gc()
        return await _run_front_end(engine, config, a["host"], a["port"], a["api_key"], a["template"], None,
                                    reuse_port=True, owner=False, **a["options"])
    sys.exit(asyncio.run(main()))
