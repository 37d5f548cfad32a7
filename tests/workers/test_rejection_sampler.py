"""The result rank's verification of draft tokens (zpp.workers.rejection_sampler), in process: the
output distribution is the target's (statistical tests with stated tolerances), seeded requests
are reproducible and draw what plain decoding draws, and the general rejection sampler
(Leviathan et al. 2023) keeps a non-one-hot draft's output distribution on the target too."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from zpp.sampling_params import SamplingParams
from zpp.trace import Trace
from zpp.transport import messages as m
from zpp.workers.rejection_sampler import accepted_lengths, speculative_sample, verify, verify_rows
from zpp.workers.sampler import Sampler, SeqState
from zpp.workers.slots import SlotTable

V = 6
P0 = torch.tensor([0.15, 0.45, 0.20, 0.10, 0.07, 0.03])  # target after the known token
P1 = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.20, 0.20])  # target after the draft
DRAFT = 1


def _runner(sampling: SamplingParams, n: int = 1):
    """A result rank holding ``n`` requests (prompt [3, 4], slots 0..n-1) and a batch verifying one
    draft of each."""
    table = SlotTable(n, 32, 4)
    b = m.BatchBuilder()
    for s in range(n):
        b.new_request(s, f"r{s}", [3, 4], 2, [2 * s, 2 * s + 1], sampling)
        b.add(s, 1, 2, m.SAMPLE, drafts=[DRAFT])
    batch = b.build(0)
    cols = table.apply(batch)
    runner = SimpleNamespace(table=table, sampler=Sampler(torch.device("cpu"), seed=0), eos_token_ids={5},
                             trace=Trace("test"), grammars=None, _grammar_sel=None, busy_s=0.0, idle_s=0.0)
    return runner, batch, cols


def _verify_once(runner, batch, cols, logits):
    """Each chunk's tokens (``logits``: the two rows of one chunk, repeated for every chunk)."""
    n = cols.size
    res = verify(runner, batch, cols, logits.repeat(n, 1), list(range(0, 2 * n, 2)), np.arange(n), [])
    toks, counts = m.int32s(res.tokens).tolist(), m.int32s(res.token_counts).tolist()
    ends = np.cumsum(counts).tolist()
    out = [toks[e - c:e] for c, e in zip(counts, ends)]
    return out[0] if n == 1 else out


def test_one_hot_drafts_keep_the_target_distribution():
    """20000 verifications of one draft (temperature 1): the draft is accepted with probability
    p0(draft) (within 4 standard errors), the first output token is distributed as p0, the token
    after an accepted draft as p1, and a rejected draft's replacement as norm(max(p0 - e_draft, 0)):
    each within a total-variation distance of 0.03 (the expected TV of 20000 samples over 6 tokens
    is about 0.005, of the ~9000 after an accepted draft about 0.008, of the ~11000 rejected ones
    about 0.006)."""
    runner, batch, cols = _runner(SamplingParams(temperature=1.0, max_tokens=10), 500)
    logits = torch.stack([P0.log(), P1.log()])
    N = 20000
    first, second, rejected = np.zeros(V), np.zeros(V), np.zeros(V)
    accepted = 0
    for toks in (t for _ in range(N // 500) for t in _verify_once(runner, batch, cols, logits)):
        first[toks[0]] += 1
        if len(toks) == 2:
            accepted += 1
            second[toks[1]] += 1
        else:
            rejected[toks[0]] += 1
    p = float(P0[DRAFT])
    assert abs(accepted / N - p) < 4 * (p * (1 - p) / N) ** 0.5
    tv = lambda counts, q: 0.5 * np.abs(counts / counts.sum() - q.numpy()).sum()  # noqa: E731
    residual = P0.clone()
    residual[DRAFT] = 0
    assert tv(first, P0) < 0.03 and tv(second, P1) < 0.03 and tv(rejected, residual / residual.sum()) < 0.03


def test_seeded_verification_is_reproducible_and_draws_what_decoding_draws():
    """A seeded request's verify step gives the same tokens every time, and they are the tokens
    plain seeded decoding samples at those output positions (so its output does not depend on the
    drafts), over 200 seeds."""
    logits = torch.stack([P0.log(), P1.log()])
    plain = Sampler(torch.device("cpu"))
    for seed in range(200):
        sp = SamplingParams(temperature=0.9, seed=seed, max_tokens=10)
        runner, batch, cols = _runner(sp)
        a, b = _verify_once(runner, batch, cols, logits), _verify_once(runner, batch, cols, logits)
        assert a == b
        t0 = plain(logits[:1].clone(), [SeqState([3, 4], 2, sp)], {5})[0][0]
        assert a[0] == t0
        if len(a) == 2:
            assert t0 == DRAFT and a[1] == plain(logits[1:].clone(), [SeqState([3, 4, DRAFT], 2, sp)], {5})[0][0]


def test_general_rejection_sampler_keeps_the_target_distribution():
    """Leviathan et al.'s rule with a draft model's q (not one-hot): drafts drawn from q, output
    distributed as p within a total-variation distance of 0.02 over 20000 draws, acceptance rate
    sum(min(p, q)) within 4 standard errors."""
    g = torch.Generator().manual_seed(1)
    q = torch.tensor([0.05, 0.45, 0.10, 0.10, 0.10, 0.20])
    N, counts, acc = 20000, np.zeros(V), 0
    drafts = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    us = torch.rand(N, generator=g).tolist()
    for d, u in zip(drafts, us):
        t, ok = speculative_sample(P0, d, q, u, g)
        counts[t] += 1
        acc += ok
    expect = float(torch.minimum(P0, q).sum())
    assert abs(acc / N - expect) < 4 * (expect * (1 - expect) / N) ** 0.5
    assert 0.5 * np.abs(counts / N - P0.numpy()).sum() < 0.02


def test_accepted_lengths_and_rows():
    # chunks: 2 drafts (both match), 0 drafts, 3 drafts (second differs)
    targets = np.array([7, 8, 9, 4, 1, 2, 3, 6])
    drafts = np.array([7, 8, 1, 5, 3])
    assert accepted_lengths(targets, drafts, np.array([2, 0, 3])).tolist() == [2, 0, 1]
    assert verify_rows(np.array([0, 10, 20]), np.array([2, 0, 3])).tolist() == [0, 1, 2, 10, 20, 21, 22, 23]
