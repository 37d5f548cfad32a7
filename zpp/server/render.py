"""The bytes of responses: JSON bodies, OpenAI's error shape (and which exception gets which
status), token strings and bytes, the logprobs objects of both endpoints, usage, and the
server-sent-events writer of streams.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from zpp.errors import EngineBusyError, EngineDeadError, EngineShutdownError, RequestError
from zpp.outputs import Logprob

logger = logging.getLogger(__name__)


# --- JSON and errors ------------------------------------------------------------------------------
def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data, ensure_ascii=False), status=status, content_type="application/json")


def error_body(message: str, err_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(message: str, status: int = 400, err_type: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> web.Response:
    return json_response(error_body(message, err_type, param, code), status)


def error_message(e: BaseException) -> str:
    if isinstance(e, (EngineShutdownError, EngineBusyError)):
        return str(e)
    if isinstance(e, EngineDeadError):
        return f"the engine is dead: {e}"
    if isinstance(e, RequestError):
        return str(e)
    return f"internal error: {type(e).__name__}: {e}"


def classify(e: BaseException) -> tuple[int, str, Optional[str]]:
    """(HTTP status, OpenAI error type, param) for an exception raised while serving."""
    if isinstance(e, RequestError):
        return e.status, e.err_type, e.param
    if isinstance(e, EngineDeadError):
        return 503, "server_error", None
    return 500, "server_error", None


def new_id(prefix: str, request_id: Optional[str] = None) -> str:
    """A response id: ``<prefix>-<request_id>`` (a client's ``request_id`` field or
    ``X-Request-Id`` header, or a fresh 32 hex digits: see ``ServingContext.request_id``), else a
    fresh one, e.g. ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# --- tokens and logprobs --------------------------------------------------------------------------
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

    # --- the logprobs objects -------------------------------------------------------------------
    def completion_logprobs(self, k: int, pairs: list[tuple[int, Optional[dict[int, Logprob]]]],
                            offset: int) -> dict:
        """OpenAI's completions ``logprobs`` object for (token id, {id: Logprob} or None) pairs;
        ``text_offset`` counts characters from ``offset``."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lp in pairs:
            s = self.text(tid)
            tokens.append(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_logprob_of(lp, tid))
                top = dict((self.text(t), v) for t, v in _top(lp, k))
                top.setdefault(s, _logprob_of(lp, tid))  # the chosen token is always listed, as in vLLM
                tops.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, k: int, token_ids: list[int], lps) -> dict:
        """OpenAI's chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes",
        "top_logprobs"}]}`` for the ``k`` most likely tokens at each position."""
        content = []
        for tid, lp in zip(token_ids, lps or []):
            top = [{"token": self.text(t), "logprob": v, "bytes": self.bytes(t)}
                   for t, v in _top(lp, k)] if lp else []
            content.append({"token": self.text(tid), "logprob": _logprob_of(lp, tid),
                            "bytes": self.bytes(tid), "top_logprobs": top})
        return {"content": content}

    def prompt_logprobs(self, ids: list[int], lps) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
        ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the prompt token first, then the top-k;
        ``rank`` 1-based in the distribution at that position)."""
        out = []
        for j in range(len(ids)):
            lp = lps[j] if lps and j < len(lps) else None
            out.append(None if lp is None else
                       {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.text(t)}
                        for t, e in lp.items()})
        return out


def _top(lp: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely (token id, logprob) pairs of one position, most likely first."""
    return [(t, e.logprob) for t, e in sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:k]]


def _logprob_of(lp: Optional[dict[int, Logprob]], token_id: int) -> Optional[float]:
    """``token_id``'s logprob at a position (None when the position or the token has none)."""
    e = lp.get(token_id) if lp else None
    return e.logprob if e is not None else None


# --- usage ----------------------------------------------------------------------------------------
def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(prompt_ids: list[list[int]], outputs) -> dict:
    """OpenAI's usage: each prompt counted once (whatever ``n``), every generated token counted."""
    return usage_counts(sum(len(ids) for ids in prompt_ids),
                        sum(len(c.token_ids) for outs in outputs for c in outs))


# --- server-sent events ---------------------------------------------------------------------------
class SSEWriter:
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
        status, err_type, param = classify(e)
        await self.send(error_body(error_message(e), err_type, param) | {"status_code": status})
        return await self.done()

    async def done(self) -> web.StreamResponse:
        resp = await self._start()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
