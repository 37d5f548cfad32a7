"""``python scripts/kernel_bench.py fp8-moe`` (or this file): the grouped FP8 MoE kernels of
zpp.models.quantization.fp8_moe_kernels on one GPU, Qwen3-30B-A3B (128 experts, top-8, hidden 2048,
moe_intermediate 768) and DeepSeek-V3 (256 experts, top-8, hidden 7168, moe_intermediate 2048)
expert shapes, T = 1, 8, 64, 512, 4096 tokens.

1. Correctness: fused_moe_fp8 (both paths, per-channel and 128 x 128 block scales) against the bf16
   fused_moe on the dequantized weights; CUDA-graph replay against eager.
2. Tile sweep of each grouped GEMM (gate_up, down) per layout and batch -> FP8_MOE_CONFIGS; launch
   sweep of the W8A16 GEMV for T <= 64.
3. The whole MoE feed-forward (both GEMMs + activation + sum over k): bf16 fused_moe vs FP8
   per-channel / block, GEMM path and GEMV path, and the floor: torch._scaled_mm row-wise looped
   over the experts that hold tokens (routing sorted on the host beforehand, not timed).
4. Dense block-FP8 GEMV (DeepSeek-V3 dense / MLA linear shapes, M = 1 and 4): bf16 GEMV vs FP8
   block scales per weight element (old) vs on the activation vector (new) vs per channel.

Routings rotate among 8 random ones per timing so that T = 1 does not read its 8 experts from L2.
Prints tables, ``CONFIGS = {...}`` to paste into FP8_MOE_CONFIGS, and writes JSON to ``$OUT`` (or
``--out``)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from zpp.models.quantization import fp8_kernels as K8
from zpp.models.quantization import fp8_moe_kernels as M8
from zpp.models.layers import fused_moe as FM
from zpp.models.layers.moe import GatedActivation

MODELS = {"qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768), "deepseek-v3": dict(E=256, k=8, H=7168, I=2048)}
BATCHES = (1, 8, 64, 512, 4096)
B128 = (128, 128)
GEMM_TILES = [(16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3),
              (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3), (64, 256, 8, 3)]
GEMV_LAUNCHES = [(4, 2048, 4), (4, 1024, 4), (8, 1024, 4), (8, 512, 4), (16, 512, 8)]
DS_DENSE = {"q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "o": (7168, 16384),
            "gate_up": (36864, 7168), "down": (7168, 18432), "shared_gu": (4096, 7168), "shared_dn": (7168, 2048)}


def _timer(smoke):
    if smoke:
        def t(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        return t
    import triton.testing

    def t(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=25, return_mode="median") * 1000
    return t


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _experts(E, N, K, dev, seed):
    """Random e4m3 experts (made one expert at a time), per-channel scales [E, N] and block scales
    [E, N/128, K/128] (both around 1e-3, so a bf16 dequantization is ~0.1-0.5 in size)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=dev)
    for e in range(E):
        r = torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 64
        w[e] = r.clamp(-448, 448).to(torch.float8_e4m3fn)
    sc = torch.rand(E, N, device=dev, generator=g) * 2e-3 + 1e-3
    sb = torch.rand(E, -(-N // 128), -(-K // 128), device=dev, generator=g) * 2e-3 + 1e-3
    return w, sc, sb


def _dequant_bf16(w, s, block, dtype=torch.bfloat16):
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    for e in range(w.shape[0]):
        if block is None:
            out[e] = (w[e].float() * s[e][:, None]).to(dtype)
        else:
            out[e] = (w[e].float() * s[e].repeat_interleave(128, 0)[:w.shape[1]]
                      .repeat_interleave(128, 1)[:, :w.shape[2]]).to(dtype)
    return out


def _routings(T, E, k, dev, n=8, seed=0):
    g = torch.Generator().manual_seed(seed + T)
    out = []
    for _ in range(n):
        ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(dev)
        w = torch.rand(T, k, generator=g).to(dev)
        out.append((w / w.sum(-1, keepdim=True), ids))
    return out


def _floor_fn(x, wg, sg, wd, sd, weights, ids, E):
    """torch._scaled_mm row-wise per expert (the grouping done here, on the host, before timing)."""
    T, k = ids.shape
    flat = ids.reshape(-1).cpu()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    groups, start = [], 0
    for e, c in enumerate(counts):
        if c:
            a = order[start:start + c].to(x.device)
            groups.append((e, a, a // k))
        start += c
    rw = weights.reshape(-1).float()

    def run():
        xq, xs = K8.per_token_quant(x)
        out = torch.zeros(T * k, x.shape[1], dtype=torch.float32, device=x.device)
        xq8 = xq.view(torch.uint8)
        for e, a, t in groups:
            q = xq8.index_select(0, t).view(torch.float8_e4m3fn)
            g = torch._scaled_mm(q, wg[e].t(), scale_a=xs.index_select(0, t), scale_b=sg[e].view(1, -1),
                                 out_dtype=torch.bfloat16)
            hq, hs = K8.silu_mul_quant(g)
            y = torch._scaled_mm(hq, wd[e].t(), scale_a=hs, scale_b=sd[e].view(1, -1), out_dtype=torch.bfloat16)
            out.index_add_(0, a, y.float() * rw.index_select(0, a)[:, None])
        return out.view(T, k, -1).sum(1).to(x.dtype)
    return run


def main(argv=()):
    smoke = "--smoke" in argv  # CPU under TRITON_INTERPRET=1, tiny shapes: checks that the script runs
    out_dir = os.environ.get("OUT", ".")
    if "--out" in argv:
        out_dir = argv[argv.index("--out") + 1]
    dev = "cpu" if smoke else "cuda"
    if smoke:  # the interpreter fixes of the kernel tests (scalar __index__, float8 rounding)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "layers"))
        import test_fp8_kernels  # noqa: F401
    bench = _timer(smoke)
    models = {"tiny": dict(E=8, k=2, H=256, I=128)} if smoke else MODELS
    batches = (1, 40) if smoke else BATCHES
    tiles = GEMM_TILES[:2] if smoke else GEMM_TILES
    launches = GEMV_LAUNCHES[:2] if smoke else GEMV_LAUNCHES
    dt = torch.float32 if smoke else torch.bfloat16
    act = GatedActivation("silu")
    results = {"device": "cpu" if smoke else torch.cuda.get_device_name(), "models": {}}
    configs = {}
    torch.manual_seed(0)
    for name, m in models.items():
        E, k, H, I = m["E"], m["k"], m["H"], m["I"]
        wg, sgc, sgb = _experts(E, 2 * I, H, dev, 1)
        wd, sdc, sdb = _experts(E, H, I, dev, 2)
        res = results["models"][name] = {"correctness": {}, "sweep": {}, "moe_us": {}}
        lay = {"channel": (None, sgc, sdc), "block": (B128, sgb, sdb)}
        # 1) correctness vs bf16 on the dequantized weights, and graph replay vs eager
        for ln, (block, sg, sd) in lay.items():
            bg, bd = _dequant_bf16(wg, sg, block, dt), _dequant_bf16(wd, sd, block, dt)
            for T in (batches[0], batches[-1]):
                (rw, ids), = _routings(T, E, k, dev, n=1, seed=7)
                x = torch.randn(T, H, device=dev, dtype=dt)
                ref = FM.fused_moe(x, bg, bd, rw, ids, act)
                for gemv in (True, False):
                    if gemv and T * k > 512:
                        continue
                    y = M8.fused_moe_fp8(x, wg, wd, sg, sd, rw, ids, act, block, config=dict(gemv=gemv))
                    e_ = _rel(y, ref)
                    line = dict(T=T, gemv=gemv, rel_err_vs_bf16_dequantized=e_, finite=bool(y.isfinite().all()))
                    if not smoke:  # CUDA graph: capture, new inputs copied in, replay == eager
                        xs_, rws, idss = x.clone(), rw.clone(), ids.clone()
                        s = torch.cuda.Stream()
                        s.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(s):
                            for _ in range(2):
                                M8.fused_moe_fp8(xs_, wg, wd, sg, sd, rws, idss, act, block, config=dict(gemv=gemv))
                        torch.cuda.current_stream().wait_stream(s)
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            gy = M8.fused_moe_fp8(xs_, wg, wd, sg, sd, rws, idss, act, block, config=dict(gemv=gemv))
                        (rw2, ids2), = _routings(T, E, k, dev, n=1, seed=11)
                        x2 = torch.randn(T, H, device=dev, dtype=dt)
                        xs_.copy_(x2), rws.copy_(rw2), idss.copy_(ids2)
                        graph.replay()
                        torch.cuda.synchronize()
                        eager = M8.fused_moe_fp8(x2, wg, wd, sg, sd, rw2, ids2, act, block, config=dict(gemv=gemv))
                        line["graph_replay_max_abs_diff_vs_eager"] = (gy.float() - eager.float()).abs().max().item()
                        line["graph_rel_err_vs_bf16"] = _rel(gy, FM.fused_moe(x2, bg, bd, rw2, ids2, act))
                    res["correctness"][f"{ln} T={T} {'gemv' if gemv else 'gemm'}"] = line
                    print(f"[check] {name} {ln:7} T={T:5d} {'gemv' if gemv else 'gemm'}: {line}", flush=True)
            del bg, bd
        # 2) tile sweep of each grouped GEMM; GEMV launch sweep
        for T in batches:
            M = T * k
            rts = _routings(T, E, k, dev)
            x = torch.randn(T, H, device=dev, dtype=dt)
            h = torch.randn(M, I, device=dev, dtype=dt)
            for ln, (block, sg, sd) in lay.items():
                xq, xs = M8._quant(x, block)
                hq, hs = M8._quant(h, block)
                for gname, (w, s, N, Kd, a, aq, as_, div) in {
                        "gate_up": (wg, sg, 2 * I, H, x, xq, xs, k), "down": (wd, sd, H, I, h, hq, hs, 1)}.items():
                    out = torch.empty(M, N, device=dev, dtype=dt)
                    best = []
                    for bm, bn, nw, ns in tiles:
                        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=nw, num_stages=ns)
                        aligned = [FM.moe_align(ids, E, bm) for _, ids in rts]
                        i = [0]

                        def f():
                            i[0] = (i[0] + 1) % len(aligned)
                            M8.moe_fp8_gemm(aq, as_, w, s, out, *aligned[i[0]], block, None, None, div, cfg)
                        try:
                            best.append((bench(f), cfg))
                        except Exception as e:  # noqa: BLE001  (out of shared memory)
                            print(f"  {name} {gname} {ln} T={T} {cfg}: {type(e).__name__}", flush=True)
                    best.sort(key=lambda b: b[0])
                    key = M8._key(E, N, Kd, block)
                    configs.setdefault(key, {}).setdefault("gemm", {})[M] = best[0][1]
                    row = dict(gemm=[(round(t, 1), c) for t, c in best[:3]])
                    if M <= 512:
                        gbest = []
                        for bn, bk, nw in launches:
                            if block is not None and 128 % bn:
                                continue
                            cfg = dict(block_n=bn, block_k=bk, num_warps=nw)
                            j = [0]

                            def g():
                                j[0] = (j[0] + 1) % len(rts)
                                M8.moe_fp8_gemv(a, w, s, rts[j[0]][1].reshape(-1), out, block, None, None, div, cfg)
                            gbest.append((bench(g), cfg))
                        gbest.sort(key=lambda b: b[0])
                        configs[key]["gemv"] = gbest[0][1] if T == 1 else configs[key].get("gemv", gbest[0][1])
                        row["gemv"] = [(round(t, 1), c) for t, c in gbest[:3]]
                    res["sweep"][f"{gname} {ln} T={T}"] = row
                    print(f"[sweep] {name} {gname:7} {ln:7} T={T:5d} gemm {row['gemm'][0]}"
                          + (f" gemv {row['gemv'][0]}" if "gemv" in row else ""), flush=True)
        # 3) the whole MoE: bf16 vs FP8 per path, and the scaled_mm floor
        M8.FP8_MOE_CONFIGS.update({kk: v for kk, v in configs.items() if kk.startswith(f"E={E},")})
        bgc, bdc = _dequant_bf16(wg, sgc, None, dt), _dequant_bf16(wd, sdc, None, dt)
        print(f"\n{name}: MoE feed-forward, us (median; ratio to bf16 fused_moe)")
        print(f"{'T':>5} {'bf16':>8} {'ch gemm':>8} {'ch gemv':>8} {'blk gemm':>8} {'blk gemv':>8} {'mm floor':>9}")
        for T in batches:
            rts = _routings(T, E, k, dev)
            x = torch.randn(T, H, device=dev, dtype=dt)
            i = [0]

            def rot():
                i[0] = (i[0] + 1) % len(rts)
                return rts[i[0]]
            row = {"bf16": bench(lambda: FM.fused_moe(x, bgc, bdc, *rot(), act))}
            for ln, (block, sg, sd) in lay.items():
                row[f"{ln} gemm"] = bench(lambda: M8.fused_moe_fp8(x, wg, wd, sg, sd, *rot(), act, block,
                                                                   config=dict(gemv=False)))
                if T * k <= 512:
                    row[f"{ln} gemv"] = bench(lambda: M8.fused_moe_fp8(x, wg, wd, sg, sd, *rot(), act, block,
                                                                       config=dict(gemv=True)))
            if not smoke:
                floors = [_floor_fn(x, wg, sgc, wd, sdc, rw, ids, E) for rw, ids in rts[:2]]
                fl = [0]

                def fl_run():
                    fl[0] ^= 1
                    return floors[fl[0]]()
                row["scaled_mm floor"] = bench(fl_run)
            res["moe_us"][T] = row
            for ln in lay:  # the GEMV path up to the largest batch where it won
                key = M8._key(E, 2 * I, H, lay[ln][0])
                if f"{ln} gemv" in row and row[f"{ln} gemv"] < row[f"{ln} gemm"]:
                    configs[key]["gemv_max"] = T * k
                else:
                    configs[key].setdefault("gemv_max", 0)
            f = lambda kk: f"{row[kk]:8.1f}" if kk in row else f"{'-':>8}"  # noqa: E731
            print(f"{T:5d} {f('bf16')} {f('channel gemm')} {f('channel gemv')} {f('block gemm')} {f('block gemv')} "
                  f"{f('scaled_mm floor'):>9}", flush=True)
        del bgc, bdc, wg, wd
        for key in list(configs):  # down GEMMs follow their gate_up's path choice
            if key.startswith(f"E={E},N={H},"):
                up = M8._key(E, 2 * I, H, B128 if "block" in key else None)
                configs[key]["gemv_max"] = configs[up].get("gemv_max", 0)
    # 4) dense block-FP8 GEMV (DeepSeek-V3 linears), old vs new block-scale placement
    if not smoke:
        from zpp.models.layers import triton_ops as ops
        from zpp.models.quantization.fp8_utils import quantize_block, quantize_per_channel
        print(f"\n{'DS-V3 GEMV':10} {'M':>2} {'bf16':>7} {'blk old':>8} {'blk new':>8} {'fp8 ch':>7}  us")
        dense = results["dense_gemv_us"] = {}
        for dn, (n, kd) in DS_DENSE.items():
            wb = [torch.randn(n, kd, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(2)]
            wk = [quantize_block(w, B128) for w in wb]
            wc = [quantize_per_channel(w) for w in wb]
            cfg = K8.fp8_gemv_config(n, kd)
            for mm in (1, 4):
                x = torch.randn(mm, kd, device=dev, dtype=torch.bfloat16)
                i = [0]

                def nx():
                    i[0] ^= 1
                    return i[0]
                r = {"bf16": bench(lambda: ops.gemv(x, wb[nx()], **ops.gemv_config(n, kd)))}
                K8._GEMV_SCALE_X = False
                r["block old"] = bench(lambda: K8.fp8_gemv(x, *wk[nx()], B128, **cfg))
                K8._GEMV_SCALE_X = True
                r["block new"] = bench(lambda: K8.fp8_gemv(x, *wk[nx()], B128, **cfg))
                r["channel"] = bench(lambda: K8.fp8_gemv(x, *wc[nx()], None, **cfg))
                full = wk[0][1].repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :kd]
                ref = x.float() @ (wk[0][0].float() * full).t()
                r["rel_err_new"] = _rel(K8.fp8_gemv(x, *wk[0], B128, **cfg), ref)
                dense[f"{dn} M={mm}"] = r
                print(f"{dn:10} {mm:2d} {r['bf16']:7.1f} {r['block old']:8.1f} {r['block new']:8.1f} "
                      f"{r['channel']:7.1f}  err {r['rel_err_new']:.1e}", flush=True)
            del wb, wk, wc
    results["configs"] = {kk: {**v, "gemm": {str(b): c for b, c in v.get("gemm", {}).items()}}
                          for kk, v in configs.items()}
    with open(os.path.join(out_dir, "fp8_moe_bench.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print("\nCONFIGS =", json.dumps(results["configs"]))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
