"""Micro-benchmarks of the decode hot path on one GPU (run on the H200): matrix-vector products of
the Llama-3-8B shapes (cuBLAS via F.linear vs zpp's Triton GEMV) and paged attention at batch 1.
Prints microseconds and effective bandwidth. ``attn`` / ``mixed``: throughput-shape attention;
``fp8``: the FP8 GEMV (per channel / 128x128 blocks) vs the bf16 one with a launch sweep, batched
FP8 GEMMs (per channel through torch._scaled_mm row-wise, block through the Triton block GEMM and
torch._scaled_mm's block recipe where available) vs bf16 cuBLAS with a tile sweep, and decode
attention over an FP8 KV cache vs bf16. ``fp8-moe``: the grouped FP8 MoE kernels against bf16 fused_moe
and torch._scaled_mm looped over experts, with the tile sweep that fills FP8_MOE_CONFIGS (runs
scripts/fp8_moe_bench.py alone; see its docstring). ``w4a16``: the W4A16 kernels (dense GEMV bandwidth on
Llama-3-70B shapes with a launch sweep, prefill GEMM, gpt-oss MoE vs bf16; runs scripts/w4a16_bench.py
alone, see its docstring). ``w4a16-gemv``: the word-wise W4A16 GEMV's launch sweep against the
byte-wise one and bf16 (scripts/w4a16_gemv_bench.py alone)."""
import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "fp8-moe":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fp8_moe_bench import main
    main(sys.argv[2:])
    sys.exit(0)
if len(sys.argv) > 1 and sys.argv[1] == "w4a16-gemv":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from w4a16_gemv_bench import main as w4g_main
    w4g_main(sys.argv[2:])
    sys.exit(0)
if len(sys.argv) > 1 and sys.argv[1] == "w4a16":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from w4a16_bench import main as w4_main
    w4_main(sys.argv[2:])
    sys.exit(0)

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

