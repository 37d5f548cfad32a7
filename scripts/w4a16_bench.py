"""``python scripts/kernel_bench.py w4a16 [--quick] [--out DIR]`` (or this file): the W4A16 kernels of
zpp.models.quantization.w4a16_kernels on one GPU, random packed weights in the w4_layout.

1. Correctness on real shapes: every kernel (dense GEMV at M = 1, 2, 4; dense GEMM at M = 16, 300;
   MoE GEMV and GEMM, fused MoE both paths) against ``dequantize_w4`` + a float32 torch matmul, int4
   (group 128 symmetric and asymmetric, group 32) and mxfp4 (group 32); a CUDA-graph replay of the
   GEMV and the fused MoE against eager.
2. Bandwidth: the copy bandwidth of the card (a 2 GiB device-to-device copy: bytes read + written),
   then the dense GEMV at M = 1 on the Llama-3-70B layer shapes (qkv 10240x8192, o 8192x8192,
   gate_up 57344x8192, down 8192x28672) with a launch sweep: GB/s of the packed bytes read
   (qweight + scales + zeros), % of the copy bandwidth and of the card's HBM figure; bf16 zpp GEMV
   (``triton_ops.gemv``) on the same shapes beside it. Per layer: the four GEMVs' sum against the
   layer's packed-weight read floor (its bytes at the copy bandwidth). M = 2 and 4 with the best
   launch.
3. Prefill: dense GEMM at M = 256 and 2048 on the same shapes, a tile sweep, vs bf16 cuBLAS.
4. MoE: gpt-oss-20b (32 experts, top-4, hidden 2880, intermediate 2880) and gpt-oss-120b (128
   experts) expert shapes in mxfp4 group 32 with biases and the clamped SwiGLU: fused_moe_w4a16 vs the
   bf16 fused_moe at T = 1, 2, 4, 8, 16, 64, 256, 1024 (GEMV and GEMM paths where both apply), GEMM
   tile sweep at 256, GEMV launch sweep at 1.

The int4 sweeps also try their best launches with ``fast_cvt`` (codes to float by an OR and a
subtraction instead of ``cvt``).

Dense timings are CUDA-graph replays (``triton.testing.do_bench_cudagraph``: no launch overhead, as a
decode step runs); MoE timings eager launches (``triton.testing.do_bench``: the bf16 ``fused_moe``
under ``do_bench_cudagraph`` hit an illegal memory access on the first call, not investigated),
weights rotated among copies totalling > 200 MB where one copy would sit in L2,
routings among 8 random ones. Prints tables and writes ``w4a16_bench.json`` to ``$OUT`` (or ``--out``).
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from zpp.models.layers import fused_moe as FM
from zpp.models.layers import triton_ops as ops
from zpp.models.layers.moe import ClampedSwiGLU
from zpp.models.quantization import w4a16_kernels as W
from zpp.models.quantization.w4_layout import dequantize_w4

dev = "cuda"
DT = torch.bfloat16
LLAMA70B = {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}
KINDS = {"int4-g128": ("int4", 128, False), "int4-g128-zp": ("int4", 128, True), "int4-g32": ("int4", 32, False),
         "mxfp4-g32": ("mxfp4", 32, False)}
HBM = {"H100": 3.35e12, "H200": 4.8e12}
RESULTS: dict = {}
QUICK = "--quick" in sys.argv


def log(*a):
    print(*a, flush=True)


def rand_w4(shape, fmt, G, zeros, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    *lead, N, K = shape
    q = torch.randint(0, 256, (*lead, N, K // 2), generator=g, device=dev, dtype=torch.uint8)
    gs = (*lead, N, K // G)
    if fmt == "mxfp4":
        return q, torch.randint(119, 125, gs, generator=g, device=dev, dtype=torch.uint8), None
    s = (torch.rand(gs, generator=g, device=dev) * 0.02 + 0.005).to(DT)
    z = torch.randint(0, 16, gs, generator=g, device=dev, dtype=torch.uint8) if zeros else None
    return q, s, z


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def bench(fn, rep=50):
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1000   # us


def bench_eager(fn, rep=50):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1000   # us


def copies(n_bytes):
    """How many copies of a tensor of n_bytes keep a rotation out of L2 (> 200 MB in all)."""
    return max(1, min(16, -(-200_000_000 // max(1, n_bytes))))


# --- 1. correctness ---------------------------------------------------------------------------------
def bf16_gemv_us(N, K):
    """zpp's bf16 batch-1 GEMV (``triton_ops.gemv``) on an ``[N, K]`` weight, us per product in CUDA
    graphs, weights rotated among copies (the 4-bit kernels' baseline)."""
    x = torch.randn(1, K, device=dev).to(DT)
    wb = [torch.randn(N, K, device=dev, dtype=DT) for _ in range(copies(N * K * 2))]
    j = [0]

    def bf():
        j[0] = (j[0] + 1) % len(wb)
        return ops.gemv(x, wb[j[0]], None, **ops.gemv_config(N, K))
    return bench(bf)


def correctness():
    log("== correctness (rel. error vs dequantize_w4 + fp32 matmul) ==")
    out = {}
    N, K = 8192, 8192
    for name, (fmt, G, zp) in KINDS.items():
        q, s, z = rand_w4((N, K), fmt, G, zp)
        wf = dequantize_w4(q, s, z, G, fmt, torch.float32)
        for M in (1, 2, 3, 4, 16, 300):
            x = torch.randn(M, K, device=dev).to(DT)
            y = W.w4a16_linear(x, q, s, z, G, fmt)
            e = rel(y, x.float() @ wf.t())
            out[f"dense {name} M={M}"] = e
            log(f"dense {name:14} M={M:4}: {e:.2e}")
            assert e < 2e-2, e
    for E, H, I, k in ((32, 2880, 2880, 4),):
        act = ClampedSwiGLU()
        for name, (fmt, G, zp) in KINDS.items():
            if H % G:
                continue
            gu, dn = rand_w4((E, 2 * I, H), fmt, G, zp, 1), rand_w4((E, H, I), fmt, G, zp, 2)
            b_gu = torch.randn(E, 2 * I, device=dev).to(DT) * 0.1
            b_dn = torch.randn(E, H, device=dev).to(DT) * 0.1
            wg = dequantize_w4(*gu, G, fmt, DT)
            wd = dequantize_w4(*dn, G, fmt, DT)
            for T in (1, 5, 64):
                x = torch.randn(T, H, device=dev).to(DT)
                logits = torch.randn(T, E, device=dev)
                top, ids = logits.topk(k, dim=1)
                rw = top.softmax(1)
                want = FM.fused_moe(x, wg, wd, rw, ids, act, b_gu, b_dn)
                for gemv in (True, False):
                    y = W.fused_moe_w4a16(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn, config={"gemv": gemv})
                    e = rel(y, want)
                    out[f"moe {name} T={T} gemv={gemv}"] = e
                    log(f"moe   {name:14} T={T:4} {'gemv' if gemv else 'gemm'}: {e:.2e}")
                    assert e < 3e-2, e
            # graphs equal eager
            x = torch.randn(2, H, device=dev).to(DT)
            top, ids = torch.randn(2, E, device=dev).topk(k, dim=1)
            rw = top.softmax(1)
            eager = W.fused_moe_w4a16(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn)
            g = torch.cuda.CUDAGraph()
            s_ = torch.cuda.Stream()
            s_.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s_):
                W.fused_moe_w4a16(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn)
            torch.cuda.current_stream().wait_stream(s_)
            with torch.cuda.graph(g):
                yg = W.fused_moe_w4a16(x, gu, dn, G, fmt, rw, ids, act, b_gu, b_dn)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(yg, eager), "graph != eager (moe)"
            out[f"moe {name} graph==eager"] = True
    q, s, z = rand_w4((4096, 4096), "int4", 128, True)
    x = torch.randn(1, 4096, device=dev).to(DT)
    eager = W.w4a16_linear(x, q, s, z, 128, "int4")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = W.w4a16_linear(x, q, s, z, 128, "int4")
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, eager), "graph != eager (gemv)"
    log("graphs == eager: ok")
    RESULTS["correctness"] = out


