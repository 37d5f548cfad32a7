"""W4A16 kernels (zpp.models.quantization.w4a16_kernels) against the layout's reference
dequantization (zpp.models.quantization.w4_layout.dequantize_w4) and a float32 torch matmul: the
dense GEMV and GEMM, the grouped expert GEMV and GEMM on moe_align's sorted layout and the whole MoE
feed-forward (SiLU; gpt-oss's clamped SwiGLU with expert biases), both formats (int4 with and
without zero points, mxfp4 with E8M0 scales), group sizes 32 and 128, ragged M / N / K. On the CPU
under TRITON_INTERPRET=1 (tiny shapes), on CUDA as they are."""
from __future__ import annotations

import pytest
import torch

from test_triton_ops import DEV, ON_GPU, rel_err  # noqa: F401  (sets TRITON_INTERPRET on the CPU, its fixes)

triton = pytest.importorskip("triton")

from zpp.models.layers.fused_moe import moe_align  # noqa: E402
from zpp.models.layers.moe import ClampedSwiGLU, GatedActivation  # noqa: E402
from zpp.models.quantization import w4a16_kernels as W  # noqa: E402
from zpp.models.quantization.w4_layout import dequantize_w4  # noqa: E402

DT = torch.bfloat16 if ON_GPU else torch.float32  # the interpreter's tl.dot has no bf16
SDT = torch.bfloat16  # int4 scales
# (fmt, group size, zero points): int4 symmetric / asymmetric, mxfp4
KINDS = [("int4", 32, False), ("int4", 128, True), ("mxfp4", 32, False), ("int4", 32, True), ("mxfp4", 128, False)]


def random_w4(shape, fmt, group_size, zeros, seed):
    """Random 4-bit weight ``shape = (.., N, K)`` in the w4_layout: (qweight, scales, zeros)."""
    g = torch.Generator().manual_seed(seed)
    *lead, N, K = shape
    q = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8)
    gs = (*lead, N, K // group_size)
    if fmt == "mxfp4":
        s = torch.randint(119, 125, gs, generator=g, dtype=torch.uint8)         # 2**-8 .. 2**-3
        z = None
    else:
        s = (torch.rand(gs, generator=g) * 0.02 + 0.005).to(SDT)
        z = torch.randint(0, 16, gs, generator=g, dtype=torch.uint8) if zeros else None
    return q.to(DEV), s.to(DEV), (z.to(DEV) if z is not None else None)


def ref(x, q, s, z, G, fmt, bias=None):
    w = dequantize_w4(q, s, z, G, fmt, torch.float32)
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("fmt,G,zeros", KINDS)
@pytest.mark.parametrize("M", [1, 3, 4])
def test_gemv(fmt, G, zeros, M):
    N, K = 20, 384 if G == 128 else 96                     # ragged N (block_n 8), K not a block_k multiple
    q, s, z = random_w4((N, K), fmt, G, zeros, seed=M)
    x = torch.randn(M, K, device=DEV).to(DT)
    bias = torch.randn(N, device=DEV).to(DT) if M == 3 else None
    y = W.w4a16_gemv(x, q, s, z, G, fmt, bias, block_n=8, block_k=256, x_split=M == 4, fast_cvt=M != 1)
    assert y.shape == (M, N) and y.dtype == DT
    assert rel_err(y, ref(x, q, s, z, G, fmt, bias)) < 1e-2


WORD_LAUNCHES = [  # the word-wise GEMV's layouts and options (w4a16_gemv.py)
    dict(block_n=8, block_k=64),                                  # one word a thread, ragged N and K
    dict(block_n=8, block_k=128, split_k=2, prefetch=True),       # split-K (last program reduces), prefetch
    dict(block_n=4, block_k=256, split_k=3, vec=True, prefetch=True),  # four words a thread, uneven split
]


@pytest.mark.parametrize("fmt,G,zeros", KINDS)
@pytest.mark.parametrize("M,launch", [(1, 0), (3, 1), (4, 2), (2, 1)])
def test_gemv_words(fmt, G, zeros, M, launch):
    N, K = 20, 768 if G == 128 else 352                   # ragged N; K not a multiple of block_k
    q, s, z = random_w4((N, K), fmt, G, zeros, seed=10 + M)
    x = torch.randn(M, K, device=DEV).to(DT)
    bias = torch.randn(N, device=DEV).to(DT) if M == 3 else None
    y = W.w4a16_gemv(x, q, s, z, G, fmt, bias, words=True, **WORD_LAUNCHES[launch])
    assert y.shape == (M, N) and y.dtype == DT
    assert rel_err(y, ref(x, q, s, z, G, fmt, bias)) < 1e-2
    if launch == 1:   # the split-K counters are left at zero: a second launch gives the same result
        assert torch.equal(W.w4a16_gemv(x, q, s, z, G, fmt, bias, words=True, **WORD_LAUNCHES[launch]), y)


def test_gemv_words_decodes_every_code_exactly():
    """Each of the 16 codes in each nibble position of a word, int4 and mxfp4, against the reference
    dequantization: one-hot activations read single weights back (exact: one product a row)."""
    K = 32
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)                       # [32]: 0..15 twice
    rows = torch.stack([codes.roll(r) for r in range(16)])                      # every code at every column
    q = (rows[:, 0::2] | (rows[:, 1::2] << 4)).to(DEV)                          # [16, 16]
    eye = torch.eye(K, device=DEV).to(DT)
    for fmt, s in (("int4", torch.full((16, 1), 0.5, dtype=SDT)), ("mxfp4", torch.full((16, 1), 127, dtype=torch.uint8))):
        s = s.to(DEV)
        w = dequantize_w4(q, s, None, 32, fmt, torch.float32)
        for c in range(0, K, 4):
            y = W.w4a16_gemv(eye[c:c + 4], q, s, None, 32, fmt, words=True, block_n=8, block_k=32)
            assert torch.equal(y.float(), w[:, c:c + 4].t())


