"""ZPP_TRACE: the engine and every stage write a consistent per-micro-batch timeline, and
scripts/trace_report.py summarizes it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_trace_timeline_is_consistent(demo_model, tmp_path, monkeypatch):
    from zpp import LLM, SamplingParams
    monkeypatch.setenv("ZPP_TRACE", str(tmp_path))
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    with LLM(demo_model, pipeline_parallel_size=2, kv_cache_memory="64MiB") as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert sorted(os.listdir(tmp_path)) == ["engine.json", "rank0-stage0.json", "rank1-stage1.json"]

    def events(name):
        out: dict[str, dict[int, float]] = {}
        for what, bid, t in json.load(open(tmp_path / name)):
            out.setdefault(what, {})[bid] = t
        return out

    eng, s0, s1 = events("engine.json"), events("rank0-stage0.json"), events("rank1-stage1.json")
    assert set(eng["result"]) == set(eng["send"]) == set(eng["applied"])
    assert len(eng["send"]) >= 8  # at least one batch per generated token
    for b, t in eng["send"].items():
        assert t <= s0["msg"][b] <= s0["gpu_start"][b] <= s0["gpu_end"][b]
        # Stage 1 computes a batch only after stage 0 has finished it; its result reaches the
        # engine after it was sent and is applied after that.
        assert s0["gpu_end"][b] <= s1["gpu_start"][b] <= s1["gpu_end"][b] <= s1["result_sent"][b]
        assert s1["result_sent"][b] <= eng["result"][b] <= eng["applied"][b]
    report = subprocess.run([sys.executable, "scripts/trace_report.py", str(tmp_path)], capture_output=True,
                            text=True, check=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert "stage 0 (rank0-stage0): busy" in report.stdout and "stage 1 (rank1-stage1): busy" in report.stdout