# --- 2. GEMV bandwidth ------------------------------------------------------------------------------
def copy_bw():
    a = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median") / 1000
    bw = 2 * a.numel() / t
    log(f"device copy: {bw / 1e9:.0f} GB/s (read + write)")
    del a, b
    return bw


LAUNCHES = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=3, x_split=True) for bn, bk, nw in
            ((8, 1024, 4), (16, 256, 4), (16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 4),
             (32, 512, 8), (32, 1024, 8), (64, 256, 4), (64, 256, 8), (64, 512, 8))]
SWEPT = ("int4-g128", "mxfp4-g32")  # full launch sweep; the other kinds try these kinds' best three


def gemv_bw(peak, card_hbm):
    log("== dense GEMV, Llama-3-70B layer shapes, M = 1 (CUDA graphs) ==")
    res, bf16, tops = {}, {}, {}
    kinds = KINDS if not QUICK else {"int4-g128": KINDS["int4-g128"]}
    for name, (fmt, G, zp) in kinds.items():
        best_cfgs, layer_us, layer_bytes, layer_bf16 = {}, 0.0, 0, 0.0
        for sname, (N, K) in LLAMA70B.items():
            ws = [rand_w4((N, K), fmt, G, zp, i) for i in range(copies(N * K // 2))]
            b = nbytes(*ws[0])
            x = torch.randn(1, K, device=dev).to(DT)
            i = [0]

            def run(cfg):
                def f():
                    i[0] = (i[0] + 1) % len(ws)
                    q, s, z = ws[i[0]]
                    return W.w4a16_gemv(x, q, s, z, G, fmt, None, **cfg)
                return f
            sweep = []
            cands = LAUNCHES if name in SWEPT else [c for sw in SWEPT for c in tops.get((sw, sname), [])]
            for cfg in (cands if not QUICK else LAUNCHES[:6]):
                try:
                    sweep.append((bench(run(cfg)), cfg))
                except Exception as e:  # a launch that does not fit (registers / shared memory)
                    log(f"  {sname} {cfg}: {type(e).__name__}")
            sweep.sort(key=lambda r: r[0])
            for _, c in sweep[:3]:   # the best three with two strided activation loads
                if c.get("x_split"):
                    c2 = dict(c, x_split=False)
                    sweep.append((bench(run(c2)), c2))
            sweep.sort(key=lambda r: r[0])
            if fmt == "int4":        # the best three with the OR-and-subtract int -> float conversion
                for _, c in list(sweep[:3]):
                    c3 = dict(c, fast_cvt=True)
                    sweep.append((bench(run(c3)), c3))
                sweep.sort(key=lambda r: r[0])
            t, cfg = sweep[0]
            tops[(name, sname)] = [c for _, c in sweep[:3]]
            dflt = bench(run(W.w4a16_gemv_config(N, K)))
            best_cfgs[sname] = cfg
            if sname not in bf16:
                bf16[sname] = bf16_gemv_us(N, K)
            tb = bf16[sname]
            layer_us += t
            layer_bytes += b
            layer_bf16 += tb
            row = dict(us=t, default_us=dflt, GBps=b / t / 1e3, pct_copy=100 * b / t / 1e-6 / peak,
                       pct_hbm=100 * b / t / 1e-6 / card_hbm, bytes=b, cfg=cfg, bf16_us=tb, speedup=tb / t,
                       top5=[(round(tt, 2), c) for tt, c in sweep[:5]])
            res[f"{name} {sname}"] = row
            log(f"{name:13} {sname:8} {t:8.1f} us (default {dflt:7.1f}) {row['GBps']:6.0f} GB/s "
                f"{row['pct_copy']:5.1f}% of copy {row['pct_hbm']:5.1f}% of HBM  bf16 {tb:8.1f} us  x{tb / t:.2f}  {cfg}")
            for M in (2, 4):
                xm = torch.randn(M, K, device=dev).to(DT)

                def fm():
                    i[0] = (i[0] + 1) % len(ws)
                    q, s, z = ws[i[0]]
                    return W.w4a16_gemv(xm, q, s, z, G, fmt, None, **cfg)
                tm = bench(fm)
                res[f"{name} {sname} M={M}"] = dict(us=tm, GBps=b / tm / 1e3)
                log(f"{'':13} {sname:8} M={M}: {tm:8.1f} us {b / tm / 1e3:6.0f} GB/s")
            del ws
            torch.cuda.empty_cache()
        floor = layer_bytes / peak * 1e6
        res[f"{name} layer"] = dict(us=layer_us, floor_us=floor, ratio=layer_us / floor, bf16_us=layer_bf16,
                                    bytes=layer_bytes, cfgs=best_cfgs)
        log(f"{name:13} layer: {layer_us:8.1f} us, floor {floor:8.1f} us (x{layer_us / floor:.3f}), bf16 "
            f"{layer_bf16:8.1f} us; 80 layers {80 * layer_us / 1e3:.2f} ms vs floor {80 * floor / 1e3:.2f} ms")
    RESULTS["gemv"] = res


# --- 3. prefill GEMM --------------------------------------------------------------------------------
TILES = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bm, bn, bk, nw, ns in
         ((64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
          (128, 256, 64, 8, 3), (64, 256, 128, 8, 3), (128, 64, 128, 4, 4), (16, 128, 128, 4, 4))]


def prefill():
    log("== dense GEMM (prefill), Llama-3-70B shapes ==")
    res = {}
    fmt, G, zp = KINDS["int4-g128"]
    for sname, (N, K) in LLAMA70B.items():
        q, s, z = rand_w4((N, K), fmt, G, zp)
        wb = torch.randn(N, K, device=dev, dtype=DT)
        for M in (256, 2048):
            x = torch.randn(M, K, device=dev).to(DT)
            tb = bench(lambda: F.linear(x, wb), rep=30)
            sweep = []
            for cfg in TILES[:6]:
                try:
                    sweep.append((bench(lambda: W.w4a16_gemm(x, q, s, z, G, fmt, None, cfg), rep=30), cfg))
                except Exception as e:
                    log(f"  {cfg}: {type(e).__name__}")
            sweep.sort(key=lambda r: r[0])
            c3 = dict(sweep[0][1], fast_cvt=True)
            sweep.append((bench(lambda: W.w4a16_gemm(x, q, s, z, G, fmt, None, c3), rep=30), c3))
            sweep.sort(key=lambda r: r[0])
            t, cfg = sweep[0]
            dflt = bench(lambda: W.w4a16_gemm(x, q, s, z, G, fmt), rep=30)
            tf = 2 * M * N * K / t / 1e6
            res[f"{sname} M={M}"] = dict(us=t, default_us=dflt, bf16_us=tb, TFLOPs=tf, cfg=cfg, ratio_bf16=tb / t)
            log(f"{sname:8} M={M:5}: w4 {t:8.1f} us (default {dflt:8.1f}, {tf:5.0f} TFLOP/s) bf16 cuBLAS {tb:8.1f} us "
                f" x{tb / t:.2f}  {cfg}")
        del wb, q, s, z
        torch.cuda.empty_cache()
    RESULTS["prefill"] = res


# --- 4. MoE -----------------------------------------------------------------------------------------
MOE_TILES = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns) for bm, bn, bk, nw, ns in
             ((16, 64, 128, 4, 3), (16, 128, 128, 4, 3), (32, 64, 128, 4, 3), (32, 128, 64, 4, 3),
              (64, 64, 128, 4, 3), (64, 128, 64, 8, 3), (64, 128, 128, 8, 3))]
MOE_GEMV = [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
            ((2, 512, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8))]


def moe():
    res = {}
    act = ClampedSwiGLU()
    models = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}
    for mname, (E, H, I, k) in models.items():
        log(f"== MoE {mname} (E={E}, top-{k}, H={H}, I={I}) mxfp4 g32 vs bf16 ==")
        fmt, G = "mxfp4", 32
        gu, dn = rand_w4((E, 2 * I, H), fmt, G, False, 1), rand_w4((E, H, I), fmt, G, False, 2)
        b_gu = torch.randn(E, 2 * I, device=dev).to(DT) * 0.1
        b_dn = torch.randn(E, H, device=dev).to(DT) * 0.1
        wg, wd = dequantize_w4(*gu, G, fmt, DT), dequantize_w4(*dn, G, fmt, DT)
        rng = torch.Generator(device=dev).manual_seed(0)
        for T in (1, 2, 4, 8, 16, 64, 256, 1024):
            x = torch.randn(T, H, device=dev).to(DT)
            routes = []
            for _ in range(8):
                top, ids = torch.randn(T, E, device=dev, generator=rng).topk(k, dim=1)
                routes.append((top.softmax(1), ids))
            r = [0]

            def nxt():
                r[0] = (r[0] + 1) % len(routes)
                return routes[r[0]]
            tb = bench_eager(lambda: FM.fused_moe(x, wg, wd, *nxt(), act, b_gu, b_dn))
            row = dict(bf16_us=tb)
            for gemv in ((True, False) if T * k <= 64 else (False,)):
                t = bench_eager(lambda: W.fused_moe_w4a16(x, gu, dn, G, fmt, *nxt(), act, b_gu, b_dn,
                                                          config={"gemv": gemv}))
                row["gemv_us" if gemv else "gemm_us"] = t
            dflt = bench_eager(lambda: W.fused_moe_w4a16(x, gu, dn, G, fmt, *nxt(), act, b_gu, b_dn))
            row["default_us"] = dflt
            res[f"{mname} T={T}"] = row
            log(f"{mname} T={T:5}: bf16 {tb:8.1f} us  w4 gemv {row.get('gemv_us', float('nan')):8.1f}  gemm "
                f"{row['gemm_us']:8.1f}  default {dflt:8.1f}  (x{tb / dflt:.2f} vs bf16)")
        # sweeps: GEMM tiles at T = 256, GEMV launches at T = 1
        for T in (256,) if not QUICK else ():
            x = torch.randn(T, H, device=dev).to(DT)
            top, ids = torch.randn(T, E, device=dev, generator=rng).topk(k, dim=1)
            M = T * k
            h = torch.randn(M, I, device=dev).to(DT)
            for wname, w, xin, N, rdiv in (("gate_up", gu, x, 2 * I, k), ("down", dn, h, H, 1)):
                sweep = []
                for cfg in MOE_TILES:
                    sid, be = FM.moe_align(ids, E, cfg["BLOCK_M"])
                    o = torch.empty(M, N, device=dev, dtype=DT)
                    try:
                        sweep.append((bench_eager(lambda: W.moe_w4a16_gemm(xin, *w, G, fmt, o, sid, be, None, None, rdiv,
                                                                     cfg)), cfg))
                    except Exception as e:
                        log(f"  {cfg}: {type(e).__name__}")
                sweep.sort(key=lambda r: r[0])
                res[f"{mname} gemm-sweep {wname} T={T}"] = [(round(t, 2), c) for t, c in sweep]
                log(f"{mname} {wname} T={T} tiles: " + ", ".join(f"{t:.1f}us {c['BLOCK_M']}x{c['BLOCK_N']}x"
                                                                   f"{c['BLOCK_K']}/{c['num_warps']}" for t, c in sweep[:4]))
        x = torch.randn(1, H, device=dev).to(DT)
        top, ids = torch.randn(1, E, device=dev, generator=rng).topk(k, dim=1)
        h = torch.randn(k, I, device=dev).to(DT)
        for wname, w, xin, N, rdiv in (("gate_up", gu, x, 2 * I, k), ("down", dn, h, H, 1)):
            o = torch.empty(k, N, device=dev, dtype=DT)
            sweep = []
            for cfg in MOE_GEMV:
                sweep.append((bench_eager(lambda: W.moe_w4a16_gemv(xin, *w, G, fmt, ids.reshape(-1), o, None, None, rdiv,
                                                             cfg)), cfg))
            sweep.sort(key=lambda r: r[0])
            b = k * N * (xin.shape[1] // 2 + xin.shape[1] // G)
            res[f"{mname} gemv-sweep {wname}"] = [(round(t, 2), c) for t, c in sweep]
            log(f"{mname} {wname} T=1 gemv: " + ", ".join(f"{t:.1f}us ({b / t / 1e3:.0f} GB/s) {c}" for t, c in sweep[:3]))
        del gu, dn, wg, wd
        torch.cuda.empty_cache()
    RESULTS["moe"] = res


def main(argv=()):
    out_dir = os.environ.get("OUT", ".")
    if "--out" in argv:
        out_dir = argv[argv.index("--out") + 1]
    name = torch.cuda.get_device_name()
    card = next((v for k_, v in HBM.items() if k_ in name), 3.35e12)
    RESULTS["device"] = name
    log(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    parts = [p for p in ("correctness", "gemv", "moe", "prefill") if f"--no-{p}" not in argv]

    def dump():
        RESULTS["seconds"] = time.time() - t0
        with open(os.path.join(out_dir, "w4a16_bench.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    peak = copy_bw()
    RESULTS["copy_Bps"] = peak
    for part, fn in (("correctness", correctness), ("gemv", lambda: gemv_bw(peak, card)), ("moe", moe),
                     ("prefill", prefill)):
        if part not in parts:
            continue
        try:
            fn()
        except Exception:  # report and go on with the next part
            import traceback
            traceback.print_exc()
            RESULTS.setdefault("errors", []).append(f"{part}: {traceback.format_exc(limit=3)}")
        dump()
        torch.cuda.empty_cache()
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
