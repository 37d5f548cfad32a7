"""Public result types of ``LLM.generate`` and the async engine (shaped like vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``vllm.logprobs.Logprob``).

    Attributes:
        logprob: natural log of the token's probability under the model's own distribution at that
            position (log-softmax of the logits, before temperature, penalties, top-k/p, min-p and
            any structured-output mask); ``<= 0``.
        rank: the token's 1-based rank in that distribution (1 = the most likely). The top-k
            entries of a position have ranks 1..k in order; the sampled (or prompt) token, when it
            is not among them, 1 + the number of tokens more likely than it.
        decoded_token: the token decoded on its own (``tokenizer.decode([token_id])``, so a piece
            of a multi-byte character reads U+FFFD), as vLLM fills it; None without a tokenizer.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token, ``{token_id: Logprob}``: the sampled token first, then the top-k."""
PromptLogprobs = list[Optional[dict[int, Logprob]]]
"""Per prompt token, ``{token_id: Logprob}`` (the prompt token first, then the top-k); None for the
first token, which nothing predicts."""


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
        logprobs: when ``SamplingParams.logprobs`` is set (k), per generated token a dict
            ``{token_id: Logprob}`` holding the sampled token (first) and the k most likely tokens
            (so k or k + 1 entries), as vLLM's :data:`SampleLogprobs`; else None.
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs are asked.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Union[None, int, str] = None
    logprobs: Optional[SampleLogprobs] = None
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
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` is set (k), per prompt token a
            dict ``{token_id: Logprob}`` holding that token (first) and the k most likely tokens at
            its position, None for the first token (:data:`PromptLogprobs`, as vLLM); else None.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: Optional[PromptLogprobs] = None
