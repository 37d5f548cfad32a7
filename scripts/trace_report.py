"""Summarize a ZPP_TRACE directory: where each stage's idle time goes; or turn it into a timeline.

    ZPP_TRACE=/tmp/tr zpp bench throughput ... ; python scripts/trace_report.py /tmp/tr
    python scripts/trace_report.py /tmp/tr --perfetto timeline.json   # open in ui.perfetto.dev

Per stage: device busy fraction over the run, and the idle gaps between consecutive batches split
by cause: the batch's message had not reached the worker yet (engine-bound), the previous stage's
activations were not ready (pipeline-bound), or neither (the worker's own host work). Then the
mean latency of each hop of the loop, in milliseconds.

``--perfetto OUT.json`` writes the Chrome trace-event format (``{"traceEvents": [...]}``, complete
``X`` events in microseconds, ``M`` events naming processes and threads) that ui.perfetto.dev and
chrome://tracing open: one process per stage worker with three threads (``device``: the stage's
forward of each micro-batch; ``host``: the worker handling it, from reading its message to
launching it; ``waiting``: for the micro-batch's message, for the previous stage's activations) and
one for the engine (``loop``: schedule, send, apply each micro-batch's result). Every slice is named
``b<batch id> ...`` and carries ``batch``, ``tokens`` and ``seqs`` in its args. The files of a
one-host run share ``time.monotonic()`` (see ``zpp/trace.py``); files from several hosts are put
on the wall clock instead.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Optional


def load(path: str) -> dict[str, dict[int, float]]:
    """``{event: {batch id: t}}`` (the first time of each); the ``clock`` event is left out."""
    ev: dict[str, dict[int, float]] = defaultdict(dict)
    with open(path) as f:
        for e in json.load(f):
            if e[0] != "clock":
                ev[e[0]].setdefault(e[1], e[2])
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


# --- Perfetto / Chrome trace-event JSON -------------------------------------------------------------
ENGINE_PID = 1
DEVICE_TID, HOST_TID, WAIT_TID = 1, 2, 3


def _read(path: str) -> tuple[dict, list]:
    """(the ``clock`` event's args or {}, the other events as [what, batch id, t, args])."""
    clock, out = {}, []
    with open(path) as f:
        for e in json.load(f):
            if e[0] == "clock":
                clock = dict(e[3], mono=e[2])
            else:
                out.append([e[0], e[1], e[2], e[3] if len(e) > 3 else None])
    return clock, out


def perfetto(d: str) -> dict:
    """The trace directory ``d`` as a Chrome trace-event document (a dict ready for ``json.dump``).

    Times become microseconds from the first event of the run. Raises FileNotFoundError when
    ``d`` has no ``engine.json``.
    """
    files = {"engine": os.path.join(d, "engine.json")}
    if not os.path.exists(files["engine"]):
        raise FileNotFoundError(f"{files['engine']}: not a ZPP_TRACE directory")
    for p in glob.glob(os.path.join(d, "rank*-stage*.json")):
        files[os.path.basename(p)[:-5]] = p
    read = {name: _read(p) for name, p in files.items()}
    # One host: time.monotonic() is shared, use it as is. Several: map each file to wall time.
    hosts = {c.get("host") for c, _ in read.values()}
    offset = {name: (c["wall"] - c["mono"] if len(hosts) > 1 and "wall" in c else 0.0)
              for name, (c, _) in read.items()}
    t0 = min(e[2] + offset[name] for name, (_, evs) in read.items() for e in evs)

    def us(name: str, t: float) -> float:
        return round((t + offset[name] - t0) * 1e6, 3)

    eng = read["engine"][1]
    info: dict[int, dict] = {}
    for what, bid, _, args in eng:
        if what == "send":
            info[bid] = {"batch": bid, **{k: v for k, v in (args or {}).items() if k != "after_idle"}}
    after_idle = {bid for what, bid, _, args in eng if what == "send" and args and args.get("after_idle")}

    out: list[dict] = []

    def meta(pid: int, tid: Optional[int], kind: str, value) -> None:
        e = {"ph": "M", "pid": pid, "name": kind, "args": {"name" if "name" in kind else "sort_index": value}}
        if tid is not None:
            e["tid"] = tid
        out.append(e)

    def span(name: str, pid: int, tid: int, label: str, bid: int, a: float, b: float, cat: str) -> None:
        out.append({"ph": "X", "pid": pid, "tid": tid, "name": f"b{bid} {label}", "cat": cat,
                    "ts": us(name, a), "dur": round(max(0.0, b - a) * 1e6, 3),
                    "args": info.get(bid, {"batch": bid})})

    # Engine: the core loop is one thread; its schedule / send / apply never overlap.
    meta(ENGINE_PID, None, "process_name", "engine")
    meta(ENGINE_PID, None, "process_sort_index", 0)
    meta(ENGINE_PID, 1, "thread_name", "loop")
    by = defaultdict(dict)
    for what, bid, t, _ in eng:
        by[what].setdefault(bid, t)
    for bid, t in by["schedule"].items():
        if bid in by["send"]:
            span("engine", ENGINE_PID, 1, "schedule", bid, t, by["send"][bid], "engine")
    for bid, t in by["send"].items():
        if bid in by["sent"]:
            span("engine", ENGINE_PID, 1, "send", bid, t, by["sent"][bid], "engine")
    for bid, t in by["apply_start"].items():
        if bid in by["applied"]:
            span("engine", ENGINE_PID, 1, "apply result", bid, t, by["applied"][bid], "engine")
    for bid, t in by["result"].items():
        out.append({"ph": "i", "s": "t", "pid": ENGINE_PID, "tid": 1, "name": f"b{bid} result received",
                    "cat": "engine", "ts": us("engine", t), "args": info.get(bid, {"batch": bid})})

    # Stages: one process per worker, ordered by stage then TP rank.
    workers = sorted((n for n in read if n != "engine"),
                     key=lambda n: (int(n.rsplit("stage", 1)[1]), int(n[4:n.index("-")])))
    for i, name in enumerate(workers):
        pid = ENGINE_PID + 1 + i
        rank, stage = int(name[4:name.index("-")]), int(name.rsplit("stage", 1)[1])
        meta(pid, None, "process_name", f"stage {stage} (rank {rank})")
        meta(pid, None, "process_sort_index", 1 + i)
        for tid, tname in ((DEVICE_TID, "device"), (HOST_TID, "host"), (WAIT_TID, "waiting")):
            meta(pid, tid, "thread_name", tname)
            meta(pid, tid, "thread_sort_index", tid)
        evs = read[name][1]
        ev = defaultdict(dict)
        for what, bid, t, _ in evs:
            ev[what].setdefault(bid, t)
        for bid, t in ev["gpu_start"].items():
            if bid in ev["gpu_end"]:
                span(name, pid, DEVICE_TID, "forward", bid, t, ev["gpu_end"][bid], "device")
        for bid, t in ev["msg"].items():
            if bid in ev["launched"]:
                span(name, pid, HOST_TID, "execute", bid, t, ev["launched"][bid], "host")
        for bid, t in ev["acts_wait"].items():
            if bid in ev["acts_ready"]:
                span(name, pid, WAIT_TID, "wait activations", bid, t, ev["acts_ready"][bid], "wait")
        # Waiting for a micro-batch's message: from when the worker was last free (it launched the
        # previous batch and sent any result) until it read this one. Not drawn before a batch the
        # engine sent after running out of work (that gap is no work, not a bubble).
        free = sorted(t for what, _, t, _ in evs if what in ("launched", "result_sent"))
        for bid, t in ev["msg"].items():
            k = bisect.bisect_right(free, t)
            if k and bid not in after_idle:
                span(name, pid, WAIT_TID, "wait message", bid, free[k - 1], t, "wait")
    return {"traceEvents": out, "displayTimeUnit": "ms"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the ZPP_TRACE directory")
    ap.add_argument("--perfetto", metavar="OUT.json", help="write the timeline as Chrome trace-event JSON")
    a = ap.parse_args()
    main(a.dir)
    if a.perfetto:
        doc = perfetto(a.dir)
        with open(a.perfetto, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        n = sum(e["ph"] == "X" for e in doc["traceEvents"])
        print(f"wrote {a.perfetto}: {n} slices; open it in https://ui.perfetto.dev")
