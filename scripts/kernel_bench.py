"""Micro-benchmarks of the decode hot path on one GPU (run on the H200): matrix-vector products of
the Llama-3-8B shapes (cuBLAS via F.linear vs zpp's Triton GEMV) and paged attention at batch 1.
Prints microseconds and effective bandwidth."""
import torch
import torch.nn.functional as F
import triton.testing

from zpp.models.layers import triton_ops as ops

torch.manual_seed(0)
dev = "cuda"
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
print(f"{'shape':10} {'cublas us':>10} {'GB/s':>7} {'triton us':>10} {'GB/s':>7}")
for name, (n, k) in shapes.items():
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]  # rotate: defeat L2
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    i = [0]

    def cub():
        i[0] = (i[0] + 1) % 4
        return F.linear(x, ws[i[0]])

    def tri():
        i[0] = (i[0] + 1) % 4
        return ops.gemv(x, ws[i[0]])
    err = (ops.gemv(x, ws[0]).float() - F.linear(x, ws[0]).float()).norm() / F.linear(x, ws[0]).float().norm()
    t1 = triton.testing.do_bench(cub, warmup=25, rep=100, return_mode="median") * 1000
    t2 = triton.testing.do_bench(tri, warmup=25, rep=100, return_mode="median") * 1000
    gb = n * k * 2 / 1e9
    print(f"{name:10} {t1:10.1f} {gb / t1 * 1e6:7.0f} {t2:10.1f} {gb / t2 * 1e6:7.0f}   rel.err {err:.1e}")

# paged attention, batch 1, Llama-3-8B heads, context 256
hk, hq, d, bs = 8, 32, 128, 16
kc = torch.randn(64, bs, hk, d, device=dev, dtype=torch.bfloat16)
vc = torch.randn_like(kc)
for ctx in (256, 2048):
    nb = ctx // bs
    kc = torch.randn(nb + 1, bs, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    bt = torch.arange(nb, device=dev, dtype=torch.int32)[None]
    i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)
    args = (q, kc, vc, out, bt, i32([ctx]), i32([0, 1]), i32([0]), i32([0]), d ** -0.5, 16)
    for splits in (1, ops.decode_splits(1, hk)):
        t = triton.testing.do_bench(lambda: ops.paged_attention(*args, splits), warmup=25, rep=100,
                                    return_mode="median") * 1000
        print(f"paged attention bs1 ctx {ctx}, {splits} split(s): {t:.1f} us")
