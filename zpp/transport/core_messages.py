"""Messages between the front end (HTTP, tokenizer, output processing) and the engine core
(scheduler, KV block manager, executor), as tagged msgspec Structs.

Front end -> core: :class:`AddRequest`, :class:`AbortRequests`, :class:`ShutdownCore`.
Core -> front end: :class:`CoreReady` once (or :class:`CoreFailed`), then one
:class:`StepOutputs` per applied micro-batch carrying the *deltas* of every request in it (new
token ids, logprobs, finish reason), and :class:`CoreDead` if a worker dies.

The same structs are used in-process (offline ``LLM``) and over ZeroMQ (``zpp serve``), so the
two paths cannot drift.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from zpp.sampling_params import SamplingParams
from zpp.transport.messages import PromptLogprobsOutput, TokenLogprobs


class EngineStats(msgspec.Struct, array_like=True):
    """The core's counters and gauges after a step (what ``/metrics`` and the stats log read).

    Attributes:
        num_running: sequences in the running queue (a request with n completions counts n).
        num_waiting: sequences waiting to be scheduled.
        kv_cache_usage: fraction of KV-cache blocks in use, 0-1.
        num_free_kv_blocks: free KV-cache blocks.
        num_kv_blocks: KV-cache blocks in all.
        num_preemptions: sequences preempted (recomputed later) so far.
        prefix_cache_queries: prompt tokens looked up in the prefix cache so far.
        prefix_cache_hits: of those, tokens served from the cache.
        stage_busy_s: per pipeline stage, seconds spent computing so far.
        num_prompt_tokens: prompt tokens of the sequences admitted so far (every front end's).
        num_generation_tokens: tokens sampled so far.
        stage_idle_s: per pipeline stage, seconds its device sat idle between micro-batches while
            the engine had work (the pipeline bubble) so far.
        recovering: a lost stage is being restarted (requests wait; ``/health`` says so).
        stage_restarts: per pipeline stage, restarts so far.
        recovery_seconds: how long each finished recovery took (death to pipeline formed again).
        stage_weight_bytes: per pipeline stage, the bytes of its weights by dtype name (``fp8``,
            ``bf16``, ...), summed over its tensor-parallel ranks.
        kv_cache_tokens: tokens the KV cache holds (every stage holds the same blocks).
        spec_num_drafts: speculative decoding: verify chunks sent with drafts so far.
        spec_num_draft_tokens: draft tokens sent so far.
        spec_num_accepted_tokens: of those, accepted.
        spec_accepted_per_pos: drafts accepted at each position of their chunk (0-based) so far.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_kv_blocks: int = 0
    num_kv_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    stage_busy_s: list[float] = []
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    stage_idle_s: list[float] = []
    recovering: bool = False
    stage_restarts: list[int] = []
    recovery_seconds: list[float] = []
    stage_weight_bytes: list[dict[str, int]] = []
    kv_cache_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class GrammarSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """A structured-output request's grammar, compiled by the front end, for the core's matcher.

    Attributes:
        key: identifies the grammar (a hash of its specification); the core caches the
            deserialized grammar under it, so a schema used by many requests is read once.
        compiled: xgrammar's ``CompiledGrammar.serialize_json()`` text.
        tokenizer_info: xgrammar's ``TokenizerInfo.serialize_json()`` text (about 1.6 MB for a
            49k vocabulary): sent by each front end with its first grammar only, empty after.
    """

    key: str
    compiled: str
    tokenizer_info: str = ""


class CoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence for the core to run (the front end fans a request with ``n`` > 1 out into n).

    Attributes:
        req_id: unique among live sequences.
        prompt_token_ids: the prompt, already validated against the vocabulary and the limits.
        sampling: the sequence's sampling parameters (its own seed when ``n`` > 1).
        max_tokens: tokens to generate at most (resolved by the front end, >= 1).
        grammar: the compiled grammar of a structured-output request (None: unconstrained).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    grammar: Optional[GrammarSpec] = None


class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Stop these sequences (client gone, stop string hit in the front end); unknown ids are ignored."""

    req_ids: list[str]


class ShutdownCore(msgspec.Struct, tag=True, array_like=True):
    pass


class FrontHello(msgspec.Struct, tag=True, array_like=True):
    """A front end's first message on the core socket (the core answers CoreReady when it is)."""

    index: int


class SeqDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step added to one sequence.

    Attributes:
        req_id: the sequence.
        token_id: the token sampled this step, or -1 when the step only computed a prefill chunk.
        logprobs: its log-probabilities, when the request asked for them.
        finish_reason: ``"stop"`` (EOS or a stop token, or a structured output's grammar is
            complete) or ``"length"`` when this token ended it; ``"abort"`` with ``token_id`` -1
            when a structured output's grammar reached a dead end (no token it allows could be
            sampled, e.g. ``min_tokens`` suppressed the EOS that was the only one allowed).
        stop_reason: the stop token id that ended it.
        prompt_logprobs: prompt-position logprobs this step computed (their first position is
            ``prompt_logprobs.start``).
    """

    req_id: str
    token_id: int = -1
    logprobs: Optional[TokenLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    prompt_logprobs: Optional[PromptLogprobsOutput] = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Every sequence delta of one applied micro-batch (one message per step, not per request),
    and the core's stats after it."""

    deltas: list[SeqDelta]
    stats: EngineStats


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    num_kv_blocks: int
    block_size: int
    pipeline_depth: int


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core could not start. ``kind``: ``"config"`` (ConfigError) or ``"worker"`` (WorkerDiedError)."""

    kind: str
    message: str


class CoreDead(msgspec.Struct, tag=True, array_like=True):
    """A worker died or the core loop failed; the core exits after sending this."""

    reason: str


ToCore = Union[AddRequests, AbortRequests, ShutdownCore, FrontHello]
FromCore = Union[StepOutputs, CoreReady, CoreFailed, CoreDead]
