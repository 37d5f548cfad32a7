"""Speculative decoding in the engine core: n-gram drafts (prompt lookup), MTP drafts (made on the
last stage, kept here until the request's next step) and the bookkeeping of their acceptance.

How a step with drafts goes (``--speculative-config``, :class:`~zpp.config.SpeculativeConfig`):

* the scheduler asks :meth:`SpecDecoder.propose` for a decoding request's drafts (up to ``k``) and
  sends its chunk as its last known token followed by the drafts (``1 + k`` query tokens,
  ``ExecuteBatch.draft_counts``); every stage computes them like a short prefill (their KV slots
  are written, positions ``n - 1 .. n - 1 + k``);
* the last stage verifies them (:mod:`zpp.workers.rejection_sampler`) and returns the accepted
  prefix and one token more (``StepResult.token_counts``);
* the scheduler appends those tokens (stopping at one that ends the request) and counts as
  computed only the positions whose input was accepted: the rejected positions' KV slots are
  rolled back by ``num_computed_tokens`` (their blocks stay with the request and are overwritten
  by its next tokens, as vLLM does; a block is registered in the prefix cache only once all its
  positions hold accepted tokens).

Pipelining: a request with drafts in flight is not scheduled again until its result returns (the
core does not know how many tokens will be accepted, so it cannot place the next step). This is
what pipeline parallelism already implies for a decoding request (it is in at most one micro-batch
in flight); async scheduling is off with speculation (``EngineConfig.async_scheduling``).

Which requests get drafts: decoding ones (not a prompt chunk), without penalties (their logits read
the token history, drafts included); at most as many as fit ``max_tokens`` and ``--max-model-len``; none in a step
with more decoding requests than ``disable_by_batch_size``; none for a while after a request's
recent acceptance fell below ``min_acceptance_rate``.

Structured outputs: a constrained request's drafts go to the result rank like any other; there its
grammar matcher walks them (:meth:`zpp.workers.grammar.SlotGrammars.fill_drafts`), the bitmask of
each of the ``1 + k`` rows being the grammar's state after the drafts before it, and the draft is
cut at the first token the grammar refuses (the row before it disallows it); the walk is then rolled
back and the matcher accepts the tokens the chunk returns.

The n-gram proposer is vLLM's ``NgramProposer`` idea (prompt lookup decoding, Saxena 2023): the
longest suffix of the sequence, from ``prompt_lookup_max`` tokens down to ``prompt_lookup_min``,
that occurs earlier in it; the tokens that followed its latest earlier occurrence are the drafts.
"""
from __future__ import annotations

import itertools
import time
from typing import Optional, Sequence

import numpy as np

from zpp.config import SpeculativeConfig
from zpp.transport import messages as m

BACKOFF_STEPS = 16
"""Steps a request proposes nothing after its acceptance rate fell below ``min_acceptance_rate``."""

_EMA = 0.25
"""Weight of the newest step in a request's acceptance-rate average."""


def propose_ngram(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt-lookup drafts: for ``n`` from ``n_max`` down to ``n_min``, the last ``n`` tokens are
    looked up among the earlier windows of ``tokens``; at the latest earlier match, the (at most
    ``k``) tokens that followed are returned. ``[]`` when no suffix recurs or ``k < 1``.

    ``tokens``: the sequence (prompt and outputs), ints or an int array.
    """
    L = len(tokens)
    if k < 1 or L < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = arr[L - n:]
        # windows starting at 0 .. L - n - 1 (the suffix itself excluded)
        win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((win == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


def split_tokens(result, num_sampled: int) -> list[list[int]]:
    """A StepResult's tokens per sampling chunk: one each, or ``token_counts`` of them (verify
    chunks).

    Raises:
        RuntimeError: more or fewer tokens (or counts) than the batch's ``num_sampled`` sampling chunks."""
    tokens = m.int32s(result.tokens).tolist()
    if not result.token_counts:
        if len(tokens) != num_sampled:
            raise RuntimeError(f"micro-batch {result.batch_id}: {len(tokens)} sampled tokens for "
                               f"{num_sampled} sampling chunks")
        return [[t] for t in tokens]
    counts = m.int32s(result.token_counts).tolist()
    if len(counts) != num_sampled or sum(counts) != len(tokens) or min(counts, default=1) < 1:
        raise RuntimeError(f"micro-batch {result.batch_id}: {len(tokens)} tokens in {counts} for "
                           f"{num_sampled} sampling chunks")
    ends = list(itertools.accumulate(counts))
    return [tokens[e - c:e] for c, e in zip(counts, ends)]


