"""W4A16 methods (zpp.models.quantization.w4a16): parameters and loaders of 4-bit linear layers
(plain, merged qkv column-parallel, row-parallel) and experts (per-expert shards and fused tensors,
the hf and gpt_oss layouts, tensor-parallel slices, gpt-oss's biases and clamped SwiGLU), checked on
the CPU path (weights dequantized in the forward) against the same layers in float32 loaded with the
dequantized weights; tensor-parallel partials add up to the TP=1 output. The kernels themselves:
test_w4a16_kernels.py."""
from __future__ import annotations

import pytest
import torch

from zpp.models.layers.linear import Linear, MergedLinear, RowParallelLinear
from zpp.models.layers.moe import ClampedSwiGLU, FusedExperts
from zpp.models.quantization.w4_layout import dequantize_w4
from zpp.models.quantization.w4a16 import W4A16LinearMethod, W4A16MoEMethod

KINDS = [("int4", 32, True), ("int4", 128, False), ("mxfp4", 32, False)]


def rand_w4(shape, fmt, G, zeros, seed):
    g = torch.Generator().manual_seed(seed)
    *lead, N, K = shape
    q = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8)
    gs = (*lead, N, K // G)
    if fmt == "mxfp4":
        return q, torch.randint(119, 125, gs, generator=g, dtype=torch.uint8), None
    s = (torch.rand(gs, generator=g) * 0.02 + 0.005).to(torch.float16)         # converted on load
    return q, s, (torch.randint(0, 16, gs, generator=g, dtype=torch.uint8) if zeros else None)


def load(mod, w4, shard=None):
    for name, t in zip(("qweight", "scales", "zeros"), w4):
        if t is not None:
            p = getattr(mod, name)
            p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)


def deq(w4, G, fmt):
    return dequantize_w4(*w4, G, fmt, torch.float32)


