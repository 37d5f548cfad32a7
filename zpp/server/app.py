"""OpenAI-compatible HTTP server on aiohttp: the routes and the error mapping.

Routes: /v1/completions (:mod:`.completions`), /v1/chat/completions (:mod:`.chat`), /v1/models,
/health, /ping, /version, /metrics (:mod:`.metrics`), and vLLM's /tokenize and /detokenize.
Process start-up and shutdown are in :mod:`.launch`.

Every response carries ``X-Request-Id`` (:func:`~zpp.server.endpoint.request_id_header`). Bad
requests get HTTP 4xx in OpenAI's error shape and never reach the engine. A client that goes
away aborts its requests: the runner is built with ``handler_cancellation=True``, so aiohttp
cancels the handler task, which closes the engine streams (``AsyncEngine.generate`` aborts an
unfinished request in its ``finally``) and the engine frees the request's KV blocks once no
micro-batch in flight still writes them.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from typing import Optional, Sequence, Union

from aiohttp import web

import zpp
from zpp.errors import ConfigError, EngineDeadError, RequestError
from zpp.frontend.async_engine import AsyncEngine
from zpp.frontend.inputs import off_loop_if_large, text_size
from zpp.server.chat import chat_completions, chat_options
from zpp.server.completions import completions
from zpp.server.endpoint import (DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_STOP_SEQUENCES,
                                 DEFAULT_TIMEOUT_REQUEST_BODY_S, ServingContext, ignored_fields_header, request_id_header)
from zpp.server.metrics import Metrics
from zpp.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from zpp.server.render import classify, error_message, error_response, json_response, now
from zpp.server.tools import parse_tools

logger = logging.getLogger(__name__)


class OpenAIServer:
    """Routes and request handling around one AsyncEngine.

    Args:
        engine: a started AsyncEngine.
        served_model_name: the model's name, or several (a sequence): requests may use any of them
            (unknown names get 404), responses and metrics carry the first, ``/v1/models`` lists all.
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>`` (401).
        chat_template: a Jinja chat template used instead of the tokenizer's.
        max_request_body_bytes: larger bodies (after any Content-Encoding is undone) get HTTP 413.
        max_stop_sequences: the most entries ``stop`` and ``stop_token_ids`` may each hold (400).
        trust_request_chat_template: accept a ``chat_template`` in the request (vLLM's flag of that
            name; off by default: a template is a program, and one with nested loops would hold the
            event loop, and with it every stream and the engine, for as long as it runs).
        log_requests: log one INFO line per finished request (off: ``--disable-log-requests``).
        root_path: a path prefix (``/llm``, no trailing slash) under which every route answers as
            well (``--root-path``: a proxy that forwards ``/llm/v1/...`` unchanged; one that strips
            the prefix reaches the plain routes).
        response_role: the ``role`` of chat completion messages and first stream deltas.
        max_logprobs: most ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` (more: 400); at most
            20, SamplingParams' own limit, which answers first above it.
        timeout_request_body: seconds a request body may go without a byte arriving; then HTTP 408
            and the connection is closed.
        generation_defaults: sampling defaults for fields a request leaves out (the model's
            generation config, :func:`zpp.generation_config.generation_defaults`).
        tool_call_parser, reasoning_parser: ``--tool-call-parser`` / ``--reasoning-parser`` names
            (see :class:`zpp.parsers.chat.ChatParsers`).

    Raises:
        ConfigError: an unknown parser name.
    """

    def __init__(self, engine: AsyncEngine, served_model_name: Union[str, Sequence[str]], api_key: Optional[str] = None,
                 chat_template: Optional[str] = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES,
                 trust_request_chat_template: bool = False, log_requests: bool = True,
                 root_path: str = "", response_role: str = "assistant", max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 timeout_request_body: float = DEFAULT_TIMEOUT_REQUEST_BODY_S,
                 generation_defaults: Optional[dict] = None, tool_call_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None):
        from zpp.parsers.chat import ChatParsers
        try:
            parsers = ChatParsers(tool_call_parser, reasoning_parser, engine.tokenizer)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.engine = engine
        self.root_path = root_path.rstrip("/")
        self.draining = False
        """Set on the first SIGTERM / SIGINT with --shutdown-timeout: new requests get 503."""
        self.in_flight = 0
        """Requests being handled (streams until their last event)."""
        self.api_key = api_key
        self.max_request_body_bytes = max_request_body_bytes
        self.ctx = ServingContext(engine, served_model_name, chat_template, max_request_body_bytes,
                                  max_stop_sequences, trust_request_chat_template, response_role, max_logprobs,
                                  timeout_request_body, generation_defaults, parsers)
        self.tokenizer = engine.tokenizer
        self.model_names = self.ctx.model_names
        self.model_name = self.ctx.model_name
        self.metrics = Metrics(engine, self.model_name, log_requests=log_requests)
        engine.metrics = self.metrics

    def build_app(self) -> web.Application:
        """The aiohttp application. Serve it with ``auto_decompress=False`` (an ``AppRunner`` /
        ``TestServer`` keyword, as :func:`zpp.server.launch.serve` does): request bodies'
        Content-Encoding is undone by :func:`zpp.server.http_body.read_request`; left to aiohttp it
        would be undone twice."""
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_request_body_bytes)
        app.on_response_prepare.append(request_id_header)
        app.on_response_prepare.append(ignored_fields_header)
        app.router.add_post("/v1/completions", functools.partial(completions, self.ctx))
        app.router.add_post("/v1/chat/completions", functools.partial(chat_completions, self.ctx))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's (SageMaker's) liveness route
        app.router.add_post("/ping", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics.handler)
        from zpp.server.openapi import openapi_handler
        from zpp.server.responses import ResponsesAPI
        app.router.add_post("/v1/responses", ResponsesAPI(self.ctx).create)
        app.router.add_get("/openapi.json", openapi_handler(self.api_key))
        if self.root_path:  # every route under the prefix too
            for route in list(app.router.routes()):
                app.router.add_route(route.method, self.root_path + route.resource.canonical, route.handler)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if self.draining:
            resp = error_response("the server is shutting down", 503, "server_error")
            resp.force_close()
            return resp
        self.in_flight += 1
        try:
            resp = await self._handle(request, handler)
        finally:
            self.in_flight -= 1
        if getattr(resp, "close_connection", False):  # 408: write it, then close (no lingering read)
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:
                request.transport.close()
        return resp

    async def _handle(self, request: web.Request, handler):
        path = request.path
        if self.root_path and path.startswith(self.root_path + "/"):
            path = path[len(self.root_path):]
        if self.api_key and path.startswith("/v1/"):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                return error_response("invalid or missing API key (send 'Authorization: Bearer <key>')", 401,
                                      code="invalid_api_key")
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400:
                return error_response(e.reason or "error", e.status,
                                      "invalid_request_error" if e.status < 500 else "server_error")
            raise
        except (asyncio.CancelledError, ConnectionError):
            raise
        except (RequestError, EngineDeadError) as e:
            status, err_type, param = classify(e)
            resp = error_response(error_message(e), status, err_type, param, getattr(e, "code", None))
            resp.headers.update(getattr(e, "headers", None) or {})
            resp.close_connection = status == 408
            return resp
        except Exception as e:  # a bug: answer in the API's shape and keep serving
            logger.exception("error handling %s", request.path)
            return error_response(error_message(e), 500, "server_error")

    # --- simple routes ------------------------------------------------------------------------
    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": now(), "owned_by": "zpp",
                "root": self.engine.config.model.model, "parent": None, "max_model_len": self.engine.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card(name) for name in self.model_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        self.ctx.check_model(name)
        return json_response(self._model_card(name))

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine runs, also while a lost stage restarts (requests then wait; the
        body is ``{"status": "recovering"}``, else ``{"status": "ok"}``); 503 once the engine is
        dead (the server then exits)."""
        if not self.engine.is_healthy:
            return web.Response(status=503, text=f"engine dead: {self.engine.dead}")
        return json_response({"status": "recovering" if self.engine.stats().recovering else "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": zpp.__version__})

    # --- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------
    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise RequestError(f"this model has no tokenizer, so {what} is unavailable")

    async def tokenize(self, request: web.Request) -> web.Response:
        """``{"prompt": str}`` or ``{"messages": [...], ...}`` -> ``{"count", "max_model_len",
        "tokens", "token_strs"}``: the token ids ``/v1/completions`` or ``/v1/chat/completions``
        would run (``token_strs`` with ``return_token_strs: true``), rendered and tokenized as they
        do (:class:`~zpp.frontend.inputs.InputProcessor`)."""
        req: TokenizeRequest = await self.ctx.read(request, TokenizeRequest)
        self.ctx.check_model(req.model)
        self._need_tokenizer("/tokenize")
        inputs = self.engine.inputs
        if req.prompt is not None and req.messages is not None:
            raise RequestError("give either prompt or messages, not both", "messages")
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=bool(req.add_special_tokens), chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
            opts = chat_options(self.ctx, chat, parse_tools(req.tools, None, None))
            _, ids = await off_loop_if_large(inputs.tokenize_chat, req.messages, opts,
                                              size=text_size(req.messages) + 100 * len(req.messages))
        elif req.prompt is not None:
            inputs.check_prompt_chars(req.prompt, "prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await off_loop_if_large(lambda p: self.tokenizer.encode(p, add_special_tokens=special),
                                           req.prompt, size=len(req.prompt))
        else:
            raise RequestError("prompt (a string) or messages is required", "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                              "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids outside the vocabulary get 400."""
        req: DetokenizeRequest = await self.ctx.read(request, DetokenizeRequest)
        self.ctx.check_model(req.model)
        self._need_tokenizer("/detokenize")
        self.engine.inputs.check_token_ids(req.tokens, "tokens")
        text = await off_loop_if_large(self.tokenizer.decode, req.tokens, size=len(req.tokens))
        return json_response({"prompt": text})