class SpecDecoder:
    """The core's half of speculative decoding: drafts for the scheduler and the counters.

    Counters (cumulative; vLLM's ``spec_decode_*`` metrics): ``num_drafts`` (chunks sent with drafts),
    ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos[i]`` (drafts accepted at
    position ``i`` of their chunk, 0-based).
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        self.propose_s = 0.0
        """Seconds the proposals of the latest step took (from :meth:`begin_step`; ZPP_TRACE's ``draft``)."""
        self._rate: dict[str, float] = {}  # request id -> recent acceptance rate
        self._backoff: dict[str, int] = {}  # request id -> steps without drafts left
        self._mtp: dict[str, tuple[int, list[int]]] = {}  # MTP: request id -> (its length then, drafts)

    def setup_kv(self, kv, max_model_len: int) -> None:
        """MTP: every request's blocks reach ``k - 1`` positions past its scheduled tokens (the
        draft chain writes the MTP layer's KV there, ``zpp.workers.mtp``), and a prefix-cache hit
        recomputes its last block (the MTP layer's KV at a block's last position was made with the
        token after it, which a request sharing only the block may not have)."""
        if self.config.method == "mtp":
            kv.lookahead, kv.lookahead_limit = self.k - 1, max_model_len
            kv.recompute_last_hit = True

    def store_drafts(self, req, drafts) -> None:
        """MTP: the drafts the last stage made for ``req``'s next step (after the tokens just appended;
        -1 ends them), kept until that step is scheduled (or the request grows otherwise)."""
        d = list(drafts)
        if -1 in d:
            d = d[:d.index(-1)]
        self._mtp[req.req_id] = (req.num_tokens, d)

    def enabled_for_step(self, num_decoding: int) -> bool:
        """Whether a step with ``num_decoding`` decoding requests may carry drafts (the scheduler
        asks once per step, before proposing)."""
        self.propose_s = 0.0
        limit = self.config.disable_by_batch_size
        return limit is None or num_decoding <= limit

    def propose(self, req, max_model_len: int, rope_switch_len: Optional[int] = None,
                budget: int = 1 << 30) -> list[int]:
        """Drafts for decoding request ``req`` (:class:`~zpp.engine.request.Request`), at most
        ``budget``: ``[]`` when it may not speculate (see the module docstring) or no n-gram matches."""
        if not req.async_sampling_ok:
            return []
        left = self._backoff.get(req.req_id)
        if left:
            self._backoff[req.req_id] = left - 1
            return []
        n = req.num_tokens
        k = min(self.k, req.max_tokens - req.num_output_tokens - 1, max_model_len - n - 1, budget)
        if rope_switch_len is not None and req.kv_variant == 0:
            k = min(k, rope_switch_len - n - 1)
        if k < 1:
            return []
        c = self.config
        if c.method == "mtp":  # drafted on the last stage with the tokens of the request's latest step
            at, d = self._mtp.get(req.req_id, (-1, []))
            return d[:k] if at == n else []
        t = time.perf_counter()
        out = propose_ngram(req.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
        self.propose_s += time.perf_counter() - t
        return out

    def accepted(self, req_id: str, num_drafts: int, num_tokens: int) -> int:
        """A verify chunk of ``num_drafts`` drafts returned ``num_tokens`` tokens (its accepted drafts
        and one more): counts them and returns the positions whose KV is valid (the last known
        token's and the accepted drafts': ``num_tokens``; the rejected ones are rolled back).

        Raises:
            RuntimeError: ``num_tokens`` outside ``1 .. num_drafts + 1``."""
        if not 1 <= num_tokens <= num_drafts + 1:
            raise RuntimeError(f"sequence {req_id}: {num_tokens} tokens for a chunk with {num_drafts} drafts")
        self.record(req_id, num_drafts, num_tokens - 1)
        return num_tokens

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A chunk with ``num_drafts`` drafts came back with ``num_accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        floor = self.config.min_acceptance_rate
        if floor > 0:
            rate = (1 - _EMA) * self._rate.get(req_id, 1.0) + _EMA * num_accepted / num_drafts
            self._rate[req_id] = rate
            if rate < floor:
                self._backoff[req_id] = BACKOFF_STEPS
                self._rate[req_id] = floor  # after the pause, one bad step stops it again

    def forget(self, req_id: str) -> None:
        """A request finished: drop its acceptance history."""
        self._rate.pop(req_id, None)
        self._backoff.pop(req_id, None)
        self._mtp.pop(req_id, None)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step yields on average: 1 + accepted drafts per chunk with drafts
        (vLLM's "mean acceptance length"); 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
