"""A sequence as the engine's scheduler sees it."""
from __future__ import annotations

import enum
import time
from typing import Optional

from zpp.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence: prompt, generated tokens and scheduling state.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (after the batch that computes
    them has come back); ``num_sent_tokens`` counts tokens the workers have been told about.
    ``in_flight`` counts the micro-batches in the pipeline that hold this request, and
    ``num_in_flight_tokens`` the tokens they compute for it: while it is in flight a request is
    never preempted or freed, and is scheduled again only for its next prefill chunk (consecutive
    chunks may be in flight together; a decode needs its previous token back).
    """

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 max_tokens: int, eos_token_ids: set[int], arrival: Optional[float] = None):
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)  # prompt + outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.arrival = time.monotonic() if arrival is None else arrival
        self.order = 0  # position among requests of equal arrival (set by the scheduler)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_sent_tokens = 0
        self.sent_to_workers = False
        self.slot = -1
        """The workers' slot holding this request while ``sent_to_workers`` (see
        ``zpp.transport.messages``), else -1."""
        self.in_flight = 0
        self.num_in_flight_tokens = 0
        self.stop_reason = None
        self.block_hashes: list[int] = []
        self.kv_variant = 0
        """How the request's KV is computed, beyond its tokens: the seed of its prefix-cache block
        hashes, so blocks of different variants are never shared. 0, except with LongRoPE: 1 for a
        request longer than ``original_max_position_embeddings`` (long factors; see
        ``Scheduler.rope_switch_len``)."""
        self.grammar = None
        """Structured outputs: ``(GrammarSpec, stop token ids)`` for the result rank's matcher
        (zpp.engine.structured_output), or None."""
        self.last_token_at: Optional[float] = None
        """When the engine applied this request's last sampled token (monotonic seconds; None before
        the first, and again after a recompute): the scheduler measures inter-token gaps with it."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed (in micro-batches in flight)."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def skip_prefix_cache(self) -> bool:
        """True for a request that needs outputs computed over its prompt positions (prompt
        logprobs; the server's echo + logprobs asks for them): it may not reuse prefix-cache blocks,
        which hold KV, not the logits those outputs need (vLLM's rule). Its own full blocks are
        still cached for later requests."""
        return self.sampling.prompt_logprobs is not None

    @property
    def async_sampling_ok(self) -> bool:
        """Whether the next token can be sampled without the previous one on the workers' host
        (async scheduling): False with repetition, frequency or presence penalties, which read
        the token history."""
        p = self.sampling
        return p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> None:
        """Set a finished status if the last token ends the sequence.

        Conditions met on the same token take this precedence: stop token (``stop_reason`` = its
        id), EOS, then length (``max_tokens`` or ``max_model_len``). Stop strings, found later in
        the detokenized text, outrank all three (the engine overrides the status then).
        """
        n = self.num_output_tokens
        tok = self.token_ids[-1]
        p = self.sampling
        if n >= p.min_tokens:
            if p.stop_token_ids and tok in p.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = tok
                return
            if not p.ignore_eos and tok in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return
        if n >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
