"""Per-request sampling parameters (shaped like vLLM's ``SamplingParams``).

The struct crosses the engine -> last-stage socket as msgpack (msgspec), never pickle.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


from zpp.errors import SamplingParamsError


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Constrain a request's output to a grammar (vLLM's ``StructuredOutputsParams``; the OpenAI
    server's ``structured_outputs`` object, ``guided_*`` fields and ``response_format`` map onto it).

    Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` and ``json_object`` is set (the
    constraint); ``disable_any_whitespace`` and ``whitespace_pattern`` are options of the JSON ones. The
    grammar is compiled by xgrammar in the front end (a bad one is refused before the request is
    queued) and enforced by a token mask before every sampled token, in every sampling mode.
    The output then follows the grammar to its end, where only a stop token (EOS) is allowed:
    ``finish_reason`` is ``"stop"``, or ``"length"`` when ``max_tokens`` ends it first.

    Raises:
        SamplingParamsError: on construction, when not exactly one constraint is given or a value
            has the wrong shape (``.param`` is ``"structured_outputs"``).
    """

    json: Union[None, str, dict[str, Any]] = None
    """A JSON Schema (a dict, or its JSON text) the output must validate against. Strict: properties
    the schema does not list are never generated (xgrammar's ``strict_mode``)."""
    regex: Optional[str] = None
    """A regular expression the whole output must match."""
    choice: Optional[list[str]] = None
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """A context-free grammar in xgrammar's EBNF (GBNF-style, start rule ``root``)."""
    json_object: Optional[bool] = None
    """True: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact: ``{"a": 1, "b": [1, 2]}``), for ``json`` and
    ``json_object`` (and tool calls); an option, not a constraint. Without it (and without
    ``whitespace_pattern``) each run of whitespace between JSON tokens is at most
    ``StructuredOutputsConfig.max_whitespace_cnt`` characters (16 by default: pretty-printed JSON
    stays legal, and a model that keeps writing newlines cannot run to ``max_tokens``)."""
    whitespace_pattern: Optional[str] = None
    """A regular expression every run of whitespace between JSON tokens must match (vLLM's
    option, e.g. ``"[ ]?"``), for ``json`` and ``json_object``; it replaces the bound above. With
    ``disable_any_whitespace`` the output is compact and the pattern is unused."""

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", "structured_outputs: give exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(given) if given else 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs",
                                      "structured_outputs: choice must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError("structured_outputs", f"structured_outputs: {k} must be a non-empty string")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise SamplingParamsError("structured_outputs", "structured_outputs: whitespace_pattern must be a string "
                                      "(a regular expression)")

    @property
    def kind(self) -> str:
        """Which constraint is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"


MAX_LOGIT_BIAS = 100.0
"""The largest ``|bias|`` of a ``logit_bias`` entry (OpenAI's limit)."""


def _checked_logit_bias(bias) -> Optional[dict[int, float]]:
    """``logit_bias`` as ``{int token id: float bias}`` (None when empty). Raises SamplingParamsError."""
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias", "logit_bias: must be a map of token id -> bias")
    out: dict[int, float] = {}
    for k, v in bias.items():
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingParamsError("logit_bias", f"logit_bias: {k!r} is not a token id (a non-negative integer)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"logit_bias: the bias of token {k} must be a number in "
                                      f"[-100, 100], got {v!r}")
        out[k] = float(v)
    return out or None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens for one request.

    Processing order on the last stage (same as vLLM / HF ``generate``): repetition, frequency and
    presence penalties on the raw logits, ``min_tokens`` suppression of stop tokens, then
    temperature, top-k, top-p, min-p, and sampling (argmax when ``temperature == 0``).

    Raises:
        SamplingParamsError: on construction, for any out-of-range value; ``.param`` names it.
    """

    n: int = 1
    """Number of completions for the prompt (each an independent sequence)."""
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 = all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top token's; [0, 1]."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token already generated; [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtract this x count from the logit of every token already generated; [-2, 2]."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) on tokens in the prompt or the output; 1 = off."""
    seed: Optional[int] = None
    """Per-request seed: the same seed gives the same tokens at any PP size and batch mix."""
    max_tokens: Optional[int] = 16
    """Most tokens to generate, at least 1 (0 or less: SamplingParamsError, a ValueError, as vLLM
    raises; the OpenAI server's completions with ``echo`` and ``max_tokens`` 0 return the prompt
    without a SamplingParams of 0); None = the remaining room up to max_model_len (or up to what the
    KV cache holds, if that is less)."""
    min_tokens: int = 0
    """Stop tokens (EOS, stop_token_ids) are suppressed until this many tokens are generated."""
    stop: Union[None, str, list[str]] = None
    """Strings that end generation; the stop string itself is not returned."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end generation (in addition to EOS)."""
    ignore_eos: bool = False
    """Keep generating after EOS."""
    logprobs: Optional[int] = None
    """Return this many top log-probabilities per generated token (plus the sampled token's), 0-20:
    ``CompletionOutput.logprobs``, per token ``{token_id: Logprob}`` (``zpp.outputs.Logprob``)."""
    prompt_logprobs: Optional[int] = None
    """Return this many top log-probabilities per prompt token (plus the prompt token's), 0-20:
    ``RequestOutput.prompt_logprobs``, per token ``{token_id: Logprob}``, None for the first."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string in the text."""
    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see
    :class:`StructuredOutputsParams`)."""
    logit_bias: Optional[dict[int, float]] = None
    """Token id -> bias in [-100, 100] added to that token's logit before penalties, temperature,
    top-k/p and min-p, in every sampling mode (OpenAI's ``logit_bias``): +100 all but forces a
    token, -100 all but forbids it. Ids must lie in the vocabulary (checked when the request is
    queued). Logprobs stay the model's own."""
    truncate_prompt_tokens: Optional[int] = None
    """Keep only the prompt's last k tokens (vLLM's left truncation); -1: its last ``max_model_len``
    (that leaves no room to generate, so such a prompt is still refused). A prompt of k tokens or
    fewer is unchanged. Chat: the rendered conversation's last k tokens."""

    def __post_init__(self):
        def bad(param, msg):
            raise SamplingParamsError(param, f"{param}: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature < 1e-5:
            self.temperature = 0.0  # dividing logits by a tiny temperature overflows: greedy, as vLLM
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 63):
            bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            # vLLM's rule and wording (the OpenAI server's 400 reads the same: server.protocol.check_max_tokens)
            raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if any(not isinstance(s, str) for s in self.stop):
                bad("stop", "must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                bad("stop", "must not contain an empty string")
            if not self.stop:
                self.stop = None
        if self.stop_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            bad("truncate_prompt_tokens", f"must be -1 or >= 1, got {self.truncate_prompt_tokens}")
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
