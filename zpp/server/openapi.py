"""``GET /openapi.json``: an OpenAPI 3.1 description of the server, generated from its routes and
its request types (the msgspec structs of the request bodies, turned into JSON Schema by
``msgspec.json.schema_components``), so that it cannot drift from what the server accepts."""
from __future__ import annotations

import json
from typing import Any, Optional

import msgspec
from aiohttp import web

import zpp
from zpp.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                 _WholeInt)
from zpp.server.responses_protocol import ResponsesRequest

REQUEST_TYPES: dict[str, type] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""The JSON body type of each route that takes one (POST)."""

_SUMMARIES = {
    "/v1/completions": "OpenAI completions",
    "/v1/chat/completions": "OpenAI chat completions",
    "/v1/responses": "OpenAI Responses API (stateless: store false)",
    "/v1/models": "the served model",
    "/v1/models/{model}": "one model",
    "/health": "200 while the engine runs, 503 once it is dead",
    "/ping": "liveness (as /health)",
    "/tokenize": "token ids of a prompt or of chat messages (vLLM's)",
    "/detokenize": "text of token ids (vLLM's)",
    "/version": "the zpp version",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "this document",
}


def _schema_hook(kind: type) -> dict:
    if isinstance(kind, type) and issubclass(kind, _WholeInt):  # protocol.whole_int's bounded integers
        return {"type": "integer", "minimum": kind.ge, "maximum": kind.le}
    raise NotImplementedError(kind)


def openapi_document(app: web.Application, api_key: Optional[str] = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes (HEAD routes left out): each POST route of
    :data:`REQUEST_TYPES` with its body's JSON Schema under ``components.schemas``; with
    ``api_key`` set, the ``/v1/`` routes need a bearer token (``security``)."""
    names = sorted(REQUEST_TYPES)
    refs, schemas = msgspec.json.schema_components([REQUEST_TYPES[n] for n in names], schema_hook=_schema_hook,
                                                   ref_template="#/components/schemas/{name}")
    body_ref = dict(zip(names, refs))
    error = {"description": "an error, in OpenAI's shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}
    paths: dict[str, dict] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = route.resource.canonical
        op: dict[str, Any] = {"summary": _SUMMARIES.get(path, path), "responses": {"200": {"description": "OK"}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        if route.method == "POST" and path in body_ref:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_ref[path]}}}
            op["responses"] |= {"400": error, "413": error}
        if api_key and path.startswith("/v1/"):
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = error
        paths.setdefault(path, {})[route.method.lower()] = op
    components: dict[str, Any] = {"schemas": schemas}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0", "info": {"title": "zpp", "version": zpp.__version__,
                                         "description": "zpp's OpenAI-compatible API"},
            "paths": paths, "components": components}


def openapi_handler(api_key: Optional[str] = None):
    """An aiohttp handler serving :func:`openapi_document` of the request's app (built once)."""
    cache: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        if not cache:
            cache.append(json.dumps(openapi_document(request.app, api_key), ensure_ascii=False).encode())
        return web.Response(body=cache[0], content_type="application/json")
    return handler