@pytest.mark.parametrize("fmt,G,zeros", KINDS)
def test_linear_layers(fmt, G, zeros):
    K = 256
    x = torch.randn(3, K)
    # plain, with bias
    lin = Linear(K, 48, bias=True)
    lin.bias.data.normal_()
    W4A16LinearMethod(fmt, G, zeros).create_weights(lin)
    assert lin.weight is None and lin.qweight.dtype == torch.uint8 and lin.qweight.shape == (48, K // 2)
    assert (lin.zeros is not None) == zeros and "weight" not in dict(lin.named_parameters())
    w = rand_w4((48, K), fmt, G, zeros, 0)
    load(lin, w)
    torch.testing.assert_close(lin(x), x @ deq(w, G, fmt).t() + lin.bias, rtol=1e-5, atol=1e-5)
    # merged qkv, column-parallel rank 1 of 2: its rows of each shard
    sizes = [64, 32, 32]
    shards = [rand_w4((n, K), fmt, G, zeros, 1 + i) for i, n in enumerate(sizes)]
    full = torch.cat([deq(s, G, fmt) for s in shards])
    rows = torch.cat([torch.arange(o + n // 2, o + n) for o, n in zip((0, 64, 96), sizes)])
    for tp_rank, tp_size in ((1, 2), (0, 1)):
        qkv = MergedLinear(K, sizes, tp_rank=tp_rank, tp_size=tp_size)
        W4A16LinearMethod(fmt, G, zeros).create_weights(qkv)
        for i, s in enumerate(shards):
            load(qkv, s, i)
        want = full[rows] if tp_size == 2 else full
        torch.testing.assert_close(qkv(x), x @ want.t(), rtol=1e-5, atol=1e-5)
    # row-parallel: the partials of both ranks add up to the whole product
    w = rand_w4((40, 2 * K), fmt, G, zeros, 9)
    x2 = torch.randn(3, 2 * K)
    parts = []
    for r in range(2):
        row = RowParallelLinear(2 * K, 40, tp_rank=r, tp_size=2)
        W4A16LinearMethod(fmt, G, zeros).create_weights(row)
        load(row, w)
        parts.append(row(x2[:, r * K:(r + 1) * K], reduce=False))
    torch.testing.assert_close(parts[0] + parts[1], x2 @ deq(w, G, fmt).t(), rtol=1e-4, atol=1e-4)


def test_linear_refusals():
    with pytest.raises(ValueError, match="group size 16"):
        W4A16LinearMethod("int4", 16)
    with pytest.raises(ValueError, match="zero points"):
        W4A16LinearMethod("mxfp4", 32, zeros=True)
    with pytest.raises(ValueError, match="cannot hold 4-bit"):
        W4A16LinearMethod("int4", 128).create_weights(Linear(96, 8))
    lin = Linear(64, 8)
    W4A16LinearMethod("int4", 32).create_weights(lin)
    with pytest.raises(ValueError, match="shape mismatch"):
        lin.qweight.weight_loader(lin.qweight, torch.zeros(8, 64, dtype=torch.uint8))


def _bf16_experts_like(E, H, I, w_gu, w_dn, b_gu, b_dn, act):
    """Float32 FusedExperts (hf layout) with the dequantized weights, TP = 1: the reference."""
    ref = FusedExperts(E, H, I, act, bias=True)
    ref.gate_up_proj.data.copy_(w_gu)
    ref.down_proj.data.copy_(w_dn)
    ref.gate_up_proj_bias.data.copy_(b_gu)
    ref.down_proj_bias.data.copy_(b_dn)
    return ref


@pytest.mark.parametrize("fmt,G,zeros", KINDS)
@pytest.mark.parametrize("layout", ["hf", "gpt_oss"])
def test_experts(fmt, G, zeros, layout):
    E, H, I, T, k = 4, 128, 256, 6, 2
    act = ClampedSwiGLU(1.702, 7.0)
    gu = rand_w4((E, 2 * I, H), fmt, G, zeros, 1)                     # rows gate | up (hf)
    dn = rand_w4((E, H, I), fmt, G, zeros, 2)
    b_gu, b_dn = torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1
    ref = _bf16_experts_like(E, H, I, deq(gu, G, fmt), deq(dn, G, fmt), b_gu, b_dn, act)
    x = torch.randn(T, H)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    rw = torch.rand(T, k, generator=g).softmax(1)
    want = ref(x, rw, ids)
    if layout == "gpt_oss":   # the fused checkpoint interleaves gate and up rows (and bias columns)
        inter = lambda t: torch.stack([t[:, :I], t[:, I:]], dim=2).flatten(1, 2)
        gu_ck = tuple(inter(t) if t is not None else None for t in gu)
        b_gu_ck = inter(b_gu)
    else:
        gu_ck, b_gu_ck = gu, b_gu
    outs = []
    for r in range(2):
        ex = FusedExperts(E, H, I, act, bias=True, tp_rank=r, tp_size=2, checkpoint_layout=layout)
        W4A16MoEMethod(fmt, G, zeros).create_weights(ex)
        assert ex.gate_up_proj is None and ex.gate_up_proj_qweight.shape == (E, I, H // 2)
        assert ex.down_proj_scales.shape == (E, H, I // 2 // G)
        for name, t in zip(("qweight", "scales", "zeros"), gu_ck):
            if t is not None:
                p = getattr(ex, f"gate_up_proj_{name}")
                p.weight_loader(p, t)
        if layout == "hf":     # down per expert shard, the rest fused
            for name, t in zip(("qweight", "scales", "zeros"), dn):
                if t is not None:
                    p = getattr(ex, f"down_proj_{name}")
                    for e in range(E):
                        p.weight_loader(p, t[e], e)
        else:
            for name, t in zip(("qweight", "scales", "zeros"), dn):
                if t is not None:
                    p = getattr(ex, f"down_proj_{name}")
                    p.weight_loader(p, t)
        ex.gate_up_proj_bias.weight_loader(ex.gate_up_proj_bias, b_gu_ck)
        ex.down_proj_bias.weight_loader(ex.down_proj_bias, b_dn)
        outs.append(ex(x, rw, ids, reduce=False))
    torch.testing.assert_close(outs[0] + outs[1], want, rtol=1e-4, atol=1e-4)


def test_experts_per_expert_gate_up_and_warmup_variants():
    from zpp.models.layers.moe_warmup import moe_variant, warmup_token_counts
    E, H, I, G = 4, 64, 64, 32
    ex = FusedExperts(E, H, I, "silu")
    W4A16MoEMethod("int4", G, True).create_weights(ex)
    gate, up = rand_w4((E, I, H), "int4", G, True, 5), rand_w4((E, I, H), "int4", G, True, 6)
    for name, tg, tu in zip(("qweight", "scales", "zeros"), gate, up):
        p = getattr(ex, f"gate_up_proj_{name}")
        for e in range(E):
            p.weight_loader(p, tg[e], 2 * e)
            p.weight_loader(p, tu[e], 2 * e + 1)
    wg, _ = ex.quant_method.dequantized(ex, torch.float32)
    torch.testing.assert_close(wg, torch.cat([deq(gate, G, "int4"), deq(up, G, "int4")], dim=1))
    with pytest.raises(ValueError, match="expert 4 out of range"):
        ex.gate_up_proj_qweight.weight_loader(ex.gate_up_proj_qweight, gate[0][0], 8)
    assert moe_variant(ex, 1, 2) == ("w4-gemv",)
    assert moe_variant(ex, 512, 2)[0] == "w4-gemm"
    counts = warmup_token_counts(ex, 2, 512)
    assert counts[0] == 1 and len(counts) >= 2
    with pytest.raises(ValueError, match="cannot hold 4-bit"):
        W4A16MoEMethod("int4", 128).create_weights(FusedExperts(E, 96, 64, "silu"))
