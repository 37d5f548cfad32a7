"""Triton kernels of the CUDA path against plain PyTorch references. Runs on CUDA, or on the CPU
under TRITON_INTERPRET=1 (slow but exact); skipped when Triton is missing."""
from __future__ import annotations

import os
import random

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # run the kernels in Triton's CPU interpreter
triton = pytest.importorskip("triton")

from zpp.models.layers import triton_ops as ops  # noqa: E402

pytestmark = pytest.mark.slow  # the kernels under the Triton interpreter on the CPU: minutes

if not ON_GPU:
    # Triton 3.6's interpreter converts loaded scalars (numpy shape (1,)) with int(), which numpy 2
    # refuses; convert through .item() instead so `range(0, loaded_scalar, step)` works.
    import triton.runtime.interpreter as _ti
    _orig_patch = _ti._patch_lang_tensor

    def _patch(tensor, scope):
        _orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _ti._patch_lang_tensor = _patch

DEV = "cuda" if ON_GPU else "cpu"
DT = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-4


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def ref_attention(q, k_cache, v_cache, block_tables, seq_lens, q_lens, scale, window=None, sinks=None):
    """Plain softmax attention per sequence; ``window``: the query at position i sees keys
    i - window < j <= i (HF's sliding_window_overlay); ``sinks [Hq]``: one more logit per head in the
    softmax, with no value (HF gpt-oss's eager_attention_forward)."""
    out = torch.empty_like(q)
    bs = k_cache.shape[1]
    start = 0
    for i, (L, n) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(L)
        slots = torch.tensor(block_tables[i])[pos // bs] * bs + pos % bs
        k = k_cache.reshape(-1, *k_cache.shape[2:])[slots.to(k_cache.device)].float()   # [L, Hk, D]
        v = v_cache.reshape(-1, *v_cache.shape[2:])[slots.to(k_cache.device)].float()
        qq = q[start:start + n].float()                                                 # [n, Hq, D]
        G = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(G, 1)
        v = v.repeat_interleave(G, 1)
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = torch.arange(L - n, L)
        hidden = pos[None, :] > qpos[:, None]                                           # [n, L]
        if window is not None:
            hidden |= pos[None, :] <= qpos[:, None] - window
        s = s.masked_fill(hidden[None].to(s.device), float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(-1, 1, 1).expand(-1, n, 1).to(s.device)], -1)
            p = s.softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[start:start + n] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
        start += n
    return out


