"""Speculative decoding on the result rank: verify each chunk's draft tokens.

A verify chunk of request ``r`` computes ``1 + k`` positions: its last known token, then its drafts
``d_1..d_k`` (``ExecuteBatch.draft_counts``). Row ``j`` of its logits is the target's distribution
``p_j`` of the token after ``d_j`` (``d_0``: the last known token). Every row is sampled as a normal
decode row would be, as if the drafts before it were the sequence (:class:`~zpp.workers.sampler.Sampler`:
the same logit processing, ``min_tokens`` at that row's output index, and the same draw: a seeded
request's noise comes from ``(seed, output index)``), giving ``t_0..t_k``. The drafts are accepted
while ``t_{j-1} == d_j``; the chunk returns ``t_0..t_a`` (``a`` accepted drafts, then the target's
token after them).

This is the rejection sampler of speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; vLLM's ``RejectionSampler``) for a one-hot draft
distribution ``q = e_d``, which is what n-gram drafts are: the standard rule accepts ``d`` with
probability ``min(1, p(d) / q(d)) = p(d)`` and, rejected, draws from ``norm(max(p - q, 0))`` = ``p``
without ``d``, renormalized. Drawing ``t ~ p`` and accepting iff ``t == d`` does exactly that:
``P(t == d) = p(d)``, and ``t`` given ``t != d`` is distributed as ``p`` restricted to the other
tokens. All accepted tokens and the last one are then exact samples of the target, so the output
distribution is the target's (``tests/workers/test_rejection_sampler.py`` checks it statistically).
The draws being the ones plain decoding makes (the same exponential race with the same seeded noise),
a greedy or seeded request's output is token for token the one it has without speculation (up to
the floating-point difference between computing a position in a chunk of 1 + k and alone).
"""
from __future__ import annotations

import numpy as np
import torch

from zpp.transport import messages as m
from zpp.workers.sampler import Sampler, prompt_logprobs


def accepted_lengths(targets: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """How many drafts each chunk accepts.

    Args:
        targets: ``int[R]``, the tokens sampled at every row, chunk after chunk (``counts[i] + 1`` rows
            for chunk ``i``).
        drafts: ``int[sum(counts)]``, the chunks' drafts, chunk after chunk.
        counts: ``int[C]``, drafts per chunk (0 allowed: a plain sampling row).

    Returns ``int[C]``: ``a_i``, the length of the longest prefix of chunk ``i``'s drafts equal to
    the targets of the rows before them (``targets[row_j] == drafts[j]`` for ``j < a_i``).
    """
    counts = np.asarray(counts, dtype=np.int64)
    out = np.zeros(len(counts), dtype=np.int64)
    row0 = np.cumsum(counts + 1) - (counts + 1)  # each chunk's first row
    d0 = np.cumsum(counts) - counts
    for i in np.flatnonzero(counts).tolist():
        k = int(counts[i])
        match = targets[row0[i]:row0[i] + k] == drafts[d0[i]:d0[i] + k]
        out[i] = k if match.all() else int(np.argmin(match))
    return out


def verify_rows(row_first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``int[R]``: for each virtual row (``counts[i] + 1`` per sampling chunk), its index into the
    step's logit rows, given each chunk's first row ``row_first[i]`` (its rows are consecutive)."""
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(len(counts)), counts + 1)
    offset = np.arange(int((counts + 1).sum())) - (np.cumsum(counts + 1) - (counts + 1))[owner]
    return np.asarray(row_first, dtype=np.int64)[owner] + offset


def speculative_sample(target: torch.Tensor, draft: int, q: torch.Tensor, u: float,
                       generator: torch.Generator) -> tuple[int, bool]:
    """One position of the general rejection sampler (Leviathan et al. 2023, Algorithm 1), for a
    draft drawn from ``q`` (a model's draft distribution; n-gram drafts use the one-hot special case
    above): accept ``draft`` if ``u < p(draft) / q(draft)``, else draw from ``norm(max(p - q, 0))``.

    Args:
        target: ``p``, ``float[V]`` probabilities; ``q``: ``float[V]`` probabilities, ``q[draft] > 0``.
        u: a uniform draw in [0, 1).
        generator: for the draw on rejection.

    Returns ``(token, accepted)``.
    """
    p_d, q_d = float(target[draft]), float(q[draft])
    if q_d > 0 and u < p_d / q_d:
        return draft, True
    residual = (target - q).clamp_(min=0)
    if float(residual.sum()) <= 0:  # p == q: any rejection is measure zero; fall back to p
        residual = target
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator)), False


def verify(runner, batch: m.ExecuteBatch, cols: m.BatchColumns, logits: torch.Tensor, sample_rows: list[int],
           sample_chunks: np.ndarray, plp_spans) -> m.StepResult:
    """The result of a batch with drafts on ``runner`` (the result rank's ModelRunner; ``logits``
    and the rest from its ``_sample``): sample every row of the
    sampling chunks (``1 + k`` for a chunk with ``k`` drafts), accept each chunk's drafts while
    they equal the target's tokens, and return the accepted ones and the token after them
    (``StepResult.token_counts``)."""
    counts = cols.draft_counts[sample_chunks].astype(np.int64)
    vrows = verify_rows(np.asarray(sample_rows, dtype=np.int64), counts)
    runner.trace.mark("verify", batch.batch_id, args={"drafts": int(counts.sum())})
    row_slots = cols.slots[sample_chunks]
    vslots = np.repeat(row_slots, counts + 1)
    ends = cols.starts[sample_chunks].astype(np.int64) + cols.num_tokens[sample_chunks]
    allowed = runner._allowed(batch, cols, logits.shape[1])
    if allowed is not None:  # constrained chunks have no drafts: their row is their chunk's first
        first = np.cumsum(counts + 1) - (counts + 1)
        idx = torch.as_tensor(first, device=allowed[0].device)[allowed[0]]
        allowed = (idx, allowed[1])
    vlogits = logits[torch.as_tensor(vrows, device=logits.device)]
    if runner.table.plain[row_slots].all():
        targets = Sampler.greedy(vlogits, allowed).tolist()
        lps = [None] * len(targets)
    else:
        seqs = runner.table.seq_states(vslots, verify_rows(ends - counts, counts))
        targets, lps = runner.sampler(vlogits.float(), seqs, runner.eos_token_ids, allowed)
    acc = accepted_lengths(np.asarray(targets), cols.draft_tokens, counts)
    first = np.cumsum(counts + 1) - (counts + 1)
    tokens, out_lps, n_out = [], [], []
    for c, a in enumerate(acc.tolist()):
        f = int(first[c])
        tokens.extend(targets[f:f + a + 1])
        out_lps.extend(lps[f:f + a + 1])
        n_out.append(a + 1)
    lp_chunks = [int(ci) for ci, n in zip(sample_chunks.tolist(), n_out) for _ in range(n)]
    res = m.StepResult(batch.batch_id, m.pack_int32(tokens),
                       [ci for ci, lp in zip(lp_chunks, out_lps) if lp is not None],
                       [lp for lp in out_lps if lp is not None],
                       prompt_logprobs(runner.table, cols, logits, plp_spans), busy_s=runner.busy_s, idle_s=runner.idle_s,
                       token_counts=m.pack_int32(n_out))
    runner.trace.mark("verified", batch.batch_id, args={"accepted": int(acc.sum())})
    if runner._grammar_sel is not None:  # constrained chunks return one token each: their first
        runner.accept_sampled(res, sample_chunks, [targets[int(f)] for f in first], runner._grammar_sel)
    return res
