"""A per-micro-batch timeline of the engine and every worker, for performance work.

Off unless ``ZPP_TRACE=DIR`` is set (then every process of the run, workers included, writes
``DIR/<name>.json`` when it stops: ``engine.json`` and ``rank<R>-stage<S>.json``). Each file is a
JSON list of events ``[what, batch_id, t]`` or ``[what, batch_id, t, args]`` with ``t`` in seconds
of ``time.monotonic()`` and ``args`` a small dict (the engine's ``send`` carries the micro-batch's
``tokens`` and ``seqs``). The first event of every file is ``["clock", -1, t, {"wall", "host",
"pid"}]``: the same instant on ``time.time()``, the host name and the process id.

Clocks: ``time.monotonic()`` is CLOCK_MONOTONIC on Linux, one clock for every process of a host,
so the files of a one-host run line up exactly. Processes on different hosts do not share it;
``scripts/trace_report.py --perfetto`` then maps each file onto its host's wall clock through the
``clock`` event (as good as the hosts' NTP sync, typically well under a millisecond).
A worker's GPU intervals are mapped onto the host clock through one CUDA event recorded right after
a device synchronize.

Events (all per micro-batch ``batch_id``):
  engine: ``schedule`` (the scheduler starts choosing it), ``send`` (chosen; encoding starts),
    ``sent`` (on every worker's socket), ``result`` (its StepResult read), ``apply_start`` /
    ``applied`` (the scheduler updated with it, outputs emitted), ``draft`` (speculative decoding: at
    the schedule's start, args ``s``: seconds the n-gram proposals took, ``chunks``, ``tokens``).
  stage: ``msg`` (the worker read the ExecuteBatch), ``acts_wait`` / ``acts_ready`` (blocked on
    the previous stage's activations), ``gpu_start`` / ``gpu_end`` (the stage's forward on the
    device: CUDA events on GPU, ``perf_counter`` on CPU), ``uploaded`` (its index arrays queued
    for the device), ``forward_queued`` (the host returned from launching the forward),
    ``sample_queued`` (last stage: logits and sampling launched), ``verify`` / ``verified``
    (last stage, speculative decoding: the drafts' verification, ``drafts`` / ``accepted`` counts), ``launched`` (the worker's host
    is done with it), ``result_sent`` (last stage: StepResult sent). On CUDA the worker's file ends
    with ``["cuda_allocator", -1, t, {...}]``: counters of PyTorch's caching allocator
    (``torch.cuda.memory_stats``: device allocations and frees, allocation retries), which
    synchronize the device when they happen.

``python scripts/trace_report.py DIR`` turns the files into per-stage busy / idle figures,
``--perfetto OUT.json`` into a timeline for ui.perfetto.dev.
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from zpp import envs


class Trace:
    """Collects events in memory; ``dump()`` writes them (a no-op when tracing is off)."""

    def __init__(self, name: str):
        self.name = name
        self.events: list[tuple] = []
        self.dir = envs.ZPP_TRACE
        self.enabled = self.dir is not None
        self._cuda_ref = None
        if self.enabled:
            self.events.append(("clock", -1, time.monotonic(),
                                {"wall": time.time(), "host": socket.gethostname(), "pid": os.getpid()}))

    def mark(self, what: str, batch_id: int, t: Optional[float] = None, args: Optional[dict] = None) -> None:
        """Record event ``what`` of micro-batch ``batch_id`` at ``t`` (seconds of
        ``time.monotonic()``; now when None), with optional ``args`` (JSON-able dict)."""
        if self.enabled:
            t = time.monotonic() if t is None else t
            self.events.append((what, batch_id, t) if args is None else (what, batch_id, t, args))

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
