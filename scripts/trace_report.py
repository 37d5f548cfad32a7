"""Summarize a ZPP_TRACE directory: where each stage's idle time goes.

    ZPP_TRACE=/tmp/tr zpp bench throughput ... ; python scripts/trace_report.py /tmp/tr

Per stage: device busy fraction over the run, and the idle gaps between consecutive batches split
by cause: the batch's message had not reached the worker yet (engine-bound), the previous stage's
activations were not ready (pipeline-bound), or neither (the worker's own host work). Then the
mean latency of each hop of the loop, in milliseconds.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from collections import defaultdict


def load(path: str) -> dict[str, dict[int, float]]:
    ev: dict[str, dict[int, float]] = defaultdict(dict)
    with open(path) as f:
        for what, bid, t in json.load(f):
            ev[what].setdefault(bid, t)
    return ev


def mean_ms(pairs) -> str:
    vals = [(b - a) * 1e3 for a, b in pairs]
    return f"{statistics.mean(vals):7.2f}" if vals else "    n/a"


def main(d: str) -> None:
    eng = load(os.path.join(d, "engine.json"))
    stages = {}
    for p in sorted(glob.glob(os.path.join(d, "rank*-stage*.json"))):
        name = os.path.basename(p)[:-5]
        stage = int(name.rsplit("stage", 1)[1])
        stages.setdefault(stage, (name, load(p)))  # first TP rank of each stage
    batches = sorted(eng["result"])
    t0, t1 = min(eng["send"].values()), max(eng["result"].values())
    print(f"{len(batches)} batches over {t1 - t0:.2f} s")
    for s in sorted(stages):
        name, ev = stages[s]
        ids = [b for b in batches if b in ev.get("gpu_start", {})]
        busy = sum(ev["gpu_end"][b] - ev["gpu_start"][b] for b in ids)
        gaps = defaultdict(float)
        for prev, b in zip(ids, ids[1:]):
            idle_from = ev["gpu_end"][prev]
            gap = ev["gpu_start"][b] - idle_from
            if gap <= 0:
                continue
            msg_late = max(0.0, min(gap, ev["msg"][b] - idle_from))
            acts_late = 0.0
            if s > 0 and b in stages[s - 1][1].get("gpu_end", {}):
                acts_late = max(0.0, min(gap, stages[s - 1][1]["gpu_end"][b] - idle_from) - msg_late)
            gaps["message late"] += msg_late
            gaps["activations late"] += acts_late
            gaps["worker host work"] += gap - msg_late - acts_late
        total = t1 - t0
        print(f"stage {s} ({name}): busy {busy / total:.2f}; idle " +
              ", ".join(f"{k} {v / total:.2f}" for k, v in gaps.items()))
        print(f"  engine send -> worker msg {mean_ms((eng['send'][b], ev['msg'][b]) for b in ids)} ms;"
              f" msg -> launched {mean_ms((ev['msg'][b], ev['launched'][b]) for b in ids)} ms;"
              f" device time {mean_ms((ev['gpu_start'][b], ev['gpu_end'][b]) for b in ids)} ms")
    last = stages[max(stages)][1]
    ids = [b for b in batches if b in last.get("gpu_end", {}) and b in last.get("result_sent", {})]
    print(f"last stage device end -> result sent {mean_ms((last['gpu_end'][b], last['result_sent'][b]) for b in ids)} ms;"
          f" -> engine got it {mean_ms((last['result_sent'][b], eng['result'][b]) for b in ids)} ms")
    ids = [b for b in batches if b in eng["applied"]]
    print(f"engine: result -> applied {mean_ms((eng['result'][b], eng['applied'][b]) for b in ids)} ms;"
          f" applied -> next send {mean_ms((eng['applied'][b], min((t for t in eng['send'].values() if t >= eng['applied'][b]), default=eng['applied'][b])) for b in ids)} ms")


if __name__ == "__main__":
    main(sys.argv[1])