# --- throughput shapes (python scripts/kernel_bench.py attn): what a 1000 x 256/256 run spends --
import sys  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] == "attn":
    # Decode attention over a full batch: B sequences at context C, Llama-3-8B heads. Bytes: the
    # K and V of every context position once (B * C * Hk * D * 2 * 2 bytes). Launch variants.
    def decode_case(B, C, bn, nw, ns, splits=None):
        nb = -(-(C + 1) // bs)
        kcs = [torch.randn(B * nb + 1, bs, hk, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        vcs = [torch.randn_like(k) for k in kcs]
        q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        bt = torch.randperm(B * nb, device=dev, dtype=torch.int32).view(B, nb)  # scattered blocks
        lens = torch.full((B,), C + 1, device=dev, dtype=torch.int32)
        qs = torch.arange(B + 1, device=dev, dtype=torch.int32)
        ts = torch.arange(B, device=dev, dtype=torch.int32)
        tq = torch.zeros(B, device=dev, dtype=torch.int32)
        sp = splits or ops.decode_splits(B, hk)
        j = [0]

        def f():
            j[0] ^= 1
            return ops.paged_attention(q, kcs[j[0]], vcs[j[0]], out, bt, lens, qs, ts, tq, d ** -0.5, 16, sp,
                                       block_n=bn, num_warps=nw, num_stages=ns)
        ref = None
        if bn == 32 and nw == 4 and ns == 2:
            ref = out.clone()
        t = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1000
        gb = B * (C + 1) * hk * d * 2 * 2 / 1e9
        return t, gb / t * 1e6

    print(f"{'decode attention':28} {'us':>8} {'GB/s':>7}")
    for B, C in ((1024, 384), (256, 384), (1, 256)):
        for bn, nw, ns in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 4, 3)):
            try:
                t, bw = decode_case(B, C, bn, nw, ns)
                print(f"B {B:4d} C {C:4d} n{bn:3d} w{nw} s{ns}       {t:8.1f} {bw:7.0f}")
            except Exception as e:  # e.g. out of shared memory
                print(f"B {B:4d} C {C:4d} n{bn:3d} w{nw} s{ns}       failed: {type(e).__name__}")
    # correctness of the variants against the default at one shape (same inputs)
    B, C = 64, 300
    nb = -(-(C + 1) // bs)
    kc = torch.randn(B * nb + 1, bs, hk, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(B * nb, device=dev, dtype=torch.int32).view(B, nb)
    lens = torch.randint(1, C + 1, (B,), device=dev, dtype=torch.int32)
    qs = torch.arange(B + 1, device=dev, dtype=torch.int32)
    ts = torch.arange(B, device=dev, dtype=torch.int32)
    tq = torch.zeros(B, device=dev, dtype=torch.int32)
    base = ops.paged_attention(q, kc, vc, torch.full_like(q, float("nan")), bt, lens, qs, ts, tq, d ** -0.5, 16, 1,
                               block_n=32, num_stages=2)
    for bn, nw, ns in ((64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 4, 3)):
        o = ops.paged_attention(q, kc, vc, torch.full_like(q, float("nan")), bt, lens, qs, ts, tq, d ** -0.5, 16, 1,
                                block_n=bn, num_warps=nw, num_stages=ns)
        err = ((o.float() - base.float()).norm() / base.float().norm()).item()
        print(f"variant n{bn} w{nw} s{ns}: rel.err vs default {err:.1e}, nan {bool(o.isnan().any())}")
    # GEMMs of a decode step at M tokens (cuBLAS): TFLOP/s
    print(f"{'gemm M x N x K':28} {'us':>8} {'TFLOP/s':>8}")
    for M in (1024, 8192):
        for name, (n, k) in shapes.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(2)]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            j = [0]

            def g():
                j[0] ^= 1
                return F.linear(x, ws[j[0]])
            t = triton.testing.do_bench(g, warmup=25, rep=100, return_mode="median") * 1000
            print(f"{name:8} {M:5d} x {n:6d} x {k:5d}  {t:8.1f} {2 * M * n * k / t / 1e6:8.0f}")

# --- mixed micro-batches (python scripts/kernel_bench.py mixed) -------------------------------
# Attention of one layer for a micro-batch of D decodes at context C next to P prompt chunks of L
# tokens (the mix of the prefill phase of a 1000 x 256/256 run at an 8192-token budget): one
# launch with the prefill tile shape for every row vs the decodes in their own launch at the decode
# tile shape (zpp.models.layers.attention.triton_metadata_arrays, split_mixed).
if len(sys.argv) > 1 and sys.argv[1] == "mixed":
    from zpp.models.layers.attention import Attention, triton_metadata_arrays
    print(f"{'mixed attention (one layer)':36} {'one launch us':>14} {'split us':>9} {'rel.diff':>9}")
    for D, C, P, L in ((960, 290, 28, 256), (500, 270, 30, 256), (32, 257, 31, 256), (1000, 300, 1, 64)):
        nb_d, nb_p = -(-(C + 1) // bs), -(-L // bs)
        nblocks = D * nb_d + P * nb_p + 1
        kv = torch.randn(2, nblocks, bs, hk, d, device=dev, dtype=torch.bfloat16)
        perm = torch.randperm(nblocks - 1).tolist()
        tables = [perm[i * nb_d:(i + 1) * nb_d] for i in range(D)]
        tables += [perm[D * nb_d + i * nb_p:D * nb_d + (i + 1) * nb_p] for i in range(P)]
        starts, q_lens = [C] * D + [0] * P, [1] * D + [L] * P
        T = D + P * L
        q = torch.randn(T, hq * d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, hk * d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, hk * d, device=dev, dtype=torch.bfloat16)
        layer = Attention(hq, d, hk)
        res = []
        for split in (False, True):
            host = triton_metadata_arrays(starts, q_lens, tables, bs, hq // hk, split_mixed=split, num_kv_heads=10**6)
            meta = host.to_device([torch.from_numpy(a).to(dev) for a in host.array_list()])
            t = triton.testing.do_bench(lambda: layer(q, k, v, kv, meta), warmup=25, rep=200,
                                        return_mode="median") * 1000
            res.append((t, layer(q, k, v, kv, meta).float()))
        diff = ((res[0][1] - res[1][1]).norm() / res[0][1].norm()).item()
        print(f"{D:4d} decodes C {C:3d} + {P:2d} x {L:3d} prompt   {res[0][0]:14.1f} {res[1][0]:9.1f} {diff:9.1e}")

# --- FP8 (python scripts/kernel_bench.py fp8): the kernels of --quantization fp8 / FP8 checkpoints ----
if len(sys.argv) > 1 and sys.argv[1] == "fp8":
    from zpp.models.quantization import fp8_kernels as K8
    from zpp.models.quantization.fp8_utils import quantize_block, quantize_per_channel

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000

    B128 = (128, 128)
    # 1) decode GEMV, M = 1 and 4: bf16 Triton GEMV vs FP8 W8A16 GEMV (per channel, 128x128 blocks).
    print(f"\n{'GEMV':10} {'M':>2} {'bf16 us':>8} {'GB/s':>6} {'fp8ch us':>9} {'GB/s':>6} {'fp8blk us':>10} {'GB/s':>6}")
    for name, (n, k) in shapes.items():
        if name == "lm_head":
            continue
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        wc = [quantize_per_channel(w) for w in wb]
        wk = [quantize_block(w, B128) for w in wb]
        for m in (1, 4):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            i = [0]

            def nxt():
                i[0] = (i[0] + 1) % 4
                return i[0]
            cfg = K8.fp8_gemv_config(n, k)
            t_b = bench(lambda: ops.gemv(x, wb[nxt()], **ops.gemv_config(n, k)))
            t_c = bench(lambda: K8.fp8_gemv(x, *wc[nxt()], None, **cfg))
            t_k = bench(lambda: K8.fp8_gemv(x, *wk[nxt()], B128, **cfg))
            ref = x.float() @ (wc[0][0].float() * wc[0][1][:, None]).t()
            err = ((K8.fp8_gemv(x, *wc[0], None, **cfg).float() - ref).norm() / ref.norm()).item()
            print(f"{name:10} {m:2d} {t_b:8.1f} {n * k * 2 / t_b / 1e3:6.0f} {t_c:9.1f} {n * k / t_c / 1e3:6.0f} "
                  f"{t_k:10.1f} {n * k / t_k / 1e3:6.0f}   rel.err {err:.1e}")
        # launch sweep of the FP8 GEMV at M = 1 (to tune fp8_gemv_config)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        best = []
        for bn_ in (2, 4, 8):
            for bk_ in (1024, 2048, 4096):
                for nw in (4, 8):
                    try:
                        t = bench(lambda: K8.fp8_gemv(x, *wc[0], None, block_n=bn_, block_k=bk_, num_warps=nw))
                        best.append((t, bn_, bk_, nw))
                    except Exception as e:  # noqa: BLE001  (a launch that does not fit)
                        print(f"  {name} block_n={bn_} block_k={bk_} warps={nw}: {type(e).__name__}")
        best.sort()
        print(f"  {name} fastest FP8 GEMV launches (us, block_n, block_k, warps): {best[:3]}")

    # 2) batched GEMMs: bf16 cuBLAS vs FP8 per channel (Triton per-token quant + torch._scaled_mm row-wise)
    #    vs FP8 128x128 blocks (Triton group quant + Triton block GEMM, and torch._scaled_mm's
    #    BlockWise1x128 x BlockWise128x128 where this torch takes it).
    print(f"\n{'GEMM':10} {'M':>5} {'bf16':>7} {'fp8ch':>7} {'(mm)':>7} {'fp8blk':>7} {'(gemm)':>7} {'blk_mm':>7}  TFLOPS")
    for name, (n, k) in shapes.items():
        if name == "lm_head":
            continue
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_per_channel(wb)
        bq, bs_ = quantize_block(wb, B128)
        for m in (16, 256, 1024, 4096, 8192):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            fl = 2 * m * n * k / 1e12
            t_b = bench(lambda: F.linear(x, wb))
            xq, xs = K8.per_token_quant(x)
            sb = ws.view(1, -1)
            t_mm = bench(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=sb, out_dtype=torch.bfloat16))

            def fp8_channel():
                q, s = K8.per_token_quant(x)
                return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=sb, out_dtype=torch.bfloat16)
            t_c = bench(fp8_channel)
            gq, gs = K8.per_token_group_quant(x, 128)
            t_g = bench(lambda: K8.block_gemm(gq, gs, bq, bs_, B128, torch.bfloat16))

            def fp8_block():
                q, s = K8.per_token_group_quant(x, 128)
                return K8.block_gemm(q, s, bq, bs_, B128, torch.bfloat16)
            t_k = bench(fp8_block)
            try:  # scale_a [M, K/128] (outer-dim-major), scale_b [K/128, N/128]: torch's blockwise recipe
                sa = gs.t().contiguous().t()
                sbk = bs_.t().contiguous()
                torch._scaled_mm(gq, bq.t(), scale_a=sa, scale_b=sbk, out_dtype=torch.bfloat16)
                t_bm = f"{fl / bench(lambda: torch._scaled_mm(gq, bq.t(), scale_a=sa, scale_b=sbk, out_dtype=torch.bfloat16)) * 1e6:7.0f}"
            except Exception as e:  # noqa: BLE001
                t_bm = "   n/a"
                if m == 16:
                    print(f"  torch._scaled_mm block scales: {type(e).__name__}: {str(e)[:120]}")
            ref = F.linear(x, wb).float()
            e_c = ((fp8_channel().float() - ref).norm() / ref.norm()).item()
            e_k = ((fp8_block().float() - ref).norm() / ref.norm()).item()
            print(f"{name:10} {m:5d} {fl / t_b * 1e6:7.0f} {fl / t_c * 1e6:7.0f} {fl / t_mm * 1e6:7.0f} "
                  f"{fl / t_k * 1e6:7.0f} {fl / t_g * 1e6:7.0f} {t_bm}   rel.err vs bf16 {e_c:.1e} / {e_k:.1e}")
        # block GEMM tile sweep at M = 4096 (to tune block_gemm_config)
        x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
        gq, gs = K8.per_token_group_quant(x, 128)
        best = []
        for bm in (64, 128):
            for bn_ in (64, 128, 256):
                for nw in (4, 8):
                    for ns in (3, 4):
                        cfg = dict(block_m=bm, block_n=bn_, num_warps=nw, num_stages=ns)
                        try:
                            best.append((bench(lambda: K8.block_gemm(gq, gs, bq, bs_, B128, torch.bfloat16, config=cfg)),
                                         bm, bn_, nw, ns))
                        except Exception:  # noqa: BLE001  (out of shared memory)
                            pass
        best.sort()
        print(f"  {name} fastest block GEMM tiles at M=4096 (us, block_m, block_n, warps, stages): {best[:3]}")

    # 3) decode attention over an FP8 KV cache vs bf16: 256 and 1024 sequences at context 384 (the
    #    1000 x 256/256 run's middle), batch 1 at 2048.
    print()
    for B, C in ((1, 2048), (256, 384), (1024, 384)):
        nb = -(-(C + 1) // bs)
        for kv_dt in (torch.bfloat16, torch.float8_e4m3fn):
            kc = torch.randn(B * nb + 1, bs, hk, d, device=dev).to(kv_dt)
            vc = torch.randn(B * nb + 1, bs, hk, d, device=dev).to(kv_dt)
            q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            bt = torch.arange(B * nb, device=dev, dtype=torch.int32).view(B, nb)
            i32 = lambda v: torch.tensor(v, device=dev, dtype=torch.int32)
            sp = ops.decode_splits(B, hk)
            args = (q, kc, vc, out, bt, i32([C] * B), i32(list(range(B + 1))), i32(list(range(B))), i32([0] * B),
                    d ** -0.5, 16, sp)
            t = bench(lambda: ops.paged_attention(*args, k_scale=0.5, v_scale=0.5))
            byts = B * C * hk * d * 2 * kc.element_size()
            print(f"decode attention B={B} ctx {C} KV {str(kv_dt).removeprefix('torch.'):14} {sp} split(s): "
                  f"{t:8.1f} us  {byts / t / 1e3:6.0f} GB/s")
