"""Time one CPU pipeline stage on a mixed micro-batch: decodes plus one prefill chunk.

Used to pick the CPU default of ``--max-num-batched-tokens``: at PP=2 on two cores each stage runs
on one thread, and a running stream waits about two stage-times of the micro-batch that carries a
prefill chunk between its tokens. Loads stage 0 of a PP=2 split of the model (first half of the
layers, real weights), one thread, and times ``--decodes`` decode rows (context 64) plus a chunk of
C tokens whose context ends at ``--context`` for each C.

Usage: ``python scripts/cpu_chunk_cost.py [--chunks 64,128,256,512,1024,2048] [--context 6000]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--chunks", default="64,128,256,384,512,1024,2048")
    p.add_argument("--context", type=int, default=6000, help="context length at the end of the chunk")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from zpp.workers.worker import keep_freed_memory
    keep_freed_memory()  # as a CPU stage does
    from zpp.demo import prepare_demo_model
    from zpp.models.base import StageInfo
    from zpp.models.layers.attention import build_attention_metadata
    from zpp.models.loader import load_stage_model
    from zpp.models.partition import partition_layers
    model_dir = args.model or prepare_demo_model()
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    n_layers = int(cfg["num_hidden_layers"])
    parts = partition_layers(n_layers, 2)
    stage = StageInfo(0, 2, *parts[0])
    model = load_stage_model(model_dir, cfg, stage, torch.float32, torch.device("cpu"), 8192)
    bs = 16
    ctx_blocks = -(-args.context // bs)
    num_blocks = ctx_blocks + args.decodes * 8 + 1
    Hk, D = model.num_kv_heads, model.head_dim
    kv = [torch.zeros(2, num_blocks, bs, Hk, D) for _ in range(model.num_local_layers)]
    rows = []
    for C in [int(c) for c in args.chunks.split(",")]:
        starts = [64] * args.decodes + [args.context - C]
        q_lens = [1] * args.decodes + [C]
        tables = [list(range(ctx_blocks + i * 8, ctx_blocks + (i + 1) * 8)) for i in range(args.decodes)]
        tables.append(list(range(ctx_blocks)))
        T = sum(q_lens)
        ids = torch.randint(100, 40000, (T,))
        pos = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, q_lens)])
        times = []
        with torch.inference_mode():
            for _ in range(args.iters + 1):
                t = time.perf_counter()
                meta = build_attention_metadata(starts, q_lens, tables, bs, torch.device("cpu"))
                model(ids, pos, None, kv, meta)
                times.append(time.perf_counter() - t)
        med = statistics.median(times[1:])
        rows.append({"chunk": C, "stage_s": round(med, 4), "ms_per_chunk_token": round(1000 * med / C, 3)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"context": args.context, "decodes": args.decodes, "threads": args.threads,
                      "layers": list(parts[0]), "loadavg": os.getloadavg(), "rows": rows}))


if __name__ == "__main__":
    main()
