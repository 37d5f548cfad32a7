"""``python scripts/kernel_bench.py w4a16-gemv [--configs FILE] [--budget S] [--out DIR]``: the W4A16
batch-1 GEMV on one GPU -- the word-wise kernel (zpp/models/quantization/w4a16_gemv.py) in a launch
sweep against the byte-wise one at its measured launches (W4A16_CONFIGS) and zpp's bf16 GEMV, on the
Llama-3-70B layer shapes (qkv 10240x8192, o 8192x8192, gate_up 57344x8192, down 8192x28672), for
int4 group 128 (symmetric / with zero points), int4 group 32 and mxfp4 group 32.

1. The card's copy bandwidth (2 GiB device-to-device copy, bytes read + written): the floor below.
2. Correctness: every launch of the sweep at M = 1 (and the best at M = 2, 3, 4) against
   ``dequantize_w4`` + a float32 matmul (relative L2 error; bf16 output rounding is ~2e-3); a CUDA
   graph of a split-K launch replayed twice equals eager.
3. Timings: CUDA-graph replays (``do_bench_cudagraph``, median), weights rotated among copies
   totalling > 200 MB (out of L2). GB/s of packed bytes read (qweight + scales + zeros); % of the copy
   rate and of the card's HBM figure; per kind, the layer (four GEMVs, each at its fastest launch)
   against its packed-weight read floor (bytes at the copy rate).

Every kind runs the whole sweep (``FULL``; a kind left out takes the best four launches of
``int4-g128`` per shape). ``--configs FILE``: a JSON list of launches instead of the built-in one.
Stops starting new kinds past ``--budget`` seconds (default 330). Prints tables and writes
``w4a16_gemv_bench.json`` to ``$OUT`` (or ``--out``).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from w4a16_bench import HBM, KINDS, LLAMA70B, bench, bf16_gemv_us, copies, copy_bw, log, nbytes, rand_w4, rel  # noqa: E402

from zpp.models.quantization import w4a16_kernels as W  # noqa: E402
from zpp.models.quantization.w4_layout import dequantize_w4  # noqa: E402

dev = "cuda"
DT = torch.bfloat16
SWEEP = [dict(block_n=bn, block_k=bk, num_warps=nw, split_k=sk, vec=v, prefetch=pf) for bn, bk, nw, sk, v, pf in (
    (8, 1024, 4, 1, False, False), (16, 1024, 4, 1, False, False), (32, 1024, 4, 1, True, False),
    (8, 1024, 4, 1, False, True), (16, 1024, 4, 1, False, True), (32, 1024, 4, 1, True, True),
    (4, 1024, 4, 1, False, True), (8, 512, 4, 1, False, True), (8, 2048, 8, 1, False, True),
    (16, 2048, 8, 1, False, True), (8, 1024, 4, 2, False, True), (16, 1024, 4, 2, False, True))]
"""Launches of the sweep: the word-wise kernel (``words=True`` added) -- rows x codes a step / warps,
``split_k``, ``vec`` (four words a thread), ``prefetch`` (registers double-buffered)."""
FULL = ("int4-g128", "mxfp4-g32", "int4-g32", "int4-g128-zp")


def name(c):
    return (f"{c['block_n']}x{c['block_k']}/{c['num_warps']}w" + (f" sk{c['split_k']}" if c.get("split_k", 1) > 1 else "")
            + (" vec" if c.get("vec") else "") + (" pf" if c.get("prefetch") else ""))


def main(argv=()):
    out_dir = os.environ.get("OUT", ".")
    if "--out" in argv:
        out_dir = argv[argv.index("--out") + 1]
    budget = float(argv[argv.index("--budget") + 1]) if "--budget" in argv else 330.0
    sweep = SWEEP
    if "--configs" in argv:
        with open(argv[argv.index("--configs") + 1]) as f:
            sweep = json.load(f)
    t0 = time.time()
    dname = torch.cuda.get_device_name()
    card = next((v for k, v in HBM.items() if k in dname), 3.35e12)
    R: dict = dict(device=dname, torch=torch.__version__, triton=triton.__version__, hbm_Bps=card, sweep=sweep)
    log(f"device: {dname}, torch {torch.__version__}, triton {triton.__version__}")
    peak = copy_bw()
    R["copy_Bps"] = peak

    def dump():
        R["seconds"] = time.time() - t0
        with open(os.path.join(out_dir, "w4a16_gemv_bench.json"), "w") as f:
            json.dump(R, f, indent=1, default=str)

    bf16 = {}
    for sname, (N, K) in LLAMA70B.items():   # zpp's bf16 GEMV on the same shapes
        bf16[sname] = bf16_gemv_us(N, K)
    R["bf16_us"] = bf16
    torch.cuda.empty_cache()
    tops: dict = {}
    for kind in ("int4-g128", "mxfp4-g32", "int4-g32", "int4-g128-zp"):
        fmt, G, zp = KINDS[kind]
        if time.time() - t0 > budget:
            log(f"budget reached: {kind} and after skipped")
            R.setdefault("skipped", []).append(kind)
            continue
        res, layer_us, layer_old, layer_bytes = {}, 0.0, 0.0, 0
        for sname, (N, K) in LLAMA70B.items():
            ws = [rand_w4((N, K), fmt, G, zp, i) for i in range(copies(N * K // 2))]
            b = nbytes(*ws[0])
            x = torch.randn(1, K, device=dev).to(DT)
            i = [0]

            def run(cfg, xx=x):
                def f():
                    i[0] = (i[0] + 1) % len(ws)
                    q, s, z = ws[i[0]]
                    return W.w4a16_gemv(xx, q, s, z, G, fmt, None, **cfg)
                return f
            wf = dequantize_w4(*ws[0], G, fmt, torch.float32)
            want = x.float() @ wf.t()
            cands = sweep if kind in FULL else tops.get(sname, sweep[:4])
            rows = []
            for cfg in cands:
                cfg = dict(cfg, words=True)
                try:
                    e = rel(W.w4a16_gemv(x, *ws[0], G, fmt, None, **cfg), want)
                    t = bench(run(cfg))
                except Exception as ex:  # a launch that does not fit
                    log(f"  {kind} {sname} {name(cfg)}: {type(ex).__name__}: {str(ex)[:120]}")
                    continue
                rows.append(dict(us=t, err=e, cfg=cfg, GBps=b / t / 1e3))
                if e > 1e-2:
                    log(f"  WRONG {kind} {sname} {name(cfg)}: rel err {e:.2e}")
            rows.sort(key=lambda r: r["us"] if r["err"] < 1e-2 else 1e9)
            if kind == "int4-g128":
                tops[sname] = [{k: v for k, v in r["cfg"].items() if k != "words"} for r in rows[:4]]
            old_cfg = W.W4A16_GEMV_BYTEWISE.get(f"N={N},K={K}", dict(block_n=16, block_k=512, num_warps=4, x_split=True))
            t_old = bench(run(dict(old_cfg, words=False)))
            best = rows[0]
            t = best["us"]
            row = dict(us=t, GBps=b / t / 1e3, pct_copy=100 * b / t / 1e-6 / peak, pct_hbm=100 * b / t / 1e-6 / card,
                       bytes=b, err=best["err"], cfg=best["cfg"], bytewise_us=t_old, bytewise_cfg=old_cfg,
                       bf16_us=bf16[sname], floor_us=b / peak * 1e6,
                       sweep=[(round(r["us"], 2), round(r["GBps"]), f"{r['err']:.1e}", name(r["cfg"])) for r in rows])
            for M in (2, 3, 4):
                xm = torch.randn(M, K, device=dev).to(DT)
                cm = dict(best["cfg"], block_n=min(best["cfg"]["block_n"], 16 if M == 2 else 8), vec=False,
                          prefetch=False)   # w4a16_gemv_config's rule for M > 1 (the calls kept vec / prefetch)
                e = rel(W.w4a16_gemv(xm, *ws[0], G, fmt, None, **cm), xm.float() @ wf.t())
                tm = bench(run(cm, xm)) if M != 3 else float("nan")
                row[f"M={M}"] = dict(us=tm, err=e, cfg=cm)
            res[sname] = row
            layer_us += t
            layer_old += t_old
            layer_bytes += b
            log(f"{kind:13} {sname:8} {t:7.1f} us {row['GBps']:5.0f} GB/s {row['pct_copy']:5.1f}% copy "
                f"{row['pct_hbm']:5.1f}% HBM  err {best['err']:.1e}  byte-wise {t_old:6.1f}  bf16 {bf16[sname]:6.1f}  "
                f"M=2 {row['M=2']['us']:6.1f} M=4 {row['M=4']['us']:6.1f}  {name(best['cfg'])}")
            log("    " + ", ".join(f"{r[0]}us {r[3]}" for r in row["sweep"][:6]))
            del ws, wf
            torch.cuda.empty_cache()
        floor = layer_bytes / peak * 1e6
        res["layer"] = dict(us=layer_us, floor_us=floor, ratio=layer_us / floor, bytewise_us=layer_old,
                            bf16_us=sum(bf16.values()), bytes=layer_bytes)
        log(f"{kind:13} layer {layer_us:7.1f} us, floor {floor:6.1f} us, x{layer_us / floor:.3f} (byte-wise "
            f"{layer_old:6.1f} us, x{layer_old / floor:.3f}; bf16 {sum(bf16.values()):6.1f} us)")
        R[kind] = res
        dump()
    # graphs == eager for a split-K launch (the counters reset themselves between replays)
    q, s, z = rand_w4((8192, 8192), "int4", 128, True)
    x = torch.randn(1, 8192, device=dev).to(DT)
    cfg = dict(block_n=16, block_k=1024, num_warps=4, split_k=4, words=True)
    eager = W.w4a16_gemv(x, q, s, z, 128, "int4", None, **cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = W.w4a16_gemv(x, q, s, z, 128, "int4", None, **cfg)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    R["splitk_graph_equals_eager"] = bool(torch.equal(yg, eager))
    log(f"split-K graph == eager: {R['splitk_graph_equals_eager']}")
    dump()
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
