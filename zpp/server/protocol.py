"""OpenAI API request schemas (msgspec) and their translation into SamplingParams.

Decoding a body with ``msgspec.json.decode(body, type=CompletionRequest)`` checks every field's
type; a ValidationError's path (``$.temperature``) names the parameter for the 400 response.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Optional, Union

import msgspec

from zpp.sampling_params import SamplingParams


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Union[str, list[Union[str, int, list[int]]], None] = None
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Union[None, str, list[dict[str, Any]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage] = []
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class ProtocolError(ValueError):
    """A malformed request; becomes HTTP ``status`` with OpenAI's error body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 err_type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.err_type, self.code = param, status, err_type, code


_PATH_RE = re.compile(r"at `\$\.([A-Za-z_]+)")


def decode_request(body: bytes, kind: type):
    """Parse and type-check a JSON body. Raises ProtocolError naming the bad parameter."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH_RE.search(str(e))
        raise ProtocolError(f"invalid request: {e}", m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"the body is not valid JSON: {e}") from None
    return req


def to_sampling_params(req: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
    """Map OpenAI fields onto SamplingParams (None -> OpenAI defaults: temperature 1, top_p 1).

    Raises:
        SamplingParamsError: an out-of-range value (``.param`` names it).
        ProtocolError: a field zpp does not support.
    """
    if req.logit_bias:
        raise ProtocolError("logit_bias is not supported", "logit_bias")
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )


def error_body(message: str, err_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
