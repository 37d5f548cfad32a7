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


def sample_end_of_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``int[R]``: the tokens before the one each virtual row samples (its position + 1), given each
    sampling chunk's end (``start + num_tokens``) and drafts: chunk ``i``'s rows end at
    ``ends[i] - counts[i] .. ends[i]``."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = verify_rows(np.asarray(ends, dtype=np.int64) - counts, counts)
    return rows


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
