"""ZPP_TRACE: the engine and every stage write a consistent per-micro-batch timeline,
scripts/trace_report.py summarizes it and ``--perfetto`` turns it into a Chrome trace-event
timeline (one process per stage plus the engine) that ui.perfetto.dev opens."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trace_dir(tiny_llama, tmp_path_factory):
    """A PP=2 CPU generation (6 prompts x 8 tokens) traced into a directory (the session's tiny
    random-weight Llama: the timeline, not the text, is checked)."""
    from zpp import LLM, SamplingParams
    d = tmp_path_factory.mktemp("trace")
    mp = pytest.MonkeyPatch()
    mp.setenv("ZPP_TRACE", str(d))
    try:
        prompts = [[1, 2, 3, 4 + i] for i in range(6)]
        with LLM(tiny_llama, pipeline_parallel_size=2, kv_cache_memory="64MiB") as llm:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        mp.undo()
    return d


def events(path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for e in json.load(open(path)):
        out.setdefault(e[0], {})[e[1]] = e[2]
    return out


def test_trace_timeline_is_consistent(trace_dir):
    assert sorted(os.listdir(trace_dir)) == ["engine.json", "rank0-stage0.json", "rank1-stage1.json"]
    eng, s0, s1 = (events(trace_dir / n) for n in ("engine.json", "rank0-stage0.json", "rank1-stage1.json"))
    assert set(eng["result"]) == set(eng["send"]) == set(eng["applied"]) == set(eng["schedule"])
    assert len(eng["send"]) >= 8  # at least one batch per generated token
    for b, t in eng["send"].items():
        # (A worker may read the batch before the engine has put it on the last worker's socket.)
        assert eng["schedule"][b] <= t <= eng["sent"][b] and t <= s0["msg"][b] <= s0["gpu_start"][b] <= s0["gpu_end"][b]
        # Stage 1 computes a batch only after stage 0 has finished it (it waits for the activations
        # in between); its result reaches the engine after it was sent and is applied after that.
        assert s1["msg"][b] <= s1["acts_wait"][b] <= s1["acts_ready"][b] <= s1["gpu_start"][b]
        assert s0["gpu_end"][b] <= s1["acts_ready"][b]
        assert s1["gpu_start"][b] <= s1["gpu_end"][b] <= s1["result_sent"][b]
        assert s1["result_sent"][b] <= eng["result"][b] <= eng["apply_start"][b] <= eng["applied"][b]
    # Every file starts with the clock event: its monotonic time, wall time and host.
    first = json.load(open(trace_dir / "engine.json"))[0]
    assert first[0] == "clock" and {"wall", "host", "pid"} <= set(first[3])
    report = subprocess.run([sys.executable, "scripts/trace_report.py", str(trace_dir)], capture_output=True,
                            text=True, check=True, cwd=ROOT)
    assert "stage 0 (rank0-stage0): busy" in report.stdout and "stage 1 (rank1-stage1): busy" in report.stdout


def test_perfetto_timeline(trace_dir, tmp_path):
    out = tmp_path / "timeline.json"
    subprocess.run([sys.executable, "scripts/trace_report.py", str(trace_dir), "--perfetto", str(out)],
                   capture_output=True, text=True, check=True, cwd=ROOT)
    doc = json.load(open(out))
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == ["engine", "stage 0 (rank 0)", "stage 1 (rank 1)"]
    pid = {v: k for k, v in procs.items()}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    for s in ("stage 0 (rank 0)", "stage 1 (rank 1)"):
        assert {n for (p, _), n in threads.items() if p == pid[s]} == {"device", "host", "waiting"}
    spans = [e for e in evs if e["ph"] == "X"]
    assert spans and all(e["ts"] >= 0 and e["dur"] >= 0 and (e["pid"], e["tid"]) in threads for e in spans)
    assert all(e["name"].startswith(f"b{e['args']['batch']} ") for e in spans)

    def lane(proc: str, thread: str) -> list[dict]:
        return sorted((e for e in spans if e["pid"] == pid[proc] and threads[(e["pid"], e["tid"])] == thread),
                      key=lambda e: e["ts"])

    engine = lane("engine", "loop")
    sent = {e["args"]["batch"] for e in engine if e["name"].endswith(" send")}
    assert sent and {e["args"]["batch"] for e in engine if e["name"].endswith(" apply result")} == sent
    assert all(e["args"]["tokens"] >= 1 and e["args"]["seqs"] >= 1 for e in engine)
    for s in ("stage 0 (rank 0)", "stage 1 (rank 1)"):
        device = lane(s, "device")
        # Every micro-batch the engine sent ran on every stage, once, labelled with its token count.
        assert sorted(e["args"]["batch"] for e in device) == sorted(sent)
        assert all(e["args"]["tokens"] >= 1 for e in device)
        # One forward at a time: the device lane's slices do not overlap (1 us for rounding).
        for a, b in zip(device, device[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (s, a, b)
        assert {e["args"]["batch"] for e in lane(s, "host")} == sent
    waits = lane("stage 1 (rank 1)", "waiting")
    assert {e["args"]["batch"] for e in waits if e["name"].endswith("wait activations")} == sent
    assert any(e["name"].endswith("wait message") for e in waits)
