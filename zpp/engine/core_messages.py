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
