"""The periodic stats line, without an engine: a stand-in returns the counters of each call."""
from __future__ import annotations

import re

from zpp.transport.core_messages import EngineStats
from zpp.server.metrics import StatsLogger


class _Counters:
    def __init__(self, seq):
        self.seq = list(seq)

    def stats(self):
        return self.seq.pop(0)


def test_stage_busy_is_a_fraction_of_the_interval_even_when_a_long_batch_lands_in_it():
    """A stage reports its busy seconds with each result, so an interval can receive more busy time
    than it lasted (a 30 s micro-batch ending in a 10 s interval); the line says 100%, not 300%."""
    start = EngineStats(num_running=1, stage_busy_s=[0.0, 0.0])
    late = EngineStats(num_running=1, stage_busy_s=[1e6, 0.0], num_generation_tokens=5)
    log = StatsLogger(_Counters([start, late]), metrics=None, interval_s=10.0)
    line = log.log_once()
    busy = [int(x) for x in re.findall(r"(\d+)%", line.split("Stage busy:")[1])]
    assert busy == [100, 0], line


def test_first_line_counts_stage_busy_from_zero(monkeypatch):
    """Before the stages' first report the busy totals are empty; the first line said "Stage busy: -".
    Now it counts from 0, and leaves the field out while no stage has reported at all."""
    import itertools
    import types

    import zpp.server.metrics as metrics
    clock = itertools.count(0.0, 10.0)  # 10 s between snapshots
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    nothing = EngineStats(num_running=1)
    first = EngineStats(num_running=1, stage_busy_s=[2.0, 1.0], num_generation_tokens=5)
    log = StatsLogger(_Counters([nothing, first]), metrics=None, interval_s=10.0)
    line = log.log_once()
    assert line.endswith("KV cache usage: 0.0%, Stage busy: 0: 20%, 1: 10%"), line
    log = StatsLogger(_Counters([nothing, nothing]), metrics=None, interval_s=10.0)
    assert "Stage busy" not in log.log_once()


def test_speculative_decoding_figures_over_the_interval():
    """With drafts sent in the interval: the mean acceptance length (1 + accepted / verify chunks)
    and the draft acceptance rate of the interval alone; without any, neither field."""
    a = EngineStats(num_running=1, spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=5)
    b = EngineStats(num_running=1, spec_num_drafts=30, spec_num_draft_tokens=90, spec_num_accepted_tokens=35,
                    num_generation_tokens=5)
    line = StatsLogger(_Counters([a, b]), metrics=None, interval_s=10.0).log_once()
    assert line.endswith("Mean acceptance length: 2.50, Draft acceptance rate: 50.0%"), line
    assert "acceptance" not in StatsLogger(_Counters([b, b]), metrics=None, interval_s=10.0).log_once()
