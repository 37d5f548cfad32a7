"""A CPU stage's intra-op thread count, lowered while other processes contend for its cores.

A stage starts with its share of the host's cores (``zpp.utils.cpu_threads``). When another busy
process shares those cores, a stage of several OpenMP threads loses far more than its share: every
parallel region ends at a barrier, and a thread that has been preempted makes the others wait (or
spin) until the scheduler gives it a core back. Measured on the 2-core VM (issue #28): 168-175
output tok/s quiet, 24-28 with one ``while True: pass`` beside it, 88 with one thread.

:class:`ThreadGovernor` watches the stage's own steps: over a window of steps it compares the main
thread's CPU time (``time.thread_time``) with the wall time. Quiet, a computing thread is on a core
almost all the time (ratio near 1); oversubscribed, it waits on the run queue (T threads and L
other busy threads on T cores: about T / (T + L)). Below :attr:`low` the stage drops to about
``threads x ratio`` threads (the cores it really gets), and after a while it tries its full count
again (a probe); a probe that finds the contention still there doubles the wait before the next.
The decision is this stage's own and changes only how fast it computes, never what it computes.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)


class ThreadGovernor:
    """Adapts one CPU stage's ``torch.set_num_threads`` to the contention its steps see.

    Call :meth:`begin` before a step's compute and :meth:`end` after it (the time blocked on
    another stage or on the engine stays outside).

    Args:
        max_threads: the stage's share of the cores; never more than this.
        set_threads: applies a thread count (``torch.set_num_threads``).
        window_s: wall seconds of steps measured before each decision (and at least ``min_steps``).
        low: CPU / wall ratio of the main thread under which the stage counts as contended.
        probe_s: seconds at fewer threads before trying ``max_threads`` again; doubled (up to
            ``max_probe_s``) each time a probe finds the contention still there, reset by one that
            does not.
        wall, cpu: clocks in seconds (``time.perf_counter``, ``time.thread_time``); tests pass fakes.
    """

    def __init__(self, max_threads: int, set_threads: Callable[[int], None], window_s: float = 0.5,
                 min_steps: int = 1, low: float = 0.8, probe_s: float = 2.0, max_probe_s: float = 32.0,
                 wall: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time):
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._set, self._wall, self._cpu = set_threads, wall, cpu
        self.window_s, self.min_steps, self.low = window_s, min_steps, low
        self.probe_s = self._base_probe_s = probe_s
        self.max_probe_s = max_probe_s
        self._sum_wall = self._sum_cpu = 0.0
        self._steps = 0
        self._t0 = self._c0 = 0.0
        self._lowered_at = 0.0  # wall time of the last drop below max_threads
        self._probing = False
        self.changes = 0
        """How many times the thread count changed (for tests and logs)."""

    @property
    def active(self) -> bool:
        """False with one thread to begin with: nothing to adapt."""
        return self.max_threads > 1

    def begin(self) -> None:
        if self.active:
            self._t0, self._c0 = self._wall(), self._cpu()

    def end(self) -> None:
        if not self.active:
            return
        now = self._wall()
        self._sum_wall += now - self._t0
        self._sum_cpu += self._cpu() - self._c0
        self._steps += 1
        if self._sum_wall >= self.window_s and self._steps >= self.min_steps:
            self._decide(self._sum_cpu / self._sum_wall, now)
            self._sum_wall = self._sum_cpu = 0.0
            self._steps = 0
        if self.threads < self.max_threads and now - self._lowered_at >= self.probe_s:
            self._probe()

    def _decide(self, ratio: float, now: float) -> None:
        logger.debug("CPU threads %d: the main thread got %.0f%% of a core over %d steps (%.2fs)", self.threads,
                     ratio * 100, self._steps, self._sum_wall)
        if ratio < self.low:
            target = max(1, min(self.threads - 1, round(self.threads * ratio)))
            if self._probing:  # the contention is still there: wait longer before the next probe
                self.probe_s = min(self.max_probe_s, self.probe_s * 2)
            if target < self.threads:
                self._apply(target, f"the main thread got {ratio:.0%} of a core over its steps",
                            logging.DEBUG if self._probing else logging.INFO)
                self._lowered_at = now
        elif self._probing:
            self.probe_s = self._base_probe_s
            logger.info("CPU threads back to %d (the main thread got %.0f%% of a core over its steps)",
                        self.threads, ratio * 100)
        self._probing = False

    def _probe(self) -> None:
        """Back to every thread for one window: does the contention last?"""
        self._probing = True
        self._sum_wall = self._sum_cpu = 0.0
        self._steps = 0
        self._apply(self.max_threads, "trying again", logging.DEBUG)

    def _apply(self, threads: int, why: str, level: int) -> None:
        logger.log(level, "CPU threads %d -> %d (%s)", self.threads, threads, why)
        self.threads = threads
        self.changes += 1
        self._set(threads)
