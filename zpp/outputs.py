"""Public result types of ``LLM.generate`` and the async engine (shaped like vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

# One position's log-probabilities: {token_id: logprob}, the chosen token first.
Logprobs = list[dict[int, float]]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: position among the request's ``n`` sequences.
        text: generated text (stop string excluded unless ``include_stop_str_in_output``).
        token_ids: generated token ids (the stop token included when one ended generation).
        finish_reason: ``"stop"`` (EOS, stop string or stop token), ``"length"``, ``"abort"`` or None
            while running. When several conditions are met on the same token, the first of stop
            string, stop token, EOS, length decides (streamed or not).
        stop_reason: the stop string or stop token id that ended it, else None.
        logprobs: per generated token, ``{token_id: logprob}`` (sampled token first), when asked.
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs are asked.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None
    logprobs: Optional[Logprobs] = None
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its ``n`` completions.

    Attributes:
        request_id: the engine's id.
        prompt: prompt text (None when the prompt was given as token ids).
        prompt_token_ids: the tokenized prompt.
        outputs: one CompletionOutput per sequence, ordered by index.
        finished: every sequence is done.
        prompt_logprobs: per prompt token (None for the first), ``{token_id: logprob}``, when asked.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None
