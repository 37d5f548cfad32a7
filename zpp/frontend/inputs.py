"""Request input processing in the front end: tokenization and validation against the limits,
shared by ``zpp serve`` and the offline ``LLM`` (so the two cannot drift).

The one place ``max_tokens`` is resolved: omitted (None) means the room left after the prompt in
``max_model_len``, or in the KV cache when that holds fewer tokens.
"""
from __future__ import annotations

from typing import Optional, Union

from zpp.errors import RequestError
from zpp.sampling_params import SamplingParams

PromptType = Union[str, list[int]]




class InputProcessor:
    """Tokenize and check requests.

    Args:
        tokenizer: the HF tokenizer, or None (prompts must then be token ids).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: prompt + generated tokens per sequence, at most.
        num_kv_blocks: KV-cache blocks in all (one sequence must fit alone).
        block_size: tokens per KV-cache block.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, num_kv_blocks: int, block_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A str or a list of token ids -> (text or None, token ids).

        Raises:
            RequestError: a text prompt for a model without tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send the prompt as token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """Check a request against the limits; return its effective max_tokens.

        Rules: the prompt needs >= 1 token, every id in ``[0, vocab_size)``; ``max_tokens`` omitted
        (None) means the remaining room ``min(max_model_len, KV cache tokens) - prompt_len``; prompt +
        max_tokens must not exceed ``max_model_len`` nor the KV cache; ``max_tokens == 0`` returns at
        once with no output.

        Raises:
            RequestError: naming the numbers.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: at least 1 token is needed", "prompt")
        if n >= self.max_model_len:  # before the scan below: a hostile prompt can hold millions of ids
            raise RequestError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"(the prompt must leave room for at least 1 generated token)", "prompt")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt")
        room = min(self.max_model_len, self.num_kv_blocks * self.block_size) - n
        if sampling.max_tokens is None and room < 1:
            raise RequestError(
                f"the prompt has {n} tokens, but the KV cache holds only {self.num_kv_blocks} blocks of "
                f"{self.block_size} tokens (room for at least 1 generated token is needed)", "prompt")
        max_tokens = sampling.max_tokens if sampling.max_tokens is not None else room
        if n + max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {self.max_model_len}", "max_tokens")
        need = -(-(n + max_tokens) // self.block_size)
        if need > self.num_kv_blocks:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks, but the cache "
                f"holds only {self.num_kv_blocks} blocks of {self.block_size} tokens", "max_tokens")
        return max_tokens
