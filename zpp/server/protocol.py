"""OpenAI API request schemas (msgspec) and their translation into SamplingParams.

Decoding a body with :func:`zpp.server.http_body.decode_request` checks every field's type and the ranges that can be
checked without the model (an integer must fit in 64 bits, ``n`` is at most 128, ...; a whole
float such as ``5.0`` is an integer, as in vLLM); a ValidationError's path (``$.temperature``)
names the parameter for the 400 response. An unknown top-level field is ignored, as vLLM does
(clients send OpenAI's newer fields by default): the server logs a warning naming it and lists it
in the response's ``X-Ignored-Fields`` header (:func:`zpp.server.http_body.read_request`). Unknown
keys inside a known object (``stream_options.foo``) are a 400 naming the path; inside ``messages``
they are ignored (clients replay assistant messages with ``refusal``, ``annotations``, ...).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from zpp.errors import RequestError, SamplingParamsError
from zpp.sampling_params import SamplingParams, StructuredOutputsParams



class _WholeInt(int):
    """An integer request field. As in vLLM (pydantic's lax mode), a JSON float with no fractional
    part is accepted for it (``5.0`` -> 5); ``5.5``, strings and booleans are refused. The bounds are
    checked here (msgspec's ``Meta`` constraints do not apply to a custom type). Decoded by
    :func:`_dec_hook`; each struct's ``__post_init__`` turns the values back into plain ints."""

    ge: int
    le: int


_WHOLE_INTS: dict[tuple[int, int], type] = {}


def whole_int(ge: int, le: int) -> type:
    """The integer field type with bounds ``ge <= value <= le`` (one class per pair of bounds)."""
    kind = _WHOLE_INTS.get((ge, le))
    if kind is None:
        kind = _WHOLE_INTS[(ge, le)] = type("int", (_WholeInt,), {"ge": ge, "le": le})
    return kind


def _dec_hook(kind: type, obj: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, _WholeInt):
        if isinstance(obj, float) and obj.is_integer():
            obj = int(obj)
        if isinstance(obj, bool) or not isinstance(obj, int):
            raise TypeError(f"Expected `int`, got `{type(obj).__name__}`")
        if obj < kind.ge:
            raise ValueError(f"Expected `int` >= {kind.ge}")
        if obj > kind.le:
            raise ValueError(f"Expected `int` <= {kind.le}")
        return kind(obj)
    raise NotImplementedError(f"no decoder for {kind}")


def _plain_int(v: Any) -> Any:
    if isinstance(v, _WholeInt):
        return int(v)
    if isinstance(v, list) and v and isinstance(v[0], _WholeInt):
        return [int(x) for x in v]
    return v


_NULL_DEFAULTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _null_defaults(kind: type) -> tuple[tuple[str, Any], ...]:
    """``(name, default)`` of the fields of ``kind`` whose default is a value, not None."""
    got = _NULL_DEFAULTS.get(kind)
    if got is None:
        got = _NULL_DEFAULTS[kind] = tuple((f.name, f.default) for f in msgspec.structs.fields(kind)
                                           if f.default is not None and f.default is not msgspec.NODEFAULT)
    return got


class _Request(msgspec.Struct):
    """Base of the request structs: after decoding, the integer fields hold plain ints (msgpack,
    on the way to the engine, encodes no int subclass), and a null sent for a field whose default
    is a value (``n``, ``stream``, ``echo``, chat ``logprobs``: OpenAI's schema allows null there)
    means that default."""

    def __post_init__(self):
        for name in self.__struct_fields__:
            v = getattr(self, name)
            w = _plain_int(v)
            if w is not v:
                setattr(self, name, w)
        for name, default in _null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


# Every integer that reaches the engine crosses a msgpack socket: it must fit in 64 bits.
Int64 = whole_int(-(2 ** 63), 2 ** 63 - 1)
MAX_N = 128  # OpenAI's limit on completions per prompt
MAX_REQUEST_ID = 256  # characters of a client's request_id (it goes into ids and log lines)


def valid_request_id(rid: str) -> bool:
    """A client's request id (``request_id`` field, ``X-Request-Id`` header): 1 to MAX_REQUEST_ID
    printable ASCII characters."""
    return 0 < len(rid) <= MAX_REQUEST_ID and rid.isprintable() and rid.isascii()


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``stream_options``: OpenAI's ``include_usage`` (a last chunk with the usage) and
    ``include_obfuscation`` (accepted; zpp adds no obfuscation field), vLLM's
    ``continuous_usage_stats`` (with ``include_usage``: the usage so far in every chunk). Unknown
    keys are refused (a 400 naming ``stream_options.KEY``): a typo inside a known object."""

    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    include_obfuscation: Optional[bool] = None


class _SamplingFields(_Request, kw_only=True):
    model: Optional[str] = None
    max_tokens: Optional[Int64] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[whole_int(1, MAX_N)] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[Int64] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extensions
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[Int64]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[Int64] = None
    truncate_prompt_tokens: Optional[Int64] = None
    request_id: Optional[str] = None
    """The response's ``id`` is ``chatcmpl-<request_id>`` / ``cmpl-<request_id>`` (without it: the
    ``X-Request-Id`` header's value, else a fresh one); two requests in progress may not share one
    (HTTP 400)."""
    priority: Int64 = 0
    """Only 0: zpp schedules first come, first served (as vLLM without ``--scheduling-policy priority``)."""
    # Structured outputs (zpp.server.structured_outputs): OpenAI's response_format, vLLM's current
    # structured_outputs object and its older guided_* fields.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[None, str, dict[str, Any]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    """vLLM's older spelling of ``structured_outputs.whitespace_pattern`` (an option, not a constraint)."""
    # OpenAI fields with no effect on a self-hosted server, accepted as vLLM does.
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``; ``prompt`` is a string, a list of strings, a token-id list or a
    list of token-id lists."""

    prompt: Union[str, list[Union[str, int, list[int]]], None] = None
    echo: Optional[bool] = False
    logprobs: Optional[Int64] = None
    suffix: Optional[str] = None
    best_of: Optional[Int64] = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Union[None, str, list[dict[str, Any]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    """An assistant message's tool calls (passed to the chat template)."""
    tool_call_id: Optional[str] = None
    """A ``tool`` message: the call it answers (passed to the chat template)."""
    reasoning_content: Optional[str] = None
    """An assistant message's reasoning (as zpp and vLLM return it with ``--reasoning-parser``),
    sent back in an agent loop: the chat template gets it as ``reasoning_content`` (Qwen3's
    re-renders the current tool loop's thinking)."""
    reasoning: Optional[str] = None
    """vLLM's newer name of ``reasoning_content`` (used when that one is not given)."""


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the older ``max_tokens``;
    ``chat_template`` (a vLLM extension) overrides the server's template for this request."""

    messages: list[ChatMessage] = []
    max_completion_tokens: Optional[Int64] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[whole_int(0, 20)] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the template writes BOS itself; True adds the tokenizer's too
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[None, str, dict[str, Any]] = None
    parallel_tool_calls: Optional[bool] = None
    include_reasoning: bool = True
    """vLLM's: with a ``--reasoning-parser``, false leaves ``reasoning_content`` out (None)."""
    reasoning_effort: Optional[str] = None
    """One of REASONING_EFFORTS: the chat template's variable ``reasoning_effort`` (as in vLLM; gpt-oss's
    template reads it), unless ``chat_template_kwargs`` sets that one; null: no such variable."""
    verbosity: Optional[str] = None
    """OpenAI's (``"low"``, ``"medium"``, ``"high"``; another value is a 400): accepted and no
    effect, as in vLLM (clients send it by default; the model's own length is what it writes)."""
    # OpenAI fields that would change the output and that zpp does not implement: null is accepted,
    # anything else refused naming the field (check_unsupported_chat_fields), not silently ignored.
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    functions: Optional[list[Any]] = None
    function_call: Union[None, str, dict[str, Any]] = None


UNSUPPORTED_CHAT_FIELDS = ("audio", "prediction", "web_search_options", "functions", "function_call")
VERBOSITIES = ("low", "medium", "high")  # OpenAI's verbosity values (chat's verbosity, Responses' text.verbosity)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # chat's reasoning_effort (OpenAI's values)


def check_one_of(value: Any, choices: tuple, param: str) -> None:
    """Raises ProtocolError naming ``param`` for a value (not None) outside ``choices``."""
    if value is not None and value not in choices:
        raise ProtocolError(f"{param} must be one of {', '.join(repr(e) for e in choices)}, got "
                            f"{str(value)[:30]!r}", param)


def check_unsupported_chat_fields(req: "ChatCompletionRequest") -> None:
    """Refuse OpenAI chat fields zpp does not implement (``modalities`` other than ``["text"]``,
    audio, predicted outputs, web search, the deprecated functions), a ``reasoning_effort`` that is
    not one of REASONING_EFFORTS and a ``verbosity`` that is not one of VERBOSITIES.

    Raises:
        ProtocolError: naming the field (``functions`` / ``function_call``: use ``tools``)."""
    check_one_of(req.reasoning_effort, REASONING_EFFORTS, "reasoning_effort")
    check_one_of(req.verbosity, VERBOSITIES, "verbosity")
    if req.modalities is not None and req.modalities != ["text"]:
        raise ProtocolError(f"modalities {req.modalities} are not supported by this server (text only)", "modalities")
    for name in UNSUPPORTED_CHAT_FIELDS:
        if getattr(req, name) is not None:
            hint = ": use tools / tool_choice" if name.startswith("function") else ""
            raise ProtocolError(f"{name} is not supported by this server{hint}", name)


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` (vLLM's): either ``prompt`` (a string, tokenized as ``/v1/completions``
    does) or ``messages`` (rendered with the chat template as ``/v1/chat/completions`` does, with
    ``tools`` as a chat request with ``tool_choice`` auto). ``add_special_tokens`` defaults to true
    for a prompt and false for messages, as in vLLM."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request, kw_only=True):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: Optional[str] = None
    tokens: list[Int64]


ProtocolError = RequestError
"""A malformed request (the one request-error type, :class:`zpp.errors.RequestError`)."""




def check_max_tokens(value: Optional[int], name: str, zero_ok: bool = False) -> None:
    """The one check of a request's output limit on every endpoint (chat's ``max_tokens`` /
    ``max_completion_tokens``, completions' ``max_tokens``, responses' ``max_output_tokens``),
    streamed or not: None (omitted) passes, and so does 0 where ``zero_ok`` (completions with
    ``echo``: the prompt returned, nothing generated); anything below 1 is else refused with the
    one message ``"<name> must be at least 1, got <value>"`` (vLLM's ``SamplingParams`` wording;
    OpenAI refuses it too), as a 400 naming ``name``.

    Raises:
        ProtocolError: (``param`` ``name``) the value is below 1 (below 0 with ``zero_ok``).
    """
    if value is not None and value < (0 if zero_ok else 1):
        raise ProtocolError(f"{name} must be at least 1, got {value}", name)


def to_sampling_params(req: _SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                       rename: Optional[dict[str, str]] = None,
                       structured_outputs: Optional[StructuredOutputsParams] = None,
                       defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """Map OpenAI fields onto SamplingParams. A field the request leaves out (or sends as null)
    takes its value from ``defaults`` (the model's generation config, see
    :mod:`zpp.generation_config`: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``max_tokens`` for a None ``max_tokens``), else OpenAI's default
    (temperature 1, top_p 1, no top-k / min-p / repetition penalty).

    ``rename`` maps a SamplingParams field to the request field it came from (``max_tokens`` ->
    ``max_completion_tokens``), so that an error names what the client sent.
    ``structured_outputs`` (from :func:`zpp.server.structured_outputs.structured_outputs_of` or the tools)
    constrains the output.

    Raises:
        ProtocolError: an out-of-range value or a field zpp does not support (``param`` names it).
    """
    d = defaults or {}
    if req.priority != 0:
        raise ProtocolError(f"priority: {req.priority}, but zpp schedules requests first come, first served: "
                            f"only 0 is accepted", "priority")
    if req.request_id is not None and not valid_request_id(req.request_id):
        raise ProtocolError(f"request_id: 1 to {MAX_REQUEST_ID} printable ASCII characters", "request_id")

    def pick(name: str, builtin):
        v = getattr(req, name)
        return d.get(name, builtin) if v is None else v

    try:
        return SamplingParams(
            logit_bias=logit_bias_of(req.logit_bias),
            n=req.n,
            temperature=pick("temperature", 1.0),  # below 1e-5: greedy (SamplingParams)
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            max_tokens=d.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
    except SamplingParamsError as e:
        raise ProtocolError(str(e), e.param).renamed(rename or {}) from None


def logit_bias_of(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (JSON object: token id as a string -> bias) as ``{int: float}``;
    None when absent or empty. The range of the biases ([-100, 100]) is checked by SamplingParams,
    the ids against the vocabulary when the request is validated.

    Raises:
        ProtocolError: (``param`` ``"logit_bias"``) a key that is not a non-negative integer."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for k, v in bias.items():
        s = k.strip()
        if not s.isascii() or not s.isdigit():
            raise ProtocolError(f"logit_bias: {k[:40]!r} is not a token id (a non-negative integer)", "logit_bias")
        out[int(s)] = v
    return out

