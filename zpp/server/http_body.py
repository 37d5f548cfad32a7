"""HTTP request bodies: ``Content-Encoding`` undone within the size limit, JSON decoded into the
request structs of :mod:`zpp.server.protocol` with every error a 4xx in OpenAI's shape.
"""
from __future__ import annotations

import asyncio

import re
import zlib

import msgspec
from aiohttp import hdrs, web

from zpp.errors import RequestError as ProtocolError
from zpp.server.protocol import _dec_hook


async def read_request(request: web.Request, kind: type, limit: int, timeout: float = 30.0):
    """``(request, unknown)``: the request body, its ``Content-Encoding`` undone, decoded into
    ``kind``, and the top-level fields ``kind`` does not know, which were ignored (vLLM's
    behaviour; see :func:`decode_request`).

    Raises ProtocolError: 415 for a Content-Encoding other than identity, gzip, deflate (told
    before reading); 413 past ``limit`` bytes (--max-request-body-bytes; told from Content-Length
    before reading when it is sent; a chunked body is cut off as soon as it passes the limit, a
    compressed one as soon as its decoded bytes do); 400 for a body that cannot be read or
    decoded, or is not a valid request (an unknown key inside a known object: named by its path,
    ``stream_options.foo``); 408 when no byte of the body arrives for ``timeout`` seconds (--timeout-request-body: a client
    that promised a body and stopped sending it; the connection is then closed).
    """
    codings = content_codings(request.headers.getall(hdrs.CONTENT_ENCODING, ()))
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    try:
        body = await _read_body(request, limit, timeout)
    except web.RequestPayloadError as e:  # the body arrived malformed (HTTP framing): the client's fault
        raise ProtocolError(f"the request body could not be read: {e}") from None
    if codings:
        body = undo_content_encoding(body, codings, limit)
    req = decode_request(body, kind)
    return req, unknown_fields(body, kind)


async def _read_body(request: web.Request, limit: int, timeout: float) -> bytes:
    """The raw body; 413 past ``limit`` bytes, 408 when no byte arrives for ``timeout`` seconds."""
    chunks, size = [], 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"the request body stopped arriving (no byte for {timeout:g} s, {size} bytes read)",
                                status=408, code="request_timeout") from None
        except ConnectionError:
            # The client went away mid-body: aiohttp cancels this handler (handler_cancellation), but
            # wait_for hands on the read's ConnectionResetError instead of the CancelledError, which
            # aiohttp would log as an error with a traceback. Nobody is left to answer.
            raise asyncio.CancelledError() from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)


# --- Content-Encoding of request bodies -----------------------------------------------------------
CONTENT_CODINGS = ("gzip", "deflate")
"""The request-body codings the server undoes (besides ``identity``); ``x-gzip`` is gzip (RFC 9110)."""
MAX_CONTENT_CODINGS = 4
"""Most codings one ``Content-Encoding`` may stack (each is undone in turn)."""


def body_too_large(limit: int) -> ProtocolError:
    """The 413 for a body over ``limit`` bytes (``--max-request-body-bytes``), decoded or not."""
    return ProtocolError(f"the request body is larger than this server accepts ({limit} bytes; "
                         "see --max-request-body-bytes)", None, 413)


def content_codings(values) -> list[str]:
    """The codings named by a request's ``Content-Encoding`` header values, in the order they were
    applied (``identity`` and empty entries dropped, names lower-cased, ``x-gzip`` -> ``gzip``).

    Raises:
        ProtocolError: HTTP 415 for a coding this server cannot undo (``br``, ``zstd``, ``compress``,
            an unknown name: never taken for identity) or more than MAX_CONTENT_CODINGS of them;
            the message lists the supported ones, the ``Accept-Encoding`` header too (RFC 7694).
    """
    codings = []
    for value in values:
        for name in value.split(","):
            name = name.strip().lower()
            if name and name != "identity":
                codings.append("gzip" if name == "x-gzip" else name)
    unsupported = [c for c in codings if c not in CONTENT_CODINGS]
    if unsupported or len(codings) > MAX_CONTENT_CODINGS:
        msg = (f"Content-Encoding {unsupported[0][:40]!r} is not supported: this server accepts request "
               "bodies in identity, gzip or deflate encoding" if unsupported else
               f"Content-Encoding stacks {len(codings)} codings: this server undoes at most "
               f"{MAX_CONTENT_CODINGS} (each gzip or deflate)")
        raise ProtocolError(msg, None, 415, headers={"Accept-Encoding": "gzip, deflate"})
    return codings


