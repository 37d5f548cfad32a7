"""The batch-1 decode floor of a model on this GPU: the bytes a decode step must read (every weight of
the stage as ``zpp plan`` counts it, less the input embedding table, of which a step reads one row)
at the card's measured copy bandwidth (``scripts/fp8_gemv_card_sweep.py``'s ``copy_gbps``: a 1 GiB
device-to-device copy, bytes read + written). With ``--latency-json`` (``zpp bench latency
--output-json``) it prints the measured TPOT's ratio to the floor (issue 48: the Llama-3-70B shape
in W4A16 within 1.3x of its packed-weight read floor).

    python scripts/w4_tpot_floor.py scripts/configs/llama3-70b-w4a16 [--latency-json FILE]

Prints one JSON line: weight_bytes, embedding_bytes, read_bytes, copy_GBps, floor_ms and, with a
latency JSON, tpot_ms and tpot_over_floor. Needs CUDA (the bandwidth is this card's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemv_card_sweep import copy_gbps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model directory (config.json is enough)")
    ap.add_argument("--latency-json", help="zpp bench latency --output-json of the same model")
    args = ap.parse_args()

    from zpp import plan as zplan
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    config = zplan.plan_config(args.model, load_format="dummy")
    target = zplan.detect_target()
    p = zplan.make_plan(config, target, search=False)
    weight = sum(s.weight_bytes for s in p.stages)
    # The embedding table is read one row per token; a tied LM head reads it whole, so it stays.
    emb = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"] * 2
    bw = copy_gbps() * 1e9  # bytes per second
    out = {"model": args.model, "gpu": torch.cuda.get_device_name(), "weight_bytes": weight,
           "embedding_bytes": emb, "read_bytes": weight - emb, "copy_GBps": round(bw / 1e9, 1),
           "floor_ms": round((weight - emb) / bw * 1e3, 3)}
    if args.latency_json:
        tpot = json.load(open(args.latency_json))["tpot_ms"]
        out.update(tpot_ms=tpot, tpot_over_floor=round(tpot / out["floor_ms"], 3))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
