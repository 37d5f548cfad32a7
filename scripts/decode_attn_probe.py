"""Where decode attention's bandwidth goes on the GPU: the paged-attention kernel over a bf16 and an
FP8 KV cache, in the cache's current layout (``[blocks, block_size, Hk, D]``: one head's key row is
``D`` values every ``Hk * D``) and a head-major one (``[blocks, Hk, block_size, D]`` presented as the
same shape through a permuted view: one head's block is contiguous) over launch configurations;
beside it a kernel that only reads the same rows (the access pattern's ceiling; the KV heads of one
sequence launched side by side or apart) and a plain device copy (the GPU's).
Llama-3-8B heads (32 query / 8 KV heads of 128), 16-token blocks, block tables shuffled.

    python scripts/decode_attn_probe.py --layouts [--quick]

Without ``--layouts``: warps per program x keys per step x pipeline stages for decode batches over a
bf16 and an FP8 cache, the best eight against the default launch, with their error against float32
attention over the same cache.
"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from zpp.models.layers import triton_ops as ops


@triton.jit
def _read_kernel(K, V, Out, bt, seq_lens, stride_kb, stride_ks, stride_kh, stride_bt,
                 BLOCK_N: tl.constexpr, KV_BLOCK: tl.constexpr, D: tl.constexpr, HK: tl.constexpr,
                 HEAD_FAST: tl.constexpr):
    if HEAD_FAST:
        kvh = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
    L = tl.load(seq_lens + seq)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for start in range(0, L, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        ok = n < L
        blk = tl.load(bt + seq * stride_bt + n // KV_BLOCK, mask=ok, other=0).to(tl.int64)
        off = blk * stride_kb + (n % KV_BLOCK) * stride_ks + kvh * stride_kh
        k = tl.load(K + off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + (seq * HK + kvh) * D + d, tl.sum(acc, 0))


def _decode_batch(B: int, C: int, hq: int, hk: int, d: int, bs: int, dev: str = "cuda"):
    """B decodes at context C: (blocks per sequence, shuffled block tables, seq lens, query starts,
    tile lists, q, out, splits)."""
    nb = -(-(C + 1) // bs)
    i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)
    bt = torch.randperm(B * nb, device=dev).to(torch.int32).view(B, nb)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    tiles = (i32(list(range(B + 1))), i32(list(range(B))), i32([0] * B))
    return nb, bt, i32([C] * B), tiles, q, torch.empty_like(q), ops.decode_splits(B, hk)


def launch_sweep():
    """num_warps x keys per step x stages for decode batches, bf16 and FP8 caches."""
    dev = "cuda"
    hq, hk, d, bs = 32, 8, 128, 16
    torch.manual_seed(0)
    for B, C in ((1024, 384), (256, 384), (2048, 192), (64, 1024), (1, 2048), (1, 200)):
        nb, bt, lens, tiles, q, out, sp = _decode_batch(B, C, hq, hk, d, bs)
        kf, vf = torch.randn(B * nb, bs, hk, d, device=dev) * 2, torch.randn(B * nb, bs, hk, d, device=dev) * 2
        caches = {"fp8": (kf.to(torch.float8_e4m3fn), vf.to(torch.float8_e4m3fn), 0.5),
                  "bf16": (kf.bfloat16(), vf.bfloat16(), 1.0)}
        del kf, vf
        meta = (bt, lens, *tiles, d ** -0.5, 16, sp)
        for name, (kc, vc, sc) in caches.items():
            ref = ops.paged_attention(q.float(), kc.float() * sc, vc.float() * sc,
                                      torch.empty(B, hq, d, device=dev), *meta)
            byts = B * C * hk * d * kc.element_size() * 2
            t0 = do_bench(lambda: ops.paged_attention(q, kc, vc, out, *meta, k_scale=sc, v_scale=sc))
            print(f"B={B:5d} ctx {C:4d} splits {sp:2d} {name:4} default {t0 * 1e3:8.1f} us {byts / t0 / 1e6:6.0f} GB/s",
                  flush=True)
            rows = []
            for nw, bn, ns in itertools.product((1, 2, 4), (32, 64, 128), (2, 3, 4)):
                f = lambda: ops.paged_attention(q, kc, vc, out, *meta, k_scale=sc, v_scale=sc, block_n=bn,
                                                num_stages=ns, num_warps=nw)
                try:
                    err = ((f().float() - ref).norm() / ref.norm()).item()
                    t = do_bench(f)
                except Exception as e:  # noqa: BLE001
                    print(f"  nw={nw} bn={bn} ns={ns}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                rows.append((t, nw, bn, ns, err))
            for t, nw, bn, ns, err in sorted(rows)[:8]:
                print(f"B={B:5d} ctx {C:4d} {name:4} nw={nw} bn={bn:3d} ns={ns} {t * 1e3:8.1f} us "
                      f"{byts / t / 1e6:6.0f} GB/s  x{t0 / t:4.2f} of default  rel.err {err:.1e}", flush=True)
        del caches


def main():
    if "--layouts" not in sys.argv:
        return launch_sweep()
    quick = "--quick" in sys.argv
    dev = "cuda"
    hq, hk, d, bs = 32, 8, 128, 16
    torch.manual_seed(0)
    x = torch.empty(1 << 28, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x))
    print(f"device copy 512 MiB: {t * 1e3:.1f} us, {2 * x.numel() * 2 / t / 1e6:.0f} GB/s (read + write)", flush=True)
    del x, y
    shapes = ((1024, 384), (256, 384), (2048, 192), (64, 1024))
    for B, C in shapes[:2] if quick else shapes:
        nb, bt, lens, tiles, q, out, sp = _decode_batch(B, C, hq, hk, d, bs)
        for fp8 in (False, True):
            byts = B * C * hk * d * (1 if fp8 else 2) * 2
            for layout in ("NHD", "HND"):
                shape = (B * nb, bs, hk, d) if layout == "NHD" else (B * nb, hk, bs, d)
                kf, vf = torch.randn(shape, device=dev), torch.randn(shape, device=dev)
                if fp8:
                    kc, vc = (kf * 2).to(torch.float8_e4m3fn), (vf * 2).to(torch.float8_e4m3fn)
                else:
                    kc, vc = kf.bfloat16(), vf.bfloat16()
                del kf, vf
                if layout == "HND":
                    kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)
                tag = f"B={B:5d} ctx {C:4d} {'fp8 ' if fp8 else 'bf16'} {layout}"
                ro = torch.empty(B, hk, d, device=dev)
                for hf, bn in itertools.product((False, True), (32, 64)):
                    grid = (hk, B) if hf else (B, hk)
                    f = lambda: _read_kernel[grid](kc, vc, ro, bt, lens, kc.stride(0), kc.stride(1), kc.stride(2),
                                                   bt.stride(0), BLOCK_N=bn, KV_BLOCK=bs, D=d, HK=hk, HEAD_FAST=hf,
                                                   num_warps=4, num_stages=3)
                    tt = do_bench(f)
                    print(f"{tag} read-only head_fast={hf!s:5} bn={bn:3d} {tt * 1e3:8.1f} us {byts / tt / 1e6:6.0f} GB/s",
                          flush=True)
                scale = 0.5 if fp8 else 1.0
                args = (q, kc, vc, out, bt, lens, *tiles,
                        d ** -0.5, 16, sp)
                ref = None
                rows = []
                for bn, ns, nw in itertools.product((32, 64, 128), (2, 3, 4), (1, 4)):
                    if quick and (nw == 4 or ns == 4):
                        continue
                    f = lambda: ops.paged_attention(*args, k_scale=scale, v_scale=scale, block_n=bn, num_stages=ns,
                                                    num_warps=nw)
                    try:
                        o = f().float().clone()
                        if ref is None:
                            ref = o
                        err = ((o - ref).norm() / ref.norm()).item()
                        tt = do_bench(f)
                    except Exception as e:  # noqa: BLE001
                        print(f"{tag} bn={bn} ns={ns} nw={nw}: {type(e).__name__}", flush=True)
                        continue
                    rows.append((tt, bn, ns, nw, err))
                t0 = do_bench(lambda: ops.paged_attention(*args, k_scale=scale, v_scale=scale))
                print(f"{tag} attention default          {t0 * 1e3:8.1f} us {byts / t0 / 1e6:6.0f} GB/s", flush=True)
                for tt, bn, ns, nw, err in sorted(rows)[:6]:
                    print(f"{tag} attention bn={bn:3d} ns={ns} nw={nw} {tt * 1e3:8.1f} us "
                          f"{byts / tt / 1e6:6.0f} GB/s  x{t0 / tt:4.2f} of default  rel.diff {err:.1e}", flush=True)
                del kc, vc


if __name__ == "__main__":
    main()
