"""A decode step's MoE feed-forward at batch T (default 1), in CUDA graphs (issue 47): the router's
selection (PyTorch's softmax / topk / renormalisation against fused_moe.topk_route) and the FP8
W8A16 experts (activation, down GEMV and sum over k as three kernels and a reduction against
fp8_moe_kernels.moe_fp8_gemv_down, whose launch is swept), for the Qwen3-30B-A3B and DeepSeek-V3
expert shapes, per-channel and 128 x 128 block scales. Each timing is one graph of 8 calls, each on
its own routing over disjoint experts (the active experts never come from L2), replayed; median of
7 runs of 20 replays, microseconds per call. Correctness first: fused against unfused on the same
inputs (relative L2 error).

    python scripts/moe_decode_bench.py [--T 1] [--json OUT.json]
"""
import argparse
import json
import statistics

import torch

from zpp.models.layers.fused_moe import topk_route
from zpp.models.layers.moe import GatedActivation
from zpp.models.quantization import fp8_moe_kernels as M8
from zpp.models.quantization.fp8_utils import quantize_block, quantize_per_channel

ap = argparse.ArgumentParser()
ap.add_argument("--T", type=int, default=1)
ap.add_argument("--json")
args = ap.parse_args()
dev = torch.device("cuda")
T, R = args.T, 8
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (256, 7168, 2048, 8)}
results = {"device": torch.cuda.get_device_name(), "T": T}


def timed(fns) -> float:
    """us per call of a graph that runs each fn of ``fns`` once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(7):
        a.record()
        for _ in range(20):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 20 / len(fns) * 1000)
    return statistics.median(ts)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- router ---------------------------------------------------------------------------------------
for name, (E, H, I, k) in SHAPES.items():
    wr = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.02
    xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(R)]

    def torch_route(x):
        p = torch.softmax(torch.nn.functional.linear(x, wr).float(), -1)
        w, i = torch.topk(p, k, -1)
        return w / w.sum(-1, keepdim=True), i
    w0, i0 = torch_route(xs[0])
    w1, i1 = topk_route(torch.nn.functional.linear(xs[0], wr), k, "softmax", True)
    same = torch.equal(i0, i1) and torch.allclose(w0, w1, rtol=1e-5, atol=1e-6)
    t_torch = timed([lambda x=x: torch_route(x) for x in xs])
    t_fused = timed([lambda x=x: topk_route(torch.nn.functional.linear(x, wr), k, "softmax", True) for x in xs])
    t_gemv = timed([lambda x=x: torch.nn.functional.linear(x, wr) for x in xs])
    print(f"router {name} T={T}: linear+torch {t_torch:.2f} us, linear+topk_route {t_fused:.2f} us "
          f"(linear alone {t_gemv:.2f}); same selection: {same}")
    results[f"router/{name}"] = dict(torch_us=t_torch, fused_us=t_fused, linear_us=t_gemv, same=same)

# --- FP8 experts: unfused vs fused down -------------------------------------------------------------
act = GatedActivation("silu")
for name, (E, H, I, k) in SHAPES.items():
    for layout in (("channel", "block") if name.startswith("qwen") else ("block",)):
        block = (128, 128) if layout == "block" else None
        torch.manual_seed(0)
        wg = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=dev)
        wd = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=dev)
        sg = torch.empty((E, 2 * I) if block is None else (E, 2 * I // 128, H // 128), device=dev)
        sd = torch.empty((E, H) if block is None else (E, H // 128, I // 128), device=dev)
        for e in range(E):
            for w, s, shape in ((wg, sg, (2 * I, H)), (wd, sd, (H, I))):
                q, sc = (quantize_per_channel if block is None else
                         (lambda t: quantize_block(t, block)))(torch.randn(shape, device=dev) * 0.05)
                w[e].copy_(q)
                s[e].copy_(sc.reshape(s[e].shape))
        perm = torch.randperm(E, device=dev)
        idss = [perm[(r * T * k + torch.arange(T * k, device=dev)) % E].reshape(T, k) for r in range(R)]
        rws = [torch.softmax(torch.randn(T, k, device=dev), -1) for _ in range(R)]
        xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(R)]
        key = f"{name}/{layout}"

        def run(r, fused):
            M8._FUSED_DOWN = fused
            return M8.fused_moe_fp8(xs[r], wg, wd, sg, sd, rws[r], idss[r], act, block, config=dict(gemv=True))
        a, b = run(0, False), run(0, True)
        err = rel(b, a)
        t_unfused = timed([lambda r=r: run(r, False) for r in range(R)])
        base = dict(M8.fp8_moe_gemv_down_config(E, H, I, block))   # _FUSED_DOWN True here: never None
        sweep = {}
        for bn in (4, 8, 16):
            for bk in (256, 512):
                for nw in (2, 4):
                    cfg = dict(block_n=bn, block_k=bk, num_warps=nw)
                    M8.FP8_MOE_CONFIGS.setdefault(M8._key(E, H, I, block), {})["gemv_down"] = cfg
                    try:
                        sweep[f"{bn}x{bk}w{nw}"] = timed([lambda r=r: run(r, True) for r in range(R)])
                    except Exception as exc:  # a launch that does not fit: noted, not fatal
                        sweep[f"{bn}x{bk}w{nw}"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        M8.FP8_MOE_CONFIGS[M8._key(E, H, I, block)]["gemv_down"] = base
        t_default = timed([lambda r=r: run(r, True) for r in range(R)])
        num = {c: t for c, t in sweep.items() if isinstance(t, float)}
        best = min(num, key=num.get)
        # the gate_up GEMV alone, for the bytes: 8 experts x 2I x H e4m3
        gu = torch.empty(T * k, 2 * I, device=dev, dtype=torch.bfloat16)
        gcfg = M8.fp8_moe_gemv_config(E, 2 * I, H, block)
        t_gu = timed([lambda r=r: M8.moe_fp8_gemv(xs[r], wg, sg, idss[r].reshape(-1), gu, block, None, None, k, gcfg)
                      for r in range(R)])
        nbytes_gu = min(E, T * k) * 2 * I * H
        print(f"experts {key} T={T}: unfused {t_unfused:.2f} us, fused (default {base}) {t_default:.2f} us, "
              f"best {best} {num[best]:.2f} us; fused vs unfused rel err {err:.2e}; gate_up GEMV alone {t_gu:.2f} us "
              f"({nbytes_gu / t_gu / 1e3:.0f} GB/s on the active experts)")
        print("   sweep: " + ", ".join(f"{c} {t:.1f}" if isinstance(t, float) else f"{c} {t}" for c, t in sweep.items()))
        results[f"experts/{key}"] = dict(unfused_us=t_unfused, fused_default_us=t_default, default=base, best=best,
                                         best_us=num[best], sweep=sweep, rel_err=err, gate_up_gemv_us=t_gu,
                                         gate_up_bytes=nbytes_gu)
M8._FUSED_DOWN = None
if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
