"""Prometheus metrics (prometheus-client) for ``GET /metrics``, the per-request log lines and the
periodic stats log line.

Names follow vLLM's with a ``zpp:`` prefix, and every series carries a ``model_name`` label (the
served model name), as vLLM's do, so that vLLM dashboards port by renaming the prefix. Read from
the engine (``engine.stats()``) at scrape time: running and waiting sequences, KV-cache usage
(fraction 0-1) and free blocks, preemptions, prefix-cache queries and hits (prompt tokens),
per-stage busy and idle (pipeline bubble) seconds. Counted as the engine runs: prompt and generation tokens, finished requests
by reason; histograms (seconds) of time to first token, time per output token (per request:
decode time / (tokens - 1)), inter-token latency (per step) and end-to-end latency.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

request_logger = logging.getLogger("zpp.requests")
stats_logger = logging.getLogger("zpp.stats")

_LAT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0

_RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class _EngineCollector:
    """Gauges and counters the engine core keeps (``engine.stats()``), read when /metrics is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def _one(self, family, name: str, doc: str, value: float):
        m = family(name, doc, labels=["model_name"])
        m.add_metric([self.model_name], value)
        return m

    def collect(self):
        s = self.engine.stats()
        yield self._one(GaugeMetricFamily, "zpp:num_requests_running",
                        "Sequences in the running queue (a request with n completions counts n)", s.num_running)
        yield self._one(GaugeMetricFamily, "zpp:num_requests_waiting", "Sequences waiting to be scheduled",
                        s.num_waiting)
        yield self._one(GaugeMetricFamily, "zpp:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)",
                        s.kv_cache_usage)
        yield self._one(GaugeMetricFamily, "zpp:num_free_kv_blocks", "Free KV-cache blocks", s.num_free_kv_blocks)
        yield self._one(CounterMetricFamily, "zpp:num_preemptions", "Sequences preempted (recomputed later) so far",
                        s.num_preemptions)
        yield self._one(CounterMetricFamily, "zpp:prefix_cache_queries",
                        "Prompt tokens looked up in the prefix cache (0 without --enable-prefix-caching)",
                        s.prefix_cache_queries)
        yield self._one(CounterMetricFamily, "zpp:prefix_cache_hits",
                        "Prompt tokens served from the prefix cache", s.prefix_cache_hits)
        busy = CounterMetricFamily("zpp:stage_busy_seconds", "Seconds each pipeline stage spent computing",
                                   labels=["model_name", "stage"])
        for i, b in enumerate(s.stage_busy_s):
            busy.add_metric([self.model_name, str(i)], b)
        yield busy
        idle = CounterMetricFamily("zpp:stage_idle_seconds",
                                   "Seconds each pipeline stage's device sat idle between micro-batches while "
                                   "the engine had work (the pipeline bubble: waiting for the batch message, "
                                   "the previous stage's activations or the worker's host work)",
                                   labels=["model_name", "stage"])
        for i, b in enumerate(s.stage_idle_s):
            idle.add_metric([self.model_name, str(i)], b)
        yield idle
        restarts = CounterMetricFamily("zpp:stage_restarts", "Restarts of each pipeline stage (its worker died, "
                                       "went silent or stalled and was started again in place)",
                                       labels=["model_name", "stage"])
        for i, n in enumerate(s.stage_restarts):
            restarts.add_metric([self.model_name, str(i)], n)
        yield restarts
        yield from self._spec_decode(s)
        yield self._recovery_histogram(s.recovery_seconds)
        wb = GaugeMetricFamily("zpp:stage_weight_bytes", "Bytes of each pipeline stage's weights by dtype (fp8, "
                               "bf16, ...; summed over the stage's tensor-parallel ranks)",
                               labels=["model_name", "stage", "dtype"])
        for i, per in enumerate(s.stage_weight_bytes):
            for dt, b in per.items():
                wb.add_metric([self.model_name, str(i), dt], b)
        yield wb
        yield self._one(GaugeMetricFamily, "zpp:kv_cache_capacity_tokens",
                        "Tokens the KV cache holds (every pipeline stage holds the same blocks)", s.kv_cache_tokens)
        yield self._one(GaugeMetricFamily, "zpp:stage_recovering",
                        "1 while a lost stage is being restarted (requests wait), else 0", int(s.recovering))

    def _spec_decode(self, s):
        """Speculative decoding's counters (vLLM's ``spec_decode_*``), when it is on."""
        if not s.spec_accepted_per_pos:
            return
        yield self._one(CounterMetricFamily, "zpp:spec_decode_num_drafts", "Verify chunks sent with draft tokens",
                        s.spec_num_drafts)
        yield self._one(CounterMetricFamily, "zpp:spec_decode_num_draft_tokens", "Draft tokens proposed",
                        s.spec_num_draft_tokens)
        yield self._one(CounterMetricFamily, "zpp:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                        s.spec_num_accepted_tokens)
        per = CounterMetricFamily("zpp:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each "
                                  "position of their chunk (0-based)", labels=["model_name", "position"])
        for i, n in enumerate(s.spec_accepted_per_pos):
            per.add_metric([self.model_name, str(i)], n)
        yield per

    def _recovery_histogram(self, samples: list[float]):
        """``zpp:stage_recovery_seconds``: death to pipeline formed again, one sample per recovery
        (the core keeps them all: restarts are rare)."""
        h = HistogramMetricFamily("zpp:stage_recovery_seconds", "Seconds from a stage's loss to the pipeline "
                                  "formed again with the restarted stage", labels=["model_name"])
        buckets = [(str(b), sum(1 for x in samples if x <= b)) for b in _RECOVERY_BUCKETS]
        h.add_metric([self.model_name], buckets + [("+Inf", len(samples))], sum(samples))
        return h


class Metrics:
    """Engine observer: the engine calls the ``on_*`` hooks (on its event loop); ``handler``
    serves the text exposition format.

    Args:
        engine: the engine (``engine.stats()`` is read at scrape time).
        model_name: the served model name, the ``model_name`` label of every series.
        log_requests: log one INFO line per finished request (``zpp.requests``; off with
            ``--disable-log-requests``).
    """

    def __init__(self, engine, model_name: str = "", log_requests: bool = False):
        self.engine = engine
        self.model_name = model_name
        self.log_requests = log_requests
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine, model_name))
        label = {"model_name": model_name}

        def counter(name: str, doc: str):
            return Counter(name, doc, ["model_name"], registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**label)

        self.prompt_tokens = counter("zpp:prompt_tokens", "Prompt tokens admitted (prompt length x n)")
        self.generation_tokens = counter("zpp:generation_tokens", "Tokens generated")
        self._finished = Counter("zpp:request_success", "Finished requests", ["model_name", "finished_reason"],
                                 registry=r)
        self.ttft = histogram("zpp:time_to_first_token_seconds", "Time from arrival to the first token",
                              _LAT_BUCKETS)
        self.tpot = histogram("zpp:time_per_output_token_seconds",
                              "Per request: (last token time - first token time) / (tokens - 1)", _LAT_BUCKETS)
        self.itl = histogram("zpp:inter_token_latency_seconds", "Time between consecutive steps of a request",
                             _LAT_BUCKETS)
        self.e2e = histogram("zpp:e2e_request_latency_seconds", "Time from arrival to the last token",
                             _LAT_BUCKETS + (160.0, 320.0))
        self.req_prompt = histogram("zpp:request_prompt_tokens", "Prompt length of finished requests",
                                    _TOKEN_BUCKETS)
        self.req_gen = histogram("zpp:request_generation_tokens",
                                 "Tokens generated by finished requests (all n sequences)", _TOKEN_BUCKETS)
        self._last_token: dict[str, float] = {}
        self._multi: Optional[CollectorRegistry] = None

    # --- engine hooks (called on the engine loop; times are time.monotonic()) ------------------
    def on_request_added(self, group) -> None:
        n = len(group.prompt_token_ids) * len(group.seqs)
        self.prompt_tokens.inc(n)

    def on_first_token(self, group, t: float) -> None:
        self.ttft.observe(t - group.arrival)
        self.generation_tokens.inc()
        self._last_token[group.request_id] = t

    def on_token(self, group, t: float) -> None:
        self.generation_tokens.inc()
        last = self._last_token.get(group.request_id)
        if last is not None and t > last:  # n > 1: sequences of one step share one interval
            self.itl.observe(t - last)
        self._last_token[group.request_id] = t

    def on_request_finished(self, group, aborted: bool) -> None:
        self._last_token.pop(group.request_id, None)
        reason = "abort" if aborted else (group.seqs[0].out.finish_reason or "abort")
        self._finished.labels(model_name=self.model_name, finished_reason=reason).inc()
        if self.log_requests:
            self._log_request(group, aborted)
        if aborted:
            return
        self.e2e.observe(time.monotonic() - group.arrival)
        ntok = max((len(s.out.token_ids) for s in group.seqs), default=0)
        if ntok > 1 and group.first_token_time is not None and group.last_token_time is not None:
            self.tpot.observe((group.last_token_time - group.first_token_time) / (ntok - 1))
        self.req_prompt.observe(len(group.prompt_token_ids))
        self.req_gen.observe(sum(len(s.out.token_ids) for s in group.seqs))

    def _log_request(self, group, aborted: bool) -> None:
        """One line per finished request, e.g. ``Finished request cmpl-...-0: prompt_tokens=5,
        output_tokens=7, finish_reason=length, ttft=0.120s, elapsed=0.420s`` (with n > 1 the
        output tokens of all sequences and each sequence's finish reason)."""
        now = time.monotonic()
        reasons = [s.out.finish_reason or "abort" for s in group.seqs]  # the engine marks aborted ones
        ttft = "-" if group.first_token_time is None else f"{group.first_token_time - group.arrival:.3f}s"
        request_logger.info("Finished request %s: prompt_tokens=%d, output_tokens=%d, finish_reason=%s, "
                            "ttft=%s, elapsed=%.3fs", group.request_id, len(group.prompt_token_ids),
                            sum(len(s.out.token_ids) for s in group.seqs), ",".join(reasons), ttft,
                            now - group.arrival)

    # --- scrape -------------------------------------------------------------------------------
    async def handler(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._exposed()), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _exposed(self) -> CollectorRegistry:
        """This process's registry; with several API server processes (``PROMETHEUS_MULTIPROC_DIR``
        set by ``zpp serve --api-server-count``), the counters and histograms of all of them summed
        by prometheus-client's multiprocess collector, plus the core's gauges."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return self.registry
        if self._multi is None:
            from prometheus_client import multiprocess
            self._multi = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._multi)
            self._multi.register(_EngineCollector(self.engine, self.model_name))
        return self._multi


class StatsLogger:
    """The periodic stats line (``zpp.stats``, INFO), like vLLM's: every ``interval_s`` seconds
    while the engine is busy (anything running or waiting, or tokens counted in the interval; so
    one last line after the load ends, then silence)::

        Avg prompt throughput: 52.1 tokens/s, Avg generation throughput: 80.3 tokens/s,
        Running: 3 seqs, Waiting: 0 seqs, KV cache usage: 4.2%, Stage busy: 0: 61%, 1: 74%,
        Prefix cache hit rate: 37.5%

    With speculative decoding, ``Mean acceptance length`` (tokens per verify chunk: 1 + accepted
    drafts) and ``Draft acceptance rate`` over the interval follow, when drafts were sent in it.

    Rates and busy fractions are over the interval (busy at most 100%: a stage's busy time arrives
    with its results, so a long micro-batch counts in the interval it ends in); the prefix-cache hit rate (hit tokens /
    looked-up tokens in the interval, ``n/a`` without lookups) only with prefix caching on.
    """

    def __init__(self, engine, metrics: Metrics, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S,
                 prefix_caching: bool = False):
        self.engine = engine
        self.metrics = metrics
        self.interval_s = interval_s
        self.prefix_caching = prefix_caching
        self._last = self._snapshot()

    def _snapshot(self):
        s = self.engine.stats()  # the core's totals: every front end's requests
        return time.monotonic(), s, s.num_prompt_tokens, s.num_generation_tokens

    def log_once(self) -> Optional[str]:
        """Log the line for the interval since the last call; return it (None when idle)."""
        (t0, s0, p0, g0), (t1, s1, p1, g1) = self._last, self._snapshot()
        self._last = (t1, s1, p1, g1)
        dt = max(t1 - t0, 1e-9)
        if not (s1.num_running or s1.num_waiting or p1 > p0 or g1 > g0):
            return None
        # A stage reports its busy time with each result, so a long micro-batch lands whole in the
        # interval it ends in: clamp to 100% (the counters in /metrics stay exact).
        # Before the stages' first report the totals are empty: count from 0 (the first line said
        # "Stage busy: -"); no report at all yet: the field is left out.
        b0s = list(s0.stage_busy_s) + [0.0] * (len(s1.stage_busy_s) - len(s0.stage_busy_s))
        busy = ", ".join(f"{i}: {min(100.0, 100.0 * max(b1 - b0, 0.0) / dt):.0f}%"
                         for i, (b0, b1) in enumerate(zip(b0s, s1.stage_busy_s)))
        line = (f"Avg prompt throughput: {(p1 - p0) / dt:.1f} tokens/s, "
                f"Avg generation throughput: {(g1 - g0) / dt:.1f} tokens/s, "
                f"Running: {s1.num_running} seqs, Waiting: {s1.num_waiting} seqs, "
                f"KV cache usage: {100.0 * s1.kv_cache_usage:.1f}%" + (f", Stage busy: {busy}" if busy else ""))
        drafts = s1.spec_num_drafts - s0.spec_num_drafts
        if drafts > 0:  # speculative decoding: vLLM's figures over the interval
            acc = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
            proposed = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
            line += (f", Mean acceptance length: {1 + acc / drafts:.2f}, "
                     f"Draft acceptance rate: {100.0 * acc / max(proposed, 1):.1f}%")
        if self.prefix_caching:
            q, h = s1.prefix_cache_queries - s0.prefix_cache_queries, s1.prefix_cache_hits - s0.prefix_cache_hits
            line += f", Prefix cache hit rate: {100.0 * h / q:.1f}%" if q > 0 else ", Prefix cache hit rate: n/a"
        stats_logger.info("%s", line)
        return line

    async def run(self) -> None:
        """Log every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.log_once()
            except Exception:  # never let a stats bug take the server down
                stats_logger.exception("stats logging failed")