def undo_content_encoding(body: bytes, codings: list[str], limit: int) -> bytes:
    """``body`` with its ``codings`` (from :func:`content_codings`) undone, last applied first.

    gzip may hold several members (RFC 1952); deflate is a zlib stream (RFC 1950) or, as some
    clients send it, raw deflate. Decoding stops as soon as the output passes ``limit`` bytes.
    An empty body stays empty.

    Raises:
        ProtocolError: HTTP 413 past ``limit``; HTTP 400 when the body is not valid data of its
            coding (corrupt, truncated, or followed by other bytes).
    """
    for coding in reversed(codings):
        body = _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    out: list[bytes] = []
    size = 0

    def bad(why: str) -> ProtocolError:
        return ProtocolError(f"the request body could not be decoded as {coding} (its Content-Encoding): {why}")

    while data:
        if coding == "gzip":
            wbits = 16 + zlib.MAX_WBITS
        else:  # a zlib header has compression method 8 in its low nibble; else raw deflate
            wbits = zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS
        d = zlib.decompressobj(wbits)
        pending = data
        try:
            while not d.eof:
                piece = d.decompress(pending, limit - size + 1)
                size += len(piece)
                if size > limit:
                    raise body_too_large(limit)
                out.append(piece)
                pending = d.unconsumed_tail
                if not pending and not piece:
                    break
        except zlib.error as e:
            raise bad(str(e)) from None
        if not d.eof:
            raise bad("the data ends early (truncated)")
        data = d.unused_data
        if data and coding == "deflate":
            raise bad(f"{len(data)} bytes follow the end of the compressed data")
        # gzip: what follows must be another member (else its header check fails above)
    return b"".join(out)


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")
_UNKNOWN_RE = re.compile(r"^Object contains unknown field `(.*)`$", re.DOTALL)
_NESTED_RE = re.compile(r"^(.*)` - at `\$\.([^`]*)$", re.DOTALL)  # what _UNKNOWN_RE took inside a field
_MISSING_RE = re.compile(r"^Object missing required field `([A-Za-z_]+)`$")  # top level only
MAX_FIELD_NAME = 100  # characters of an unknown field's name kept in messages and logs


_KNOWN: dict[type, frozenset] = {}
MAX_UNKNOWN_FIELDS = 32  # unknown top-level field names reported per request (logs, header)
_TopLevel = dict[str, msgspec.Raw]  # a body's top-level keys, their values left undecoded


def unknown_fields(body: bytes, kind: type) -> tuple[str, ...]:
    """The top-level keys of the JSON object ``body`` that the request struct ``kind`` does not
    know, in their order, each cut to MAX_FIELD_NAME characters, at most MAX_UNKNOWN_FIELDS of
    them (call after :func:`decode_request` accepted ``body``). The values are not decoded again
    (``msgspec.Raw``), so a large body costs one more scan, not one more parse."""
    known = _KNOWN.get(kind)
    if known is None:
        known = _KNOWN[kind] = frozenset(f.encode_name for f in msgspec.structs.fields(kind))
    try:
        keys = msgspec.json.decode(body, type=_TopLevel)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ()
    out = [k[:MAX_FIELD_NAME] for k in keys if k not in known]
    return tuple(out[:MAX_UNKNOWN_FIELDS])


def decode_request(body: bytes, kind: type):
    """Parse and type-check a JSON body into ``kind`` (a request struct of this module).

    Unknown top-level fields are ignored (as vLLM does: clients send OpenAI's newer fields by
    default; :func:`unknown_fields` names them for the warning and the response header).

    Raises:
        ProtocolError: the body is not JSON, not an object, or a field has the wrong type or is
            out of range (``param`` names the top-level field); an unknown key inside a known
            object (``param`` its path, ``stream_options.foo``).
    """
    try:
        req = msgspec.json.decode(body, type=kind, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        unknown = _UNKNOWN_RE.search(str(e))
        if unknown:  # inside a known object (the top level ignores unknown fields): named by its path
            nested = _NESTED_RE.match(unknown.group(1))
            name = (f"{nested.group(2)}.{nested.group(1)}" if nested else unknown.group(1))[:MAX_FIELD_NAME]
            raise ProtocolError(f"unrecognized request argument supplied: {name!r}", name) from None
        missing = _MISSING_RE.search(str(e))
        if missing:
            raise ProtocolError(f"invalid request: {e}", missing.group(1)) from None
        m = _PATH_RE.search(str(e))
        raise ProtocolError(f"invalid request: {e}", m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("the body is nested too deeply") from None
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise ProtocolError("stream_options is only allowed with stream: true", "stream_options")
    return req
