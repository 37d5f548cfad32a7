"""Prometheus metrics (prometheus-client) for ``GET /metrics``.

Names follow vLLM's (``zpp:`` prefix): running / waiting requests, KV-cache usage, prompt and
generation token counters, TTFT / TPOT / end-to-end latency histograms (seconds), per-stage busy
time (seconds).
"""
from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LAT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)


class Metrics:
    """Engine observer: the engine calls ``on_*`` hooks; gauges are read at scrape time."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = r = CollectorRegistry()
        self.running = Gauge("zpp:num_requests_running", "Requests in the running queue", registry=r)
        self.waiting = Gauge("zpp:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("zpp:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", registry=r)
        self.free_blocks = Gauge("zpp:num_free_kv_blocks", "Free KV-cache blocks", registry=r)
        self.preemptions = Gauge("zpp:num_preemptions_total", "Preemptions so far", registry=r)
        self.prefix_hits = Gauge("zpp:prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache",
                                 registry=r)
        self.stage_busy = Gauge("zpp:stage_busy_seconds_total", "Seconds each pipeline stage spent computing",
                                ["stage"], registry=r)
        self.prompt_tokens = Counter("zpp:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("zpp:generation_tokens", "Tokens generated", registry=r)
        self.requests_finished = Counter("zpp:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.ttft = Histogram("zpp:time_to_first_token_seconds", "Time to first token", buckets=_LAT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("zpp:time_per_output_token_seconds", "Time between output tokens (ITL)",
                              buckets=_LAT_BUCKETS, registry=r)
        self.e2e = Histogram("zpp:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LAT_BUCKETS + (160.0, 320.0), registry=r)
        self._last_token: dict[str, float] = {}

    # --- engine hooks (called on the engine loop) ---------------------------------------------
    def on_request_added(self, group) -> None:
        self.prompt_tokens.inc(len(group.prompt_token_ids) * len(group.seqs))

    def on_first_token(self, group, t: float) -> None:
        self.ttft.observe(t - group.arrival)
        self.generation_tokens.inc()
        self._last_token[group.request_id] = t

    def on_token(self, group, t: float) -> None:
        last = self._last_token.get(group.request_id)
        if last is not None:
            self.tpot.observe(t - last)
        self._last_token[group.request_id] = t
        self.generation_tokens.inc()

    def on_request_finished(self, group, aborted: bool) -> None:
        self._last_token.pop(group.request_id, None)
        reason = "abort" if aborted else (group.seqs[0].out.finish_reason or "abort")
        self.requests_finished.labels(finished_reason=reason).inc()
        if not aborted:
            self.e2e.observe(time.monotonic() - group.arrival)

    # --- scrape -------------------------------------------------------------------------------
    def refresh(self) -> None:
        e = self.engine
        self.running.set(e.scheduler.num_running)
        self.waiting.set(e.scheduler.num_waiting)
        self.kv_usage.set(e.kv.usage)
        self.free_blocks.set(e.kv.num_free_blocks)
        self.preemptions.set(e.scheduler.stats.num_preemptions)
        self.prefix_hits.set(e.kv.prefix_hits)
        for i, b in enumerate(e.executor.stage_busy_s):
            self.stage_busy.labels(stage=str(i)).set(b)

    async def handler(self, request: web.Request) -> web.Response:
        self.refresh()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
