"""What every endpoint shares: the engine and the server's limits, reading a request body,
the model-name check, and running a request's prompts concurrently.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator, Optional, Sequence, Union
from urllib.parse import quote

from aiohttp import web

from zpp.errors import RequestError
from zpp.frontend.async_engine import AsyncEngine
from zpp.frontend.inputs import PreparedRequest
from zpp.outputs import RequestOutput
from zpp.server.config import ServerConfig
from zpp.server.http_body import read_request
from zpp.server.protocol import MAX_REQUEST_ID, valid_request_id
from zpp.server.render import TokenStrings
from zpp.settings import parse_names

logger = logging.getLogger("zpp.server.app")

# The server settings' defaults, written once in ServerConfig (the flags' table).
DEFAULT_MAX_REQUEST_BODY_BYTES = ServerConfig.max_request_body_bytes  # --max-request-body-bytes
DEFAULT_MAX_STOP_SEQUENCES = ServerConfig.max_stop_sequences  # --max-stop-sequences
DEFAULT_MAX_LOGPROBS = ServerConfig.max_logprobs  # --max-logprobs (vLLM's default)
DEFAULT_TIMEOUT_REQUEST_BODY_S = ServerConfig.timeout_request_body  # --timeout-request-body
MAX_WARNED_FIELDS = 256  # distinct unknown field names logged; later new names are not


REQUEST_ID_HEADER = "X-Request-Id"
_RUN_ID = "zpp.request_id"  # key of the id a request ran under, in the aiohttp request's mapping
_ID_PARAM = "zpp.request_id_param"  # ... and of where the client gave it (request_id or X-Request-Id)


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp ``on_response_prepare`` hook: every response (streams and errors too) carries
    ``X-Request-Id``: the request's own header echoed, else the id the request ran under
    (:meth:`ServingContext.request_id`), else a fresh 32-hex-digit one (as vLLM's
    ``--enable-request-id-headers``)."""
    response.headers[REQUEST_ID_HEADER] = (request.headers.get(REQUEST_ID_HEADER) or request.get(_RUN_ID)
                                           or uuid.uuid4().hex)


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_IGNORED = "zpp.ignored_fields"  # key of a request's ignored unknown fields, in the aiohttp request's mapping