@pytest.mark.parametrize("fmt,G,zeros", KINDS)
def test_gemm(fmt, G, zeros):
    M, N, K = 37, 48, 384 if G == 128 else 160             # ragged M, N past a tile, K past a tile
    q, s, z = random_w4((N, K), fmt, G, zeros, seed=1)
    x = torch.randn(M, K, device=DEV).to(DT)
    bias = torch.randn(N, device=DEV).to(DT)
    cfg = dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, fast_cvt=zeros)
    y = W.w4a16_gemm(x, q, s, z, G, fmt, bias, config=cfg)
    assert rel_err(y, ref(x, q, s, z, G, fmt, bias)) < 1e-2
    # the dispatcher: 2 rows -> GEMV, 5 -> GEMM, same numbers as the reference
    for m in (2, 5):
        assert rel_err(W.w4a16_linear(x[:m], q, s, z, G, fmt), ref(x[:m], q, s, z, G, fmt)) < 1e-2


def _routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEV)
    w = torch.rand(T, k, generator=g).to(DEV)
    return w / w.sum(1, keepdim=True), ids


def _moe_ref(x, gu, dn, G, fmt, weights, ids, act, b_gu=None, b_dn=None):
    wg, wd = dequantize_w4(*gu, G, fmt, torch.float32), dequantize_w4(*dn, G, fmt, torch.float32)
    T, k = ids.shape
    out = torch.zeros(T, x.shape[1], device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g = x[t].float() @ wg[e].t() + (b_gu[e].float() if b_gu is not None else 0)
            y = act(g[None])[0] @ wd[e].t() + (b_dn[e].float() if b_dn is not None else 0)
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("fmt,G,zeros", KINDS[:3])
def test_moe_gemm_and_gemv_kernels(fmt, G, zeros):
    E, N, K, T, k = 4, 24, 256 if G == 128 else 96, 7, 2
    q, s, z = random_w4((E, N, K), fmt, G, zeros, seed=3)
    x = torch.randn(T, K, device=DEV).to(DT)
    rw, ids = _routing(T, E, k, seed=4)
    bias = torch.randn(E, N, device=DEV).to(DT)
    wf = dequantize_w4(q, s, z, G, fmt, torch.float32)
    flat = ids.reshape(-1)
    want = torch.stack([x[a // k].float() @ wf[flat[a]].t() + bias[flat[a]].float() for a in range(T * k)])
    want = want * rw.reshape(-1, 1)
    out = torch.empty(T * k, N, device=DEV, dtype=DT)
    W.moe_w4a16_gemv(x, q, s, z, G, fmt, flat, out, bias, rw.reshape(-1).float(), k,
                     dict(block_n=8, block_k=64, num_warps=4, fast_cvt=True))
    assert rel_err(out, want) < 1e-2
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=2, fast_cvt=True)
    sorted_ids, block_expert = moe_align(ids, E, cfg["BLOCK_M"])
    out2 = torch.empty_like(out)
    W.moe_w4a16_gemm(x, q, s, z, G, fmt, out2, sorted_ids, block_expert, bias, rw.reshape(-1).float(), k, cfg)
    assert rel_err(out2, want) < 1e-2


@pytest.mark.slow  # seconds of interpreter
@pytest.mark.parametrize("fmt,G,zeros,gpt_oss", [("int4", 32, True, False), ("mxfp4", 32, False, True)])
@pytest.mark.parametrize("gemv", [True, False])
def test_fused_moe_w4a16(fmt, G, zeros, gpt_oss, gemv):
    E, H, I, T, k = 4, 64, 32, 5, 2
    gu = random_w4((E, 2 * I, H), fmt, G, zeros, seed=5)
    dn = random_w4((E, H, I), fmt, G, zeros, seed=6)
    x = torch.randn(T, H, device=DEV).to(DT)
    rw, ids = _routing(T, E, k, seed=7)
    act = ClampedSwiGLU(1.702, 7.0) if gpt_oss else GatedActivation("silu")
    b_gu = torch.randn(E, 2 * I, device=DEV).to(DT) if gpt_oss else None
    b_dn = torch.randn(E, H, device=DEV).to(DT) if gpt_oss else None
    y = W.fused_moe_w4a16(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn, config={"gemv": gemv})
    assert y.shape == (T, H) and y.dtype == DT
    assert rel_err(y, _moe_ref(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn)) < 2e-2


def test_bad_layout_is_refused():
    q, s, z = random_w4((8, 64), "int4", 32, True, seed=0)
    x = torch.randn(1, 64, device=DEV).to(DT)
    with pytest.raises(ValueError, match="group size"):
        W.w4a16_gemv(x, q, s, z, 16, "int4")
    with pytest.raises(ValueError, match="mxfp4 takes uint8"):
        W.w4a16_gemv(x, q, s, None, 32, "mxfp4")
    with pytest.raises(ValueError, match="unknown 4-bit format"):
        W.w4a16_gemv(x, q, s, z, 32, "nf4")
    with pytest.raises(ValueError, match="at most 4 rows"):
        W.w4a16_gemv(torch.randn(5, 64, device=DEV).to(DT), q, s, z, 32, "int4")
