"""The portable (CPU, SDPA) attention path with sliding windows and attention sinks, against a
plain softmax reference: the per-window views of one micro-batch's metadata (built once, shared by
every layer with that window), mixed batches split into several SDPA groups, chunks that start
before, inside and past the window, and the sink column."""
from __future__ import annotations

import random

import pytest
import torch

from zpp.models.layers.attention import Attention, build_attention_metadata


def reference(q, k_cache, v_cache, tables, seq_lens, q_lens, scale, window=None, sinks=None):
    """``q [T, Hq, D]`` -> ``[T, Hq, D]``: each sequence's new tokens over its context, causal,
    keys ``i - window < j <= i`` with a window, ``sinks [Hq]`` as one more logit without value."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    start = 0
    for i, (L, n) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(L)
        slots = torch.tensor(tables[i])[pos // bs] * bs + pos % bs
        G = q.shape[1] // k_cache.shape[2]
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double().repeat_interleave(G, 1)   # [L, Hq, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double().repeat_interleave(G, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), k) * scale
        qpos = torch.arange(L - n, L)
        hidden = pos[None, :] > qpos[:, None]
        if window is not None:
            hidden |= pos[None, :] <= qpos[:, None] - window
        s = s.masked_fill(hidden[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], -1)
            p = s.softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[start:start + n] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
        start += n
    return out


BATCHES = {
    "prefill-alone": ([45], [0]),                 # one sequence from 0 (the plain-causal group)
    "decodes": ([1, 1, 1, 1], [0, 7, 8, 93]),
    "chunks": ([5, 30, 9], [3, 40, 8]),           # chunks smaller than / crossing the window
    "mixed": ([1, 60, 1, 20, 1], [200, 0, 3, 70, 31]),  # several SDPA groups
}


@pytest.mark.slow
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("window", [None, 1, 8, 16, 33, 500])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sdpa_path_window_and_sinks(batch, window, with_sinks):
    torch.manual_seed(0)
    rng = random.Random(hash((batch, window, with_sinks)) & 0xFFFF)
    hq, hk, d, bs, nblocks = 6, 2, 16, 8, 128
    q_lens, ctx = BATCHES[batch]
    seq_lens = [n + c for n, c in zip(q_lens, ctx)]
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-L // bs))] for L in seq_lens]
    kv = torch.randn(2, nblocks, bs, hk, d)
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h * d) for h in (hq, hk, hk))
    sinks = torch.randn(hq) * 2 if with_sinks else None
    meta = build_attention_metadata(ctx, q_lens, tables, bs, torch.device("cpu"), hq // hk)
    attn = Attention(hq, d, hk, scale=0.3, sliding_window=window)
    out = attn(q, k, v, kv, meta, sinks=sinks).view(T, hq, d)
    # The new tokens' K/V were written to the cache first; the reference reads them there.
    ref = reference(q.view(T, hq, d), kv[0], kv[1], tables, seq_lens, q_lens, 0.3, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # A second layer with the same window reuses the views built by the first.
    views = [dict(g.views) for g in meta.groups]
    again = attn(q, k, v, kv, meta, sinks=sinks)
    assert torch.equal(again.view(T, hq, d), out)
    assert all(g.views.keys() == vw.keys() and all(g.views[x] is vw[x] for x in vw) for g, vw in zip(meta.groups, views))


def test_window_view_reads_only_blocks_in_the_window():
    """A decode at position 93 with window 8 gathers the blocks from its window's first key on,
    not its 12 blocks of context; NaN in the blocks before leave the output finite."""
    hq, hk, d, bs = 2, 1, 8, 8
    tables = [list(range(12))]
    kv = torch.randn(2, 13, bs, hk, d)
    kv[:, :10] = float("nan")                      # keys 0..79; the window is 86..93
    meta = build_attention_metadata([93], [1], tables, bs, torch.device("cpu"), hq // hk)
    attn = Attention(hq, d, hk, sliding_window=8)
    out = attn(torch.randn(1, hq * d), torch.randn(1, hk * d), torch.randn(1, hk * d), kv, meta)
    assert torch.isfinite(out).all()
    view = meta.groups[0].view(8, False)
    assert view.ctx_blocks.tolist() == [[10, 11]] and view.num_keys == 14