async def ignored_fields_header(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp ``on_response_prepare`` hook: a response to a request whose body had unknown
    top-level fields (ignored) carries ``X-Ignored-Fields: a, b`` (each name percent-encoded where
    it has characters other than letters, digits and ``_.-~``; streams and errors too)."""
    names = request.get(_IGNORED)
    if names:
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(quote(n, safe="") for n in names)


class ServingContext:
    """The state the endpoints share (one per front-end process; see :class:`~zpp.server.app.OpenAIServer`
    for the arguments)."""

    def __init__(self, engine: AsyncEngine, served_model_name: Union[str, Sequence[str]],
                 chat_template: Optional[str] = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES, trust_request_chat_template: bool = False,
                 response_role: str = "assistant", max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 timeout_request_body: float = DEFAULT_TIMEOUT_REQUEST_BODY_S,
                 generation_defaults: Optional[dict] = None, parsers=None):
        self.engine = engine
        self.model_names = parse_names(served_model_name, "served_model_name")
        """Every name requests may use (``--served-model-name a b``)."""
        self.model_name = self.model_names[0]
        """The name responses carry: the first."""
        self.chat_template = chat_template
        self.max_request_body_bytes = max_request_body_bytes
        self.max_stop_sequences = max_stop_sequences
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = engine.tokenizer
        self.tokens = TokenStrings(engine.tokenizer)
        self._warned_fields: set[str] = set()
        self.response_role = response_role
        self.max_logprobs = max_logprobs
        self.timeout_request_body = timeout_request_body
        self.generation_defaults = generation_defaults or {}
        if parsers is None:
            from zpp.parsers.chat import ChatParsers
            parsers = ChatParsers(None, None, engine.tokenizer)
        self.parsers = parsers

    @staticmethod
    def request_id(request: web.Request, body_id: Optional[str], use_header: bool = True) -> str:
        """The id a request runs under (its response's id is ``<prefix>-<id>``): ``body_id`` (the
        body's ``request_id``), else the ``X-Request-Id`` header (``use_header``), else a fresh 32
        hex digits. It is the response's ``X-Request-Id`` when the client sent none.

        Raises:
            RequestError: a header taken as the id that is not 1 to 256 printable ASCII characters
                (param ``X-Request-Id``).
        """
        rid = body_id
        if rid is None:
            header = request.headers.get(REQUEST_ID_HEADER) if use_header else None
            if header:
                if not valid_request_id(header):
                    raise RequestError(f"the {REQUEST_ID_HEADER} header is the request's id when the body has "
                                       f"no request_id: 1 to {MAX_REQUEST_ID} printable ASCII characters",
                                       REQUEST_ID_HEADER)
                rid = header
                request[_ID_PARAM] = REQUEST_ID_HEADER
            else:
                rid = uuid.uuid4().hex
        else:
            request[_ID_PARAM] = "request_id"
        request[_RUN_ID] = rid
        return rid

    @staticmethod
    def client_id(request: web.Request) -> Optional[tuple[str, str]]:
        """(the id, the field that gave it: ``request_id`` or ``X-Request-Id``) when the client named
        the request (:meth:`request_id`), else None."""
        param = request.get(_ID_PARAM)
        return (request[_RUN_ID], param) if param else None

    def check_logprobs(self, sampling, param: str) -> None:
        """Raises RequestError naming ``param`` (or ``prompt_logprobs``) past --max-logprobs."""
        for value, name in ((sampling.logprobs, param), (sampling.prompt_logprobs, "prompt_logprobs")):
            if value is not None and value > self.max_logprobs:
                raise RequestError(f"{name} {value} is more than this server allows ({self.max_logprobs}; "
                                   f"--max-logprobs)", name)

    def check_model(self, name: Optional[str]) -> None:
        """Raises RequestError (404, ``model_not_found``) for a model name this server does not serve."""
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise RequestError(f"the model {name!r} does not exist (this server serves {served})",
                               "model", 404, "invalid_request_error", "model_not_found")

    def chat_template_for(self, requested: Optional[str]) -> Optional[str]:
        """The chat template a request renders with: its own (only with --trust-request-chat-template;
        else RequestError), the server's --chat-template, or None (the tokenizer's)."""
        if requested is not None and not self.trust_request_chat_template:
            raise RequestError("a chat_template in the request is refused: this server uses its own "
                               "(start it with --trust-request-chat-template to allow request templates)",
                               "chat_template")
        return requested or self.chat_template

    async def read(self, request: web.Request, kind):
        """The request body decoded into ``kind`` (see :func:`~zpp.server.http_body.read_request`),
        with ``stop`` / ``stop_token_ids`` within --max-stop-sequences. Unknown top-level fields
        are ignored, as vLLM does: a warning names them (:meth:`_warn_unknown_fields`) and the
        response's ``X-Ignored-Fields`` header lists them (:func:`ignored_fields_header`).
        Raises RequestError."""
        req, unknown = await read_request(request, kind, self.max_request_body_bytes, self.timeout_request_body)
        if unknown:
            request[_IGNORED] = unknown
            self._warn_unknown_fields(request.path, unknown)
        for name in ("stop", "stop_token_ids"):
            value = getattr(req, name, None)
            if isinstance(value, list) and len(value) > self.max_stop_sequences:
                raise RequestError(f"{name} has {len(value)} entries; this server accepts at most "
                                   f"{self.max_stop_sequences} (--max-stop-sequences)", name)
        return req

    def _warn_unknown_fields(self, path: str, names) -> None:
        """One warning line naming a request's ignored unknown fields (vLLM logs the fields it
        ignores), when one of them is new: a client that sends the same field with every request
        is reported once, not per request. At most MAX_WARNED_FIELDS names are remembered."""
        new = [n for n in names if n not in self._warned_fields]
        if not new or len(self._warned_fields) >= MAX_WARNED_FIELDS:
            return
        self._warned_fields.update(new[:MAX_WARNED_FIELDS - len(self._warned_fields)])
        logger.warning("%s: ignored unknown request field%s %s (as vLLM does; each name is logged once)", path,
                       "s" if len(names) > 1 else "", ", ".join(repr(n) for n in names))

    async def run_all(self, prepared: list[PreparedRequest], base_id: str, stream: bool = True,
                      client_id: Optional[tuple[str, str]] = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run every prepared prompt concurrently; yield (prompt index, output) as they progress
        (with ``stream=False`` only each prompt's final output); outputs are cumulative.
        ``client_id``: :meth:`client_id`, so that an id already in use is refused in the client's
        words (its id and the field it came in), not the engine's per-prompt id.

        Use under ``contextlib.aclosing``: closing the generator (the handler was cancelled, the
        client went away, an error) cancels the per-prompt tasks, which aborts their requests.
        Raises whatever a request raised (EngineDeadError, RequestError).
        """
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, req: PreparedRequest) -> None:
            try:
                async for out in self.engine.generate(req, request_id=f"{base_id}-{i}", stream=stream):
                    queue.put_nowait((i, out))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # forwarded to the consumer
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(one(i, req)) for i, req in enumerate(prepared)]
        done = 0
        try:
            while done < len(tasks):
                i, item = await queue.get()
                if isinstance(item, RequestError) and item.param == "request_id" and client_id is not None:
                    raise RequestError(f"request id {client_id[0]!r} is already in use by a request in progress",
                                       client_id[1]) from item
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    done += 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
