"""CPU micro-benchmark: a stage's linear layers at few rows, MKL's ``F.linear`` against oneDNN with
packed weights (``zpp.models.layers.cpu_linear``), float32.

    python scripts/cpu_linear_bench.py [--threads 1] [--layers 15] [--rounds 7] [--rows 1,2,3,4,5,6]

SmolLM2-135M's shapes (the demo model: qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down
576 x 1536; LM head 49152 x 576), ``--layers`` distinct weights per shape cycled so that they come
from memory as in a stage of the model (15 = one stage at PP=2), one thread per stage as zpp's CPU
workers run at PP=2 on 2 cores. Every (rows, formulation) pair runs once per round, rounds
interleaved (the VM's load hits all alike); prints each pair's median ms per pass over the layers,
and the largest difference from ``F.linear`` and between a row computed alone and in the batch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from zpp.models.layers.cpu_linear import pack_weight, packed_linear  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,2,3,4,5,6")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense = {n: [torch.randn(o, i) * 0.05 for _ in range(args.layers)] for n, (o, i) in SHAPES.items()}
    packed = {n: [pack_weight(w) for w in ws] for n, ws in dense.items()}
    head = torch.randn(*LM_HEAD) * 0.05
    head_p = pack_weight(head)
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {r: {n: torch.randn(r, SHAPES[n][1]) for n in SHAPES} for r in rows}

    def layers(r: int, use_packed: bool) -> None:
        for i in range(args.layers):
            for n, x in inputs[r].items():
                packed_linear(x, packed[n][i]) if use_packed else F.linear(x, dense[n][i])

    def lm(r: int, use_packed: bool) -> None:
        x = inputs[r]["qkv"]
        packed_linear(x, head_p) if use_packed else F.linear(x, head)

    runs = {(what, r, p): (fn, r, p) for what, fn in (("layers", layers), ("lm_head", lm)) for r in rows
            for p in (False, True)}
    times: dict = {key: [] for key in runs}
    for key, (fn, r, p) in runs.items():  # warm-up
        fn(r, p)
    for _ in range(args.rounds):
        for key, (fn, r, p) in runs.items():
            t = time.perf_counter()
            fn(r, p)
            times[key].append(1e3 * (time.perf_counter() - t))
    print(f"threads {args.threads}, {args.layers} layers per pass, median of {args.rounds} rounds (ms); load average "
          f"{os.getloadavg()}")
    for what in ("layers", "lm_head"):
        base = statistics.median(times[(what, 1, False)])
        for r in rows:
            a, b = statistics.median(times[(what, r, False)]), statistics.median(times[(what, r, True)])
            print(f"{what:8s} rows {r}: F.linear {a:7.2f} ({a / base:.2f}x its 1 row)   oneDNN packed {b:7.2f} "
                  f"({b / statistics.median(times[(what, 1, True)]):.2f}x its 1 row)   F.linear / oneDNN {a / b:.2f}x")
    w, wp = dense["gate_up"][0], packed["gate_up"][0]
    for r in rows:
        x = inputs[r]["qkv"]
        y = packed_linear(x, wp)
        alone = torch.cat([packed_linear(x[j:j + 1], wp) for j in range(r)])
        print(f"gate_up rows {r}: max |oneDNN - F.linear| {(y - F.linear(x, w)).abs().max().item():.2e}, max |row in "
              f"batch - row alone| oneDNN {(y - alone).abs().max().item():.2e}, F.linear "
              f"{(F.linear(x, w) - torch.cat([F.linear(x[j:j + 1], w) for j in range(r)])).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