@pytest.mark.parametrize("hq,hk,d", [(4, 2, 64), (9, 3, 64), (8, 8, 32)])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunked", "decode-split"])
def test_paged_attention(hq, hk, d, mode):
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, nblocks = 16, 64
    kc = torch.randn(nblocks, bs, hk, d, device=DEV, dtype=DT)
    vc = torch.randn(nblocks, bs, hk, d, device=DEV, dtype=DT)
    B = 3
    if mode.startswith("decode"):
        q_lens = [1] * B
        seq_lens = [rng.randrange(1, 90) for _ in range(B)]
    elif mode == "prefill":
        q_lens = [rng.randrange(1, 70) for _ in range(B)]
        seq_lens = list(q_lens)
    else:
        q_lens = [rng.randrange(1, 40) for _ in range(B)]
        seq_lens = [n + rng.randrange(1, 50) for n in q_lens]
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range((L + bs - 1) // bs)] for L in seq_lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, device=DEV, dtype=DT)
    out = torch.full_like(q, float("nan"))
    block_m = ops.pick_block_m(max(q_lens), hq // hk)
    ts, tq = ops.attention_tiles(q_lens, max(1, block_m // (hq // hk)))
    qstart = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
    splits = 4 if mode == "decode-split" else 1
    ops.paged_attention(q, kc, vc, out, bt, i32(seq_lens), qstart, i32(ts), i32(tq), d ** -0.5, block_m, splits)
    ref = ref_attention(q, kc, vc, tables, seq_lens, q_lens, d ** -0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("split", [True, False])
def test_mixed_batch_attention_layer(split):
    """A micro-batch of decodes next to prompt chunks through the attention layer's Triton path:
    with ``split`` the decodes run in their own launch at the decode tile shape (the default), else
    all rows share the prefill tiles; both equal the reference, K/V written to the cache first."""
    from zpp.models.layers.attention import Attention, triton_metadata_arrays
    torch.manual_seed(0)
    rng = random.Random(2)
    hq, hk, d, bs, nblocks = 8, 2, 64, 16, 96
    kv = torch.randn(2, nblocks, bs, hk, d, device=DEV, dtype=DT)
    q_lens = [1, 37, 1, 1, 20, 1]
    seq_lens = [n + rng.randrange(0, 60) for n in q_lens]
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range((L + bs - 1) // bs)] for L in seq_lens]
    starts = [L - n for L, n in zip(seq_lens, q_lens)]
    host = triton_metadata_arrays(starts, q_lens, tables, bs, hq // hk, split_mixed=split, num_kv_heads=512)
    assert ("decode_tile_seq" in host.arrays) == split
    few = triton_metadata_arrays(starts, q_lens, tables, bs, hq // hk, split_mixed=True, num_kv_heads=hk)
    assert "decode_tile_seq" not in few.arrays  # 4 decodes x 2 heads: too small a launch to split
    # the block tables are TABLE_WIDTH_ALIGN columns wide whatever the longest sequence (one Triton
    # variant for every batch), zero past each sequence's blocks
    bt = host.arrays["block_tables"]
    assert bt.shape == (len(q_lens), 16) and not bt[:, -(-max(seq_lens) // bs):].any()
    meta = host.to_device([torch.from_numpy(a).to(DEV) for a in host.array_list()])
    T = sum(q_lens)
    q, k, v = (torch.randn(T, h * d, device=DEV, dtype=DT) for h in (hq, hk, hk))
    out = Attention(hq, d, hk)(q, k, v, kv, meta).view(T, hq, d)
    ref = ref_attention(q.view(T, hq, d), kv[0], kv[1], tables, seq_lens, q_lens, d ** -0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL


def test_rms_norm_and_residual():
    x = torch.randn(5, 96, device=DEV, dtype=DT)
    r = torch.randn(5, 96, device=DEV, dtype=DT)
    w = torch.randn(96, device=DEV, dtype=DT)
    y = ops.rms_norm(x, w, 1e-5)
    ref = lambda h: w * (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(DT)
    assert rel_err(y, ref(x)) < TOL
    y2, r2 = ops.rms_norm(x, w, 1e-5, r)
    assert rel_err(r2, x + r) < TOL and rel_err(y2, ref(x + r)) < TOL


def test_rope_and_cache():
    from zpp.models.layers.rotary import RotaryEmbedding
    T, hq, hk, d, bs = 6, 4, 2, 32, 16
    rope = RotaryEmbedding(d, 128, 10000.0).to(DEV)
    q = torch.randn(T, hq, d, device=DEV, dtype=DT)
    k = torch.randn(T, hk, d, device=DEV, dtype=DT)
    v = torch.randn(T, hk, d, device=DEV, dtype=DT)
    pos = torch.tensor([0, 5, 9, 17, 100, 3], device=DEV)
    slots = torch.tensor([3, 40, 7, 16, 63, 0], device=DEV)
    kc = torch.zeros(4, bs, hk, d, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    q_ref, k_ref = rope(pos, q.clone(), k.clone())
    q2 = q.clone()
    ops.rope_and_cache(q2, k, v, pos, rope.cos, rope.sin, kc, vc, slots)
    assert rel_err(q2, q_ref) < TOL
    assert rel_err(kc.view(-1, hk, d)[slots], k_ref) < TOL
    assert torch.equal(vc.view(-1, hk, d)[slots], v)


def test_silu_mul_and_gemv():
    x = torch.randn(3, 2 * 1100, device=DEV, dtype=DT)
    g, u = x.chunk(2, -1)
    assert rel_err(ops.silu_and_mul(x), torch.nn.functional.silu(g.float()) * u.float()) < TOL
    for m, n, k, bn, bk in ((1, 77, 700, 4, 256), (3, 77, 700, 8, 128), (4, 64, 512, 4, 256), (2, 48, 256, 16, 128)):
        a = torch.randn(m, k, device=DEV, dtype=DT)
        w = torch.randn(n, k, device=DEV, dtype=DT)
        b = torch.randn(n, device=DEV, dtype=DT)
        assert rel_err(ops.gemv(a, w, block_n=bn, block_k=bk), a.float() @ w.float().t()) < TOL, (m, n, k)
        assert rel_err(ops.gemv(a, w, b, block_n=bn, block_k=bk), a.float() @ w.float().t() + b.float()) < TOL
    with pytest.raises(ValueError, match="at most 4"):
        ops.gemv(torch.randn(5, 64, device=DEV, dtype=DT), torch.randn(8, 64, device=DEV, dtype=DT))


# --- sliding window and attention sinks -------------------------------------------------------------
def _random_batch(rng, q_lens, ctx_lens, hk, d, bs=16, nblocks=96):
    kc = torch.randn(nblocks, bs, hk, d, device=DEV, dtype=DT)
    vc = torch.randn(nblocks, bs, hk, d, device=DEV, dtype=DT)
    seq_lens = [n + c for n, c in zip(q_lens, ctx_lens)]
    free = list(range(nblocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range((L + bs - 1) // bs)] for L in seq_lens]
    return kc, vc, seq_lens, tables


@pytest.mark.parametrize("mode", ["decode", "decode-split", "prefill", "chunked", "mixed"])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_window_and_sinks(mode, window, with_sinks):
    """The Triton kernel with a sliding window (smaller than, equal to, larger than the contexts;
    1 = each query sees only itself) and / or sinks against the reference, at every tile shape:
    decode (with and without split-KV: the window's first key can fall in any split), prefill,
    chunked prefill whose chunks start inside / past the window, and decodes next to chunks."""
    torch.manual_seed(0)
    rng = random.Random(window * 7 + len(mode) + with_sinks)
    hq, hk, d = 8, 2, 32
    if mode.startswith("decode"):
        q_lens = [1, 1, 1, 1]
        ctx = [0, 15, 39, 87]                      # contexts shorter than, equal to, past the window
    elif mode == "prefill":
        q_lens, ctx = [40, 3, 70], [0, 0, 0]
    elif mode == "chunked":
        q_lens, ctx = [7, 33, 16], [9, 40, 16]
    else:
        q_lens, ctx = [1, 37, 1, 20], [50, 11, 3, 0]
    kc, vc, seq_lens, tables = _random_batch(rng, q_lens, ctx, hk, d)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, device=DEV, dtype=DT)
    sinks = (torch.randn(hq, device=DEV) * 2).to(DT) if with_sinks else None
    out = torch.full_like(q, float("nan"))
    block_m = ops.pick_block_m(max(q_lens), hq // hk)
    ts, tq = ops.attention_tiles(q_lens, max(1, block_m // (hq // hk)))
    qstart = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
    splits = 4 if mode == "decode-split" else 1
    ops.paged_attention(q, kc, vc, out, bt, i32(seq_lens), qstart, i32(ts), i32(tq), d ** -0.5, block_m, splits,
                        window=window, sinks=sinks)
    ref = ref_attention(q, kc, vc, tables, seq_lens, q_lens, d ** -0.5, window, sinks)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL
    if window >= max(seq_lens) and not with_sinks:  # a window past every context is plain attention
        full = torch.empty_like(q)
        ops.paged_attention(q, kc, vc, full, bt, i32(seq_lens), qstart, i32(ts), i32(tq), d ** -0.5, block_m, splits)
        assert torch.equal(out, full)


def test_window_skips_blocks_outside_it():
    """Keys wholly before the window are never read: NaN K/V there (which any read would spread
    through the softmax) leave the result equal to the reference over finite values."""
    torch.manual_seed(0)
    rng = random.Random(5)
    hq, hk, d, window = 4, 2, 32, 16
    for q_lens, ctx, splits in (([1, 1], [70, 100], 1), ([1, 1], [70, 100], 4), ([20], [64], 1)):
        kc, vc, seq_lens, tables = _random_batch(rng, q_lens, ctx, hk, d)
        block_m = ops.pick_block_m(max(q_lens), hq // hk)
        block_q = max(1, block_m // (hq // hk))
        ts, tq = ops.attention_tiles(q_lens, block_q)
        poisoned_k, poisoned_v = kc.clone(), vc.clone()
        for t, L, n in zip(tables, seq_lens, q_lens):
            first_key = L - n - window + 1  # the first query's first visible key
            for b in range(first_key // 16):  # blocks wholly before it
                poisoned_k[t[b]] = float("nan")
                poisoned_v[t[b]] = float("nan")
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
        qstart = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
        q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=DT)
        out = torch.empty_like(q)
        ops.paged_attention(q, poisoned_k, poisoned_v, out, bt, i32(seq_lens), qstart, i32(ts), i32(tq),
                            d ** -0.5, block_m, splits, window=window)
        ref = ref_attention(q, kc, vc, tables, seq_lens, q_lens, d ** -0.5, window)
        assert not out.isnan().any(), (q_lens, ctx, splits)
        assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("variant", ["gemma", "gpt-oss"])
def test_rms_norm_weight_orders(variant):
    """Gemma's ``(1 + weight)`` and gpt-oss's weight-in-float32 norms against HF's formulas, alone
    and with the residual added first (rounded to the model's dtype, as HF's ``residual + h``)."""
    x = torch.randn(5, 96, device=DEV, dtype=DT)
    r = torch.randn(5, 96, device=DEV, dtype=DT)
    w = torch.randn(96, device=DEV, dtype=DT)
    gemma = variant == "gemma"

    def ref(h):
        hf = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (hf * ((1.0 + w.float()) if gemma else w.float())).to(DT)

    kw = dict(offset=True) if gemma else dict(weight_in_float32=True)
    assert rel_err(ops.rms_norm(x, w, 1e-6, **kw), ref(x)) < TOL
    y, r2 = ops.rms_norm(x, w, 1e-6, r, **kw)
    assert torch.equal(r2, x + r) and rel_err(y, ref(x + r)) < TOL


def test_gemma_norm_module_triton_path():
    """GemmaRMSNorm's CUDA path equals its PyTorch path: on a [T, H, D] view of a strided q slice
    (the QK norm) and with a residual."""
    from zpp.models.layers.norm import GemmaRMSNorm
    norm = GemmaRMSNorm(16, 1e-6).to(DEV, DT)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    qkv = torch.randn(5, 8 * 16, device=DEV, dtype=DT)
    q = qkv[:, :4 * 16].reshape(5, 4, 16)                                    # strided rows
    assert rel_err(norm.triton_forward(q), norm._norm(q)) < TOL
    x, r = torch.randn(5, 16, device=DEV, dtype=DT), torch.randn(5, 16, device=DEV, dtype=DT)
    y, r2 = norm.triton_forward(x, r)
    assert torch.equal(r2, x + r) and rel_err(y, norm._norm(x + r)) < TOL


@pytest.mark.parametrize("d, rotary_dim", [(96, 96), (96, 72), (32, 24), (128, 96)])
def test_rope_and_cache_partial_rotary_and_longrope(d, rotary_dim):
    """Head sizes whose half is no power of two (Phi-3-mini's 96) and partial rotary (Phi-4-mini's
    0.75 of 128): rotated dims as the PyTorch path, pass-through dims of k (and all of v) copied as
    they are; with a LongRoPE table (short then long rows, attention factor) read at its rows."""
    from zpp.models.layers.rotary import RotaryEmbedding
    T, hq, hk, bs = 6, 4, 2, 16
    half = rotary_dim // 2
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
               "long_factor": [2.0 + 0.3 * i for i in range(half)], "original_max_position_embeddings": 32,
               "max_position_embeddings": 128}
    rope = RotaryEmbedding(d, 128, 10000.0, scaling, rotary_dim=rotary_dim).to(DEV)
    assert rope.cos.shape == (32 + 128, rotary_dim)
    q = torch.randn(T, hq, d, device=DEV, dtype=DT)
    k = torch.randn(T, hk, d, device=DEV, dtype=DT)
    v = torch.randn(T, hk, d, device=DEV, dtype=DT)
    pos = torch.tensor([0, 5, 9, 17, 100, 3], device=DEV)
    rows = rope.rope_rows(pos, torch.tensor([0, 1, 0, 1, 1, 1], device=DEV))
    assert rows.tolist() == [0, 37, 9, 49, 132, 35]
    slots = torch.tensor([3, 40, 7, 16, 63, 0], device=DEV)
    kc = torch.zeros(4, bs, hk, d, device=DEV, dtype=DT)
    vc = torch.zeros_like(kc)
    q_ref, k_ref = rope(rows, q.clone(), k.clone())
    q2 = q.clone()
    ops.rope_and_cache(q2, k, v, rows, rope.cos, rope.sin, kc, vc, slots)
    assert rel_err(q2, q_ref) < TOL
    assert torch.equal(q2[..., rotary_dim:], q[..., rotary_dim:])
    assert rel_err(kc.view(-1, hk, d)[slots], k_ref) < TOL
    assert torch.equal(kc.view(-1, hk, d)[slots][..., rotary_dim:], k[..., rotary_dim:])
    assert torch.equal(vc.view(-1, hk, d)[slots], v)


def test_block_table_width_and_graph_buffer_layout():
    """Eager batches and the decode graphs hand attention block tables of the same kind: a width
    that is a multiple of TABLE_WIDTH_ALIGN and, in the graphs' packed int32 buffer, a 128-byte
    aligned start (Triton compiles one kernel variant per integer class and pointer alignment)."""
    from zpp.models.layers.attention import TABLE_WIDTH_ALIGN, block_table_width
    from zpp.workers.staging import aligned_size
    assert TABLE_WIDTH_ALIGN == 16
    assert [block_table_width(n, 16, 16) for n in (0, 1, 16, 17, 256, 257, 4096)] == [16, 16, 16, 16, 16, 32, 256]
    assert [block_table_width(n, 16) for n in (0, 1, 16, 17, 257)] == [1, 1, 1, 2, 17]
    for B in (1, 7, 256, 1000, 1024, 2048):
        at = aligned_size(2 * B + 1)  # where DecodeGraphs puts its block tables
        assert at >= 2 * B + 1 and at % 32 == 0 and at - (2 * B + 1) < 32
