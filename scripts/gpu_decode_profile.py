"""Where a batch-1 decode step's GPU time goes, kernel by kernel (issue 47): one stage built in-process
(dummy weights, no engine), the batch-1 decode CUDA graph captured at context C, its replay timed
(median of 7 runs of 50 replays), then 5 replays under torch.profiler and every kernel's device time
per step, grouped by kernel name, next to the sum of all kernels (the rest of the replay time is the
gaps between kernels inside the graph).

    python scripts/gpu_decode_profile.py CONFIG_DIR [--fp8] [--ctx C] [--json OUT.json] [--rows N]

--fp8 quantizes at load as ``--quantization fp8`` (experts too). Prints ``replay ms/step``, ``kernel
sum ms/step``, ``kernels/step`` and the table (us/step, launches/step, us per launch).
"""
import argparse
import json
import statistics
import sys

import numpy as np
import torch

from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.workers.cuda_graphs import DecodeGraphs

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--fp8", action="store_true")
ap.add_argument("--ctx", type=int, default=192)
ap.add_argument("--json")
ap.add_argument("--rows", type=int, default=30)
ap.add_argument("--label", default="")
args = ap.parse_args()
cfg = json.load(open(f"{args.config}/config.json"))
dev = torch.device("cuda")
n_layers = cfg["num_hidden_layers"]
model = load_stage_model(args.config, cfg, StageInfo(0, 1, 0, n_layers), torch.bfloat16, dev, 4096, "dummy",
                         quantization="fp8" if args.fp8 else None)
bs, C = 16, args.ctx
blocks_per_seq = -(-(C + 1) // bs)
num_blocks = 4 * blocks_per_seq
kv = [torch.zeros(2, num_blocks + 1, bs, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16, device=dev)
      for _ in range(n_layers)]
group = cfg["num_attention_heads"] // model.num_kv_heads
g = DecodeGraphs(model, kv, bs, 4096, 1, num_blocks * bs, torch.bfloat16, dev, group)
g.capture()
pos = np.full(1, C, dtype=np.int64)
bt = np.arange(blocks_per_seq, dtype=np.int32).reshape(1, blocks_per_seq)
slots = bt[:, C // bs].astype(np.int64) * bs + C % bs
rng = np.random.default_rng(0)
ids = rng.integers(0, cfg["vocab_size"], 1).astype(np.int64)
for _ in range(3):
    g.run(1, ids, pos, slots, bt, None)
torch.cuda.synchronize()
graph = g.graphs[g.bucket(1)]
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(7):
    a.record()
    for _ in range(50):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    times.append(a.elapsed_time(b) / 50)
replay = statistics.median(times)
steps = 5
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
rows = []
for e in prof.key_averages():
    t = getattr(e, "self_device_time_total", None)
    if t is None:
        t = e.self_cuda_time_total
    if t <= 0:
        continue
    rows.append((e.key, t / steps, e.count / steps))
rows.sort(key=lambda r: -r[1])
ksum = sum(r[1] for r in rows) / 1000
nk = sum(r[2] for r in rows)
tag = f"{args.label or args.config}{' fp8' if args.fp8 else ' bf16'}"
print(f"[{tag}] {torch.cuda.get_device_name()}: replay {replay:.3f} ms/step (runs {min(times):.3f}-{max(times):.3f}), "
      f"kernel sum {ksum:.3f} ms/step, {nk:.0f} kernels/step, gaps {replay - ksum:.3f} ms "
      f"({(replay - ksum) / max(nk, 1) * 1000:.2f} us per kernel)")
print(f"{'kernel':90s} {'us/step':>9s} {'n/step':>7s} {'us each':>8s}")
for name, t, n in rows[:args.rows]:
    print(f"{name[:90]:90s} {t:9.1f} {n:7.0f} {t / max(n, 1e-9):8.2f}")
if args.json:
    json.dump(dict(label=tag, device=torch.cuda.get_device_name(), replay_ms=replay, replay_runs_ms=times,
                   kernel_sum_ms=ksum, kernels_per_step=nk,
                   kernels=[dict(name=n, us_per_step=t, per_step=c) for n, t, c in rows]), open(args.json, "w"), indent=1)
sys.stdout.flush()
