"""A per-micro-batch timeline of the engine and every worker, for performance work.

Off unless ``ZPP_TRACE=DIR`` is set (then every process of the run, workers included, writes
``DIR/<name>.json`` when it stops). Each event is ``[what, batch_id, t]`` with ``t`` in seconds of
``time.monotonic()``, a clock shared by every process of one host; a worker's GPU intervals are
mapped onto it through one CUDA event recorded right after a device synchronize.
``python scripts/trace_report.py DIR`` turns the files into per-stage busy / idle figures.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

class Trace:
    """Collects events in memory; ``dump()`` writes them (a no-op when tracing is off)."""

    def __init__(self, name: str):
        self.name = name
        self.events: list[tuple[str, int, float]] = []
        self.dir = os.environ.get("ZPP_TRACE") or None
        self.enabled = self.dir is not None
        self._cuda_ref = None

    def mark(self, what: str, batch_id: int, t: Optional[float] = None) -> None:
        if self.enabled:
            self.events.append((what, batch_id, time.monotonic() if t is None else t))

    # GPU intervals ---------------------------------------------------------------------------
    def cuda_clock(self):
        """(reference CUDA event, its host time): GPU event times convert to host time as
        ``t_ref + ref.elapsed_time(ev) / 1000``."""
        if self._cuda_ref is None:
            import torch
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            ev.synchronize()
            self._cuda_ref = (ev, time.monotonic())
        return self._cuda_ref

    def gpu_interval(self, batch_id: int, start, end) -> None:
        """Record a batch's device interval from its two (completed) CUDA events."""
        if not self.enabled:
            return
        ref, t_ref = self.cuda_clock()
        self.mark("gpu_start", batch_id, t_ref + ref.elapsed_time(start) / 1000.0)
        self.mark("gpu_end", batch_id, t_ref + ref.elapsed_time(end) / 1000.0)

    def dump(self) -> None:
        if not self.enabled or not self.events:
            return
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"{self.name}.json"), "w") as f:
            json.dump(self.events, f)
