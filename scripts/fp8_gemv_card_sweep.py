"""The batch-1 decode GEMVs of the Llama-3-8B shape on the card at hand (H100 or H200), in CUDA graphs:
zpp's W8A16 ``fp8_gemv`` over a grid of launches for each of the layer's four products, and the
bf16 LM head (cuBLAS against zpp's Triton ``gemv``), against the card's device-to-device copy rate.

Each case is replayed from one CUDA graph over enough weight copies to pass the L2 (as
``gemv_sweep.py``). Prints, per shape, the default launch (``fp8_gemv_config``) and the five
fastest, then the per-layer sum of the per-shape bests against the default, and a JSON line.

    python scripts/fp8_gemv_card_sweep.py [--quick] [--json OUT] [--write-config FILE]
"""
import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from zpp.models.layers import triton_ops as ops
from zpp.models.quantization import fp8_kernels as K8
from zpp.models.quantization.fp8_utils import quantize_per_channel

sys.path.insert(0, "scripts")
from gemv_sweep import graph_us  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = (128256, 4096)


def copy_gbps() -> float:
    """Device-to-device copy rate, GB/s counting bytes read and written (1 GiB, median of 10)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    ts.sort()
    return 2 * a.numel() / (ts[5] * 1e-3) / 1e9


def attention_splits(ctx: int = 256, layers: int = 32) -> dict:
    """Batch-1 decode attention (Llama-3-8B heads: 32 query, 8 KV, head 128; bf16 cache, 16-token
    blocks) over ``ctx`` keys, ``layers`` launches in one graph, at each split count (16: what
    ``decode_splits`` picks at batch 1; > 1 adds the merge kernel, or merges in the last split program). us per layer."""
    hq, hk, d, bs = 32, 8, 128, 16
    nb = ctx // bs
    caches = [(torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16),
               torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(1, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    bt = torch.arange(nb, device="cuda", dtype=torch.int32).view(1, nb)
    sl = torch.tensor([ctx], device="cuda", dtype=torch.int32)
    qsv = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    ts = torch.zeros(1, device="cuda", dtype=torch.int32)
    res = {}
    for splits in (1, 2, 4, 8, 16):
        f = lambda q, c, s=splits: ops.paged_attention(q, c[0], c[1], out, bt, sl, qsv, ts, ts, 0.088, 16, s)
        t = graph_us(f, caches, q)
        res[splits] = t
        print(f"attention batch 1, ctx {ctx}, splits {splits:2d}: {t:6.2f} us per layer", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller launch grid")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-config", default=None, help="write each shape's fastest launch here "
                    "(ZPP_FP8_GEMV_CONFIG_FILE's format)")
    a = ap.parse_args()
    torch.manual_seed(0)
    card = torch.cuda.get_device_name()
    cp = copy_gbps()
    print(f"{card}: device copy {cp:.0f} GB/s", flush=True)
    if a.quick:
        grid = list(itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8), (3,)))
    else:
        grid = list(itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8), (2, 3)))
    out = {"device": card, "copy_gbps": cp, "fp8": {}, "lm_head": {}, "attention": attention_splits()}
    best_sum = default_sum = 0.0
    for name, (n, k) in SHAPES.items():
        copies = max(4, int(3 * 50e6 // (n * k)) + 1)
        ws = []
        for _ in range(copies):
            q, s = quantize_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            ws.append((q, s.float().view(-1)))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gb = n * k / 1e9
        dflt = K8.fp8_gemv_config(n, k)
        ref = K8.fp8_gemv(x, ws[0][0], ws[0][1], **dflt).float()
        rows = []
        for bn, bk, nw, ns in grid:
            cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            f = lambda x, w, cfg=cfg: K8.fp8_gemv(x, w[0], w[1], **cfg)
            try:
                err = ((f(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                t = graph_us(f, ws, x)
            except Exception as e:  # out of registers / shared memory
                print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                continue
            rows.append((t, cfg, err))
        rows.sort(key=lambda r: r[0])
        swept = {tuple(sorted(c.items())): t for t, c, _ in rows}
        t_def = swept.get(tuple(sorted({"num_stages": 3, **dflt}.items())))  # fp8_gemv's num_stages is 3
        if t_def is None:
            t_def = graph_us(lambda x, w: K8.fp8_gemv(x, w[0], w[1], **dflt), ws, x)
        print(f"{name:8} default {dflt}: {t_def:7.2f} us {gb / t_def * 1e6:6.0f} GB/s "
              f"({gb / t_def * 1e6 / cp:.0%} of copy)", flush=True)
        for t, cfg, err in rows[:5]:
            print(f"{name:8} {cfg}: {t:7.2f} us {gb / t * 1e6:6.0f} GB/s ({gb / t * 1e6 / cp:.0%}) rel.err {err:.1e}",
                  flush=True)
        out["fp8"][name] = {"default_us": t_def, "best": [(t, c) for t, c, _ in rows[:5]],
                            "all": [(t, c) for t, c, _ in rows]}
        best_sum += rows[0][0]
        default_sum += t_def
        del ws
        torch.cuda.empty_cache()
    print(f"per layer: default {default_sum:.1f} us, per-shape bests {best_sum:.1f} us "
          f"(x32 layers: {default_sum * 32 / 1000:.3f} -> {best_sum * 32 / 1000:.3f} ms)", flush=True)
    out["layer_default_us"], out["layer_best_us"] = default_sum, best_sum
    n, k = LM_HEAD
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    gb = n * k * 2 / 1e9
    t = graph_us(lambda x, w: F.linear(x, w), ws, x)
    print(f"lm_head  cublas: {t:7.2f} us {gb / t * 1e6:6.0f} GB/s ({gb / t * 1e6 / cp:.0%})", flush=True)
    out["lm_head"]["cublas_us"] = t
    rows = []
    for bn, bk, nw in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8)):
        cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=3)
        try:
            t = graph_us(lambda x, w, cfg=cfg: ops.gemv(x, w, **cfg), ws, x)
        except Exception as e:
            print(f"  lm_head {cfg}: {type(e).__name__}", flush=True)
            continue
        rows.append((t, cfg))
    rows.sort(key=lambda r: r[0])
    for t, cfg in rows[:3]:
        print(f"lm_head  triton {cfg}: {t:7.2f} us {gb / t * 1e6:6.0f} GB/s ({gb / t * 1e6 / cp:.0%})", flush=True)
    out["lm_head"]["triton_best"] = rows[:3]
    print(json.dumps({"device": card, "copy_gbps": cp, "layer_default_us": default_sum, "layer_best_us": best_sum,
                      "best": {s: out["fp8"][s]["best"][0] for s in SHAPES}}))
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    if a.write_config:
        json.dump({f"{n},{k}": out["fp8"][name]["best"][0][1] for name, (n, k) in SHAPES.items()},
                  open(a.write_config, "w"), indent=1)


if __name__ == "__main__":
    main()
