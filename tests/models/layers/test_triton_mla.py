"""The paged-attention kernel with shared K/V rows (multi-head latent attention, DeepSeek's latent
cache: each cached row is ``[kv_c | k_pe]``, keys are the whole row, values its first ``kv_lora_rank``
dims) against a PyTorch reference, directly and through the attention layer's Triton path. Runs on
CUDA, or on the CPU under TRITON_INTERPRET=1 (set by ``test_triton_ops``)."""
from __future__ import annotations

import random

import pytest
import torch

from test_triton_ops import DEV, DT, TOL, ops, rel_err

pytestmark = pytest.mark.slow  # the kernels under the Triton interpreter on the CPU: minutes


def ref_latent_attention(q, cache, block_tables, seq_lens, q_lens, dv, scale):
    """``q [T, H, D]``, ``cache [N, bs, 1, D]`` -> ``[T, H, dv]``: causal attention with K = the rows,
    V = their first ``dv`` dims, in float32."""
    out = q.new_empty(q.shape[0], q.shape[1], dv)
    bs = cache.shape[1]
    start = 0
    for i, (L, n) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(L)
        slots = torch.tensor(block_tables[i])[pos // bs] * bs + pos % bs
        rows = cache.reshape(-1, cache.shape[-1])[slots.to(cache.device)].float()   # [L, D]
        qq = q[start:start + n].float()                                              # [n, H, D]
        s = torch.einsum("qhd,kd->hqk", qq, rows) * scale
        qpos = torch.arange(L - n, L)
        s = s.masked_fill(pos[None, None, :].to(s.device) > qpos[None, :, None].to(s.device), float("-inf"))
        out[start:start + n] = torch.einsum("hqk,kd->qhd", s.softmax(-1), rows[:, :dv]).to(q.dtype)
        start += n
    return out


def _tables(rng, seq_lens, bs, nblocks):
    free = list(range(nblocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range((L + bs - 1) // bs)] for L in seq_lens]


@pytest.mark.parametrize("h,dv,dr", [(4, 32, 16), (16, 64, 32), (3, 48, 8)])
@pytest.mark.parametrize("mode", ["decode", "prefill", "chunked", "decode-split"])
def test_paged_attention_shared_rows(h, dv, dr, mode):
    torch.manual_seed(0)
    rng = random.Random(1)
    bs, nblocks, B = 16, 48, 3
    d = dv + dr
    cache = torch.randn(nblocks, bs, 1, d, device=DEV, dtype=DT)
    if mode.startswith("decode"):
        q_lens, seq_lens = [1] * B, [rng.randrange(1, 90) for _ in range(B)]
    elif mode == "prefill":
        q_lens = [rng.randrange(1, 60) for _ in range(B)]
        seq_lens = list(q_lens)
    else:
        q_lens = [rng.randrange(1, 40) for _ in range(B)]
        seq_lens = [n + rng.randrange(1, 50) for n in q_lens]
    tables = _tables(rng, seq_lens, bs, nblocks)
    width = max(len(t) for t in tables)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
    bt = i32([t + [0] * (width - len(t)) for t in tables])
    T = sum(q_lens)
    q = torch.randn(T, h, d, device=DEV, dtype=DT)
    out = torch.full((T, h, dv), float("nan"), device=DEV, dtype=DT)
    block_m = ops.pick_block_m(max(q_lens), h)
    ts, tq = ops.attention_tiles(q_lens, max(1, block_m // h))
    qstart = i32([0] + torch.tensor(q_lens).cumsum(0).tolist())
    splits = 4 if mode == "decode-split" else 1
    scale = 0.7 * d ** -0.5
    ops.paged_attention(q, cache, cache, out, bt, i32(seq_lens), qstart, i32(ts), i32(tq), scale, block_m, splits)
    ref = ref_latent_attention(q, cache, tables, seq_lens, q_lens, dv, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL


def test_shared_rows_need_one_cache():
    q = torch.zeros(1, 2, 48, device=DEV, dtype=DT)
    c = torch.zeros(2, 16, 1, 48, device=DEV, dtype=DT)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="v_cache to be k_cache"):
        ops.paged_attention(q, c, c.clone(), q.new_empty(1, 2, 32), i32([[0]]), i32([1]), i32([0, 1]), i32([0]),
                            i32([0]), 1.0, 16)


@pytest.mark.parametrize("h,split", [(4, True), (32, True), (48, False), (48, True), (32, "decode")])
def test_latent_attention_layer_triton_equals_cpu_path(h, split):
    """The attention layer in shared-row mode (``v=None``): the Triton path (cache write + kernel,
    decodes apart from prompt chunks or not; more than 16 heads: one launch per 16 heads) gives the
    CPU path's (SDPA) output and cache contents."""
    from zpp.models.layers.attention import Attention, build_attention_metadata, triton_metadata_arrays
    torch.manual_seed(0)
    rng = random.Random(3)
    dv, dr, bs, nblocks = 32, 16, 16, 40
    d = dv + dr
    q_lens = [1, 1, 1, 1] if split == "decode" else [1, 23, 1, 9]  # decode: flash-decoding splits
    seq_lens = [n + rng.randrange(0, 40) for n in q_lens]
    starts = [L - n for L, n in zip(seq_lens, q_lens)]
    tables = _tables(rng, seq_lens, bs, nblocks)
    T = sum(q_lens)
    q = torch.randn(T, h * d, dtype=DT)
    k = torch.randn(T, d, dtype=DT)
    base = torch.randn(nblocks, bs, 1, d, dtype=DT)
    attn = Attention(h, d, 1, scale=0.3, v_head_dim=dv)
    cpu_cache = base.clone()
    cpu_out = attn(q, k, None, cpu_cache, build_attention_metadata(starts, q_lens, tables, bs, torch.device("cpu")))
    host = triton_metadata_arrays(starts, q_lens, tables, bs, h, split_mixed=bool(split), num_kv_heads=512)
    assert ("decode_tile_seq" in host.arrays) == (split is True)
    meta = host.to_device([torch.from_numpy(a).to(DEV) for a in host.array_list()])
    dev_cache = base.to(DEV)
    dev_out = attn(q.to(DEV), k.to(DEV), None, dev_cache, meta)
    assert dev_out.shape == (T, h * dv)
    assert rel_err(dev_out.cpu(), cpu_out) < TOL
    assert torch.equal(dev_cache.cpu(), cpu_cache)
