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
from zpp.workers.grammar import sampled_rows
from zpp.workers.sampler import Sampler, prompt_logprobs, unpack_bitmask


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
    first = np.cumsum(counts + 1) - (counts + 1)  # each chunk's first virtual row
    runner._grammar_sel = None  # the constrained chunks' matchers are advanced here, not by runner._result
    sel = sampled_rows(runner.grammars, cols, runner.table.num_prompt)
    allowed = walked = None
    if sel is not None:
        allowed, walked = _draft_masks(runner, batch, cols, sel, counts, first, logits.shape[1])
    vlogits = logits[torch.as_tensor(vrows, device=logits.device)]
    if runner.table.plain[row_slots].all():
        targets = Sampler.greedy(vlogits, allowed).tolist()
        lps = [None] * len(targets)
    else:
        seqs = runner.table.seq_states(vslots, verify_rows(ends - counts, counts))
        targets, lps = runner.sampler(vlogits.float(), seqs, runner.eos_token_ids, allowed)
    acc = accepted_lengths(np.asarray(targets), cols.draft_tokens, counts)
    stopped = refused = ()
    if sel is not None:
        stopped, refused = _grammar_accept(runner.grammars, sel, walked, acc, first, targets)
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
    if stopped:
        res.grammar_stopped = sample_chunks[list(stopped)].tolist()
    if refused:
        res.grammar_refused = sample_chunks[list(refused)].tolist()
    runner.trace.mark("verified", batch.batch_id, args={"accepted": int(acc.sum())})
    return res


def _draft_masks(runner, batch: m.ExecuteBatch, cols: m.BatchColumns, sel, counts: np.ndarray, first: np.ndarray,
                 vocab_size: int):
    """Structured outputs in a verify step: the disallowed tokens of every virtual row of the
    constrained sampling chunks (``sel``: :func:`~zpp.workers.grammar.sampled_rows`), each row's
    mask the grammar's state after the drafts before it (:meth:`SlotGrammars.fill_drafts`, which
    cuts a chunk's drafts at the first one its grammar refuses). Returns ``((rows, disallowed), walked)``
    in the form of ``ModelRunner._allowed`` over the virtual rows, and each matcher's walk."""
    grows, slots, needs = sel
    k = counts[grows]
    d0 = np.cumsum(counts) - counts
    drafts = [cols.draft_tokens[d0[r]:d0[r] + counts[r]].tolist() for r in grows.tolist()]
    if runner.before_fill is not None:
        runner.before_fill()  # the pending result's tokens are accepted first
    runner.trace.mark("fill", batch.batch_id)
    bitmask, walked = runner.grammars.fill_drafts(slots, needs - k, drafts)
    runner.trace.mark("filled", batch.batch_id)
    vidx = np.concatenate([np.arange(first[r], first[r] + counts[r] + 1) for r in grows.tolist()])
    rows = runner.staging.upload([vidx.astype(np.int64)])[0]
    disallowed = unpack_bitmask(bitmask.reshape(-1).view(np.uint8), len(vidx), vocab_size, runner.device)
    return (rows, disallowed), walked


def _grammar_accept(grammars, sel, walked: np.ndarray, acc: np.ndarray, first: np.ndarray, targets: list[int]):
    """After a verify step: the constrained chunks' matchers undo their walk over the drafts and
    accept the chunk's tokens (``targets[first[c]:first[c] + acc[c] + 1]``) in order. A chunk's
    tokens end at one that completes its grammar or that it refuses (``acc`` cut in place).
    Returns the sampling-chunk indices whose grammar completed and those whose last token was refused."""
    grows, slots, _ = sel
    grammars.rollback(slots, walked)
    np.minimum.at(acc, grows, walked)  # a draft the grammar refused is never accepted (its row disallows it)
    stopped, refused = [], []
    live = list(range(len(grows)))
    r = 0
    while live:
        toks = [targets[int(first[grows[i]]) + r] for i in live]
        st, rf = grammars.accept(slots[live], toks)
        ended = set()
        for j in st:
            stopped.append(int(grows[live[j]]))
            ended.add(live[j])
        for j in rf:
            refused.append(int(grows[live[j]]))
            ended.add(live[j])
        for i in ended:
            acc[grows[i]] = r  # the chunk's tokens end here
        r += 1
        live = [i for i in live if i not in ended and acc[grows[i]] >= r]
    return sorted(stopped), sorted(refused)
