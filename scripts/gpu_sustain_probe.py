"""Does a decode step slow down under sustained load (clocks, power)? Replays the decode graph of
batch B at context C (as scripts/gpu_tput_profile.py builds it) for S seconds and prints the mean
step time of each second with nvidia-smi's SM clock and power, on one H200:

    python scripts/gpu_sustain_probe.py scripts/configs/llama3-8b [B C S]
"""
import json
import subprocess
import sys
import time

import numpy as np
import torch

from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.workers.cuda_graphs import DecodeGraphs

cfg_dir = sys.argv[1]
B, C, S = (int(a) for a in (sys.argv[2:5] if len(sys.argv) >= 5 else (1000, 384, 20)))
cfg = json.load(open(f"{cfg_dir}/config.json"))
dev = torch.device("cuda")
n_layers = cfg["num_hidden_layers"]
model = load_stage_model(cfg_dir, cfg, StageInfo(0, 1, 0, n_layers), torch.bfloat16, dev, 4096, "dummy")
bs = 16
per_seq = -(-(C + 1) // bs)
kv = [torch.randn(model.kv_cache_shape(B * per_seq + 1, bs), dtype=torch.bfloat16, device=dev)
      for _ in range(n_layers)]
group = cfg["num_attention_heads"] // model.num_kv_heads
g = DecodeGraphs(model, kv, bs, 4096, B, B * per_seq * bs, torch.bfloat16, dev, group)
g.capture()
bt = np.random.default_rng(0).permutation(B * per_seq).reshape(B, per_seq).astype(np.int32)
pos = np.full(B, C, dtype=np.int64)
g.run(B, np.ones(B, dtype=np.int64), pos, bt[:, C // bs].astype(np.int64) * bs + C % bs, bt, None)
graph = g.graphs[g.bucket(B)]
torch.cuda.synchronize()


def smi() -> str:
    q = "clocks.sm,power.draw,temperature.gpu"
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
    except Exception as e:  # nvidia-smi missing
        return type(e).__name__


print(f"decode graph batch {B} context {C}: idle {smi()}")
t_end = time.time() + S
sec = 0
while time.time() < t_end:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    a.record()
    n = 0
    while time.time() - t0 < 1.0:
        for _ in range(5):
            graph.replay()
        n += 5
        torch.cuda.synchronize()
    b.record()
    torch.cuda.synchronize()
    sec += 1
    print(f"second {sec:3d}: {a.elapsed_time(b) / n:6.2f} ms/step over {n} steps  [{smi()}]")
