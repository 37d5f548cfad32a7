"""Every error a caller of zpp catches, in one place.

- :class:`ConfigError`: a setting that cannot work (the CLI prints it as one line, exit 2).
- :class:`RequestError`: a request that is refused (HTTP 4xx, ``param`` names the field the client
  sent); :class:`SamplingParamsError` is the one :class:`~zpp.sampling_params.SamplingParams`
  raises, with the parameter first.
- :class:`EngineDeadError` and its kinds :class:`EngineShutdownError`, :class:`EngineBusyError`:
  requests fail because the engine died, is stopping or is restarting a stage (HTTP 503).
- :class:`WorkerDiedError`: a worker process (or the engine core) failed, at start-up or later.
"""
from __future__ import annotations

import re
from typing import Optional


class ConfigError(ValueError):
    """A setting that cannot work. The message is one line and names the setting."""


class RequestError(ValueError):
    """A request that is refused: HTTP ``status`` (400 unless told) with OpenAI's error body.

    Attributes:
        param: the request field at fault, as the client named it (OpenAI's ``param``), or None.
        status: the HTTP status (400, 404 unknown model, 413 body too large, 415 coding).
        err_type: OpenAI's error ``type``.
        code: OpenAI's error ``code`` (e.g. ``"model_not_found"``), or None.
        unknown_fields: top-level request fields the request type does not know (the server logs
            them once).
        headers: HTTP headers for the error response.
    """

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: Optional[str] = None,
                 unknown_fields: tuple[str, ...] = (), headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.param, self.status, self.err_type, self.code = param, status, err_type, code
        self.unknown_fields = unknown_fields
        self.headers = headers or {}

    def renamed(self, names: dict[str, str]) -> "RequestError":
        """This error as the client should read it: ``param`` mapped through ``names`` (an internal
        field -> the request field the client sent, e.g. ``max_tokens`` -> ``max_completion_tokens``)
        and every whole-word mention of the old name in the message with it. Itself when
        ``names`` does not map ``param``."""
        new = names.get(self.param) if self.param else None
        if not new or new == self.param:
            return self
        msg = re.sub(rf"\b{re.escape(self.param)}\b", new, str(self))
        return RequestError(msg, new, self.status, self.err_type, self.code, self.unknown_fields, self.headers)


class SamplingParamsError(RequestError):
    """An invalid sampling parameter; ``param`` names it (the OpenAI error's ``param`` field)."""

    def __init__(self, param: str, message: str):
        super().__init__(message, param)


class EngineDeadError(RuntimeError):
    """The engine lost a worker (or its core); every request fails and the server reports unhealthy."""


class EngineShutdownError(EngineDeadError):
    """The server is stopping (SIGINT / SIGTERM): requests still running are ended with this."""


class EngineBusyError(EngineDeadError):
    """A stage is being restarted and the queue of waiting requests is full (HTTP 503): the request
    is refused at once rather than queued without bound; the engine itself is alive."""


class WorkerDiedError(RuntimeError):
    """A worker process exited or reported an error; the engine cannot continue."""
