"""OpenAI-compatible HTTP server on aiohttp: /v1/completions, /v1/chat/completions, /v1/models,
/health, /version, /metrics.

Bad requests get HTTP 4xx in OpenAI's error shape and never reach the engine; a client that goes
away aborts its request (aiohttp cancels the handler, the engine frees the request's blocks).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any, AsyncIterator, Optional

from aiohttp import web

import zpp
from zpp.engine.async_engine import AsyncEngine, EngineDeadError, RequestError
from zpp.outputs import RequestOutput
from zpp.sampling_params import SamplingParamsError
from zpp.server.protocol import (ChatCompletionRequest, CompletionRequest, ProtocolError, decode_request,
                                 error_body, new_id, now, to_sampling_params)

logger = logging.getLogger(__name__)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, ensure_ascii=False), status=status, content_type="application/json")


def _error(message: str, status: int = 400, err_type: str = "invalid_request_error",
           param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return _json(error_body(message, err_type, param, code), status)


class OpenAIServer:
    """Routes and request handling around one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: Optional[str] = None,
                 chat_template: Optional[str] = None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self._tok_cache: dict[int, str] = {}
        from zpp.server.metrics import Metrics
        self.metrics = Metrics(engine)
        engine.metrics = self.metrics

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics.handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.api_key and request.path.startswith("/v1/"):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return _error("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                              "authentication_error", code="invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.reason or "error", e.status, "invalid_request_error" if e.status < 500 else "server_error")
            raise
        except ProtocolError as e:
            return _error(str(e), e.status, e.err_type, e.param, e.code)
        except SamplingParamsError as e:
            return _error(str(e), 400, param=e.param)
        except RequestError as e:
            return _error(str(e), 400, param=e.param)
        except EngineDeadError as e:
            return _error(f"the engine is dead: {e}", 503, "server_error")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: answer in the API's shape and keep serving
            logger.exception("error handling %s", request.path)
            return _error(f"internal error: {type(e).__name__}: {e}", 500, "server_error")

    # --- simple routes ------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": now(), "owned_by": "zpp",
            "root": self.engine.config.model.model, "parent": None,
            "max_model_len": self.engine.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_healthy:
            return web.Response(status=503, text=f"engine dead: {self.engine.dead}")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": zpp.__version__})

    # --- helpers ------------------------------------------------------------------------------
    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise ProtocolError(f"the model {name!r} does not exist (this server serves {self.model_name!r})",
                                "model", 404, "not_found_error", "model_not_found")

    def _token_str(self, tid: int) -> str:
        s = self._tok_cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else str(tid)
            self._tok_cache[tid] = s
        return s

    async def _read(self, request: web.Request, kind):
        body = await request.read()
        return decode_request(body, kind)

    def _validate_all(self, prompts, sampling) -> None:
        for p in prompts:
            _, ids = self.engine.tokenize_prompt(p)
            self.engine.validate(ids, sampling)

    async def _run_all(self, prompts, sampling, base_id) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prompt concurrently; yield (prompt index, cumulative output) as they progress."""
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i, p):
            try:
                async for out in self.engine.generate(p, sampling, f"{base_id}-{i}"):
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
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
    async def completions(self, request: web.Request):
        req: CompletionRequest = await self._read(request, CompletionRequest)
        self._check_model(req.model)
        if req.suffix is not None:
            raise ProtocolError("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise ProtocolError("best_of is not supported (only best_of == n)", "best_of")
        prompts = _normalize_prompt(req.prompt)
        sampling = to_sampling_params(req, req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            sampling = sampling.clone(prompt_logprobs=max(req.logprobs, sampling.prompt_logprobs or 0))
        self._validate_all(prompts, sampling)
        cid, created = new_id("cmpl"), now()
        n = sampling.n

        def choice_logprobs(out, prompt_ids, prompt_lps, text_offset0: int) -> Optional[dict]:
            if req.logprobs is None:
                return None
            tokens, token_lps, tops, offsets = [], [], [], []
            off = text_offset0
            pairs = []
            if req.echo:
                pairs += [(t, prompt_lps[j] if prompt_lps else None) for j, t in enumerate(prompt_ids)]
            pairs += list(zip(out.token_ids, out.logprobs or [None] * len(out.token_ids)))
            for tid, lp in pairs:
                s = self._token_str(tid)
                tokens.append(s)
                token_lps.append(lp.get(tid) if lp else None)
                tops.append({self._token_str(t): v for t, v in list(lp.items())[: max(req.logprobs, 1) + 1]}
                            if lp else None)
                offsets.append(off)
                off += len(s)
            return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

        def prompt_text(o: RequestOutput) -> str:
            if o.prompt is not None:
                return o.prompt
            return self.tokenizer.decode(o.prompt_token_ids) if self.tokenizer is not None else ""

        if not req.stream:
            finals: dict[int, RequestOutput] = {}
            async for i, out in self._run_all(prompts, sampling, cid):
                if out.finished:
                    finals[i] = out
            choices = []
            for i in range(len(prompts)):
                o = finals[i]
                for c in o.outputs:
                    echo = prompt_text(o) if req.echo else ""
                    choices.append({"index": i * n + c.index, "text": echo + c.text,
                                    "logprobs": choice_logprobs(c, o.prompt_token_ids, o.prompt_logprobs, 0),
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            usage = _usage(finals.values())
            return _json({"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                          "choices": choices, "usage": usage})

        resp = await _sse_response(request)
        sent_text: dict[tuple[int, int], int] = {}
        sent_tok: dict[tuple[int, int], int] = {}
        finals = {}
        async for i, out in self._run_all(prompts, sampling, cid):
            for c in out.outputs:
                key = (i, c.index)
                start = sent_text.get(key)
                if start is None and req.echo:
                    await _sse(resp, {"id": cid, "object": "text_completion", "created": created,
                                      "model": self.model_name, "choices": [{
                                          "index": i * n + c.index, "text": prompt_text(out),
                                          "logprobs": None, "finish_reason": None}]})
                start = start or 0
                delta = c.text[start:]
                t0 = sent_tok.get(key, 0)
                new_ids = c.token_ids[t0:]
                if not delta and not c.finish_reason and not (req.logprobs is not None and new_ids):
                    continue
                lp = None
                if req.logprobs is not None:
                    part = type(c)(index=c.index, token_ids=new_ids,
                                   logprobs=(c.logprobs or [])[t0:] if c.logprobs is not None else None)
                    lp = choice_logprobs(part, [], None, start)
                sent_text[key] = len(c.text)
                sent_tok[key] = len(c.token_ids)
                await _sse(resp, {"id": cid, "object": "text_completion", "created": created,
                                  "model": self.model_name, "choices": [{
                                      "index": i * n + c.index, "text": delta, "logprobs": lp,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if out.finished:
                finals[i] = out
        if req.stream_options and req.stream_options.include_usage:
            await _sse(resp, {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                              "choices": [], "usage": _usage(finals.values())})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # --- /v1/chat/completions -----------------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer, so chat is unavailable; use /v1/completions with token ids")
        if not req.messages:
            raise ProtocolError("messages must be a non-empty list", "messages")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ProtocolError("this model has no chat template; start the server with --chat-template FILE "
                                "or use /v1/completions", "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise ProtocolError(f"messages[{i}].role {m.role!r} is not one of system, user, assistant, tool",
                                    "messages")
            content = m.content
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ProtocolError(f"messages[{i}].content: only text parts are supported", "messages")
                    parts.append(p["text"])
                content = "".join(parts)
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            text = self.tokenizer.apply_chat_template(
                msgs, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as e:  # template errors are the request's fault (e.g. role order)
            raise ProtocolError(f"the chat template failed on these messages: {e}", "messages") from None
        # The template already holds any BOS; encoding must not add another.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def chat_completions(self, request: web.Request):
        req: ChatCompletionRequest = await self._read(request, ChatCompletionRequest)
        self._check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sampling = to_sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        prompt_ids = self._chat_prompt(req)
        self._validate_all([prompt_ids], sampling)
        cid, created = new_id("chatcmpl"), now()

        def lp_content(token_ids, lps) -> Optional[dict]:
            if not req.logprobs:
                return None
            content = []
            for tid, lp in zip(token_ids, lps or []):
                s = self._token_str(tid)
                top = [{"token": self._token_str(t), "logprob": v, "bytes": list(self._token_str(t).encode())}
                       for t, v in list(lp.items())[1:][: req.top_logprobs or 0]] if lp else []
                if lp and req.top_logprobs:
                    # top_logprobs are the k most likely tokens; the chosen one may be among them.
                    ranked = sorted(lp.items(), key=lambda kv: -kv[1])[: req.top_logprobs]
                    top = [{"token": self._token_str(t), "logprob": v, "bytes": list(self._token_str(t).encode())}
                           for t, v in ranked]
                content.append({"token": s, "logprob": lp.get(tid) if lp else None,
                                "bytes": list(s.encode()), "top_logprobs": top})
            return {"content": content}

        if not req.stream:
            final = None
            async for _, out in self._run_all([prompt_ids], sampling, cid):
                final = out
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp_content(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason} for c in final.outputs]
            return _json({"id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                          "choices": choices, "usage": _usage([final])})

        resp = await _sse_response(request)
        sent_text: dict[int, int] = {}
        sent_tok: dict[int, int] = {}
        finish_sent: set[int] = set()
        final = None

        def chunk(choices):
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": choices}

        for j in range(sampling.n):
            await _sse(resp, chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        async for _, out in self._run_all([prompt_ids], sampling, cid):
            final = out
            for c in out.outputs:
                start, t0 = sent_text.get(c.index, 0), sent_tok.get(c.index, 0)
                delta = c.text[start:]
                new_ids = c.token_ids[t0:]
                if delta or (req.logprobs and new_ids):
                    sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                    await _sse(resp, chunk([{"index": c.index, "delta": {"content": delta},
                                             "logprobs": lp_content(new_ids, (c.logprobs or [])[t0:]),
                                             "finish_reason": None}]))
                if c.finish_reason is not None and c.index not in finish_sent:
                    finish_sent.add(c.index)
                    await _sse(resp, chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]))
        if req.stream_options and req.stream_options.include_usage:
            await _sse(resp, {**chunk([]), "usage": _usage([final])})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


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


def _usage(outputs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _sse(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n")


# --- running the server ---------------------------------------------------------------------------
async def serve(config, host: str, port: int, api_key: Optional[str] = None,
                chat_template: Optional[str] = None) -> int:
    """Start the engine and the HTTP server; run until SIGINT/SIGTERM or engine death.

    Returns the process exit status: 0 after a signal, 1 if the engine died.
    """
    engine = await AsyncEngine.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    template = None
    if chat_template:
        with open(chat_template) as f:
            template = f.read()
    server = OpenAIServer(engine, config.model.name, api_key, template)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    status = 0
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        logger.info("serving %s on http://%s:%d (pipeline-parallel-size %d)", config.model.name, host, port,
                    config.parallel.pipeline_parallel_size)
        print(f"zpp: serving {config.model.name} on http://{host}:{port}", flush=True)
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
    finally:
        logger.info("shutting down")
        await runner.cleanup()
        await engine.shutdown()
    return status
