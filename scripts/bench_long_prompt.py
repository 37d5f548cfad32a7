"""A long prompt must not stall running streams (issue 12, item 7): a benchmark, not a timed test.

Starts ``zpp serve`` on 127.0.0.1 (default flags unless ``--server-args`` adds some), starts
``--streams`` streaming requests and waits until each has produced a few tokens, then sends one
``--long-len``-token prompt and, ``--short-delay`` seconds later, a short request. Reported per
run: the largest inter-token gap of each running stream while the long prompt is prefilled (from
when it is sent to its first token), the short request's TTFT and the long prompt's TTFT. With
``--repeat N`` the same server runs the scenario N times and the medians are reported. Load
averages are recorded with each run (the machine is shared: compare runs at similar load).

Acceptance (CPU, PP=2, default flags): no gap above 1 s, short TTFT within 2 s.

Usage::

    python scripts/bench_long_prompt.py [--pp 2] [--repeat 3] \
        [--output-json benchmarks/results/cpu_long_prompt_pp2.json] [--server-args "--max-num-batched-tokens 512"]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stream:
    """One streaming /v1/completions request; token arrival times (perf_counter)."""

    def __init__(self, name: str, prompt: list[int], max_tokens: int):
        self.name, self.prompt, self.max_tokens = name, prompt, max_tokens
        self.sent = 0.0
        self.times: list[float] = []
        self.error = ""
        self.task: asyncio.Task | None = None

    async def run(self, session, url: str) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        self.sent = time.perf_counter()
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    self.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    return
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    msg = json.loads(data)
                    if "error" in msg:
                        self.error = str(msg["error"])[:200]
                        return
                    if msg.get("choices") and msg["choices"][0].get("text") is not None:
                        self.times.append(time.perf_counter())
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - reported
            self.error = repr(e)

    def ttft(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def max_gap(self, t0: float, t1: float) -> float:
        """Largest time between consecutive tokens over [t0, t1] (a gap still open at t1, or one
        that started before t0 and ends inside, counts up to the window's edges)."""
        marks = [t0] + [t for t in self.times if t0 < t < t1] + [t1]
        before = [t for t in self.times if t <= t0]
        if before:
            marks[0] = before[-1]
        return max(b - a for a, b in zip(marks, marks[1:]))

    def gap_times(self, t0: float) -> list[float]:
        """Token arrival times relative to ``t0`` (seconds)."""
        return [round(t - t0, 3) for t in self.times]


async def scenario(base: str, args, rng: random.Random, vocab: int) -> dict:
    import aiohttp
    url = f"{base}/v1/completions"
    toks = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]
    load_start = os.getloadavg()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        streams = [Stream(f"stream{i}", toks(args.stream_prompt_len), args.stream_max_tokens)
                   for i in range(args.streams)]
        for s in streams:
            s.task = asyncio.create_task(s.run(session, url))
        deadline = time.perf_counter() + args.warmup_timeout
        while any(len(s.times) < 3 and not s.error for s in streams):
            if time.perf_counter() > deadline:
                raise RuntimeError("the streams did not start in time")
            await asyncio.sleep(0.01)
        errs = [s.error for s in streams if s.error]
        if errs:
            raise RuntimeError(f"a stream failed: {errs[0]}")
        long = Stream("long", toks(args.long_len), args.long_max_tokens)
        short = Stream("short", toks(args.short_len), args.short_max_tokens)
        long.task = asyncio.create_task(long.run(session, url))
        await asyncio.sleep(args.short_delay)
        short.task = asyncio.create_task(short.run(session, url))
        await asyncio.gather(long.task, short.task)
        t_end = time.perf_counter()
        alive = [s for s in streams if not s.task.done()]
        for s in streams:
            s.task.cancel()
        await asyncio.gather(*(s.task for s in streams), return_exceptions=True)
    for r in (long, short):
        if r.error or not r.times:
            raise RuntimeError(f"the {r.name} request failed: {r.error or 'no tokens'}")
    t0, t1 = long.sent, long.times[0]
    gaps = [s.max_gap(t0, t1) for s in streams]
    return {
        "streams_alive_at_end": len(alive),
        "max_gap_s_per_stream": [round(g, 3) for g in gaps],
        "max_gap_s": round(max(gaps), 3),
        "short_ttft_s": round(short.ttft(), 3),
        "long_ttft_s": round(long.ttft(), 3),
        "long_prefill_window_s": round(t1 - t0, 3),
        "stream_tokens_during_prefill": [sum(1 for t in s.times if t0 < t <= t1) for s in streams],
        "max_gap_s_whole_run": round(max(s.max_gap(t0, t_end) for s in streams), 3),
        "short_sent_s": round(short.sent - t0, 3),
        "stream_token_times_s": [s.gap_times(t0) for s in streams] if args.save_times else None,
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


async def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    import aiohttp
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with session.get(f"{base}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("the server did not become ready in time")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo SmolLM2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages")
    p.add_argument("--server-args", default="", help="extra `zpp serve` flags (quoted)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--stream-max-tokens", type=int, default=2000,
                   help="long enough to outlast the prefill; the streams are cancelled at the end")
    p.add_argument("--long-len", type=int, default=6000)
    p.add_argument("--long-max-tokens", type=int, default=4)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--short-max-tokens", type=int, default=4)
    p.add_argument("--short-delay", type=float, default=1.0, help="seconds between the long and the short request")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-timeout", type=float, default=120.0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-times", action="store_true", help="keep every stream's token times in the report")
    args = p.parse_args()

    model = args.model
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "zpp.cli", "serve", "--model", model, "-pp", str(args.pp),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
    print("server:", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    runs = []
    try:
        asyncio.run(wait_ready(base, proc, 300))
        rng = random.Random(args.seed)
        for i in range(args.repeat):
            r = asyncio.run(scenario(base, args, rng, vocab))
            runs.append(r)
            print(f"run {i + 1}: max gap {r['max_gap_s']:.2f} s (per stream {r['max_gap_s_per_stream']}), "
                  f"short TTFT {r['short_ttft_s']:.2f} s, long TTFT {r['long_ttft_s']:.2f} s, "
                  f"load {r['loadavg_start'][0]:.2f}", flush=True)
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    med = lambda k: statistics.median(r[k] for r in runs)
    summary = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "server_command": " ".join(cmd[1:]).replace(model, "<demo model>"),
        "scenario": {k: getattr(args, k) for k in ("pp", "streams", "stream_prompt_len", "long_len",
                                                     "short_len", "short_delay", "long_max_tokens",
                                                     "short_max_tokens")},
        "median": {"max_gap_s": med("max_gap_s"), "short_ttft_s": med("short_ttft_s"),
                   "long_ttft_s": med("long_ttft_s")},
        "acceptance": {"max_gap_below_1s": med("max_gap_s") <= 1.0, "short_ttft_below_2s": med("short_ttft_s") <= 2.0},
        "cpu_count": os.cpu_count(),
        "runs": runs,
    }
    print(json.dumps({k: summary[k] for k in ("median", "acceptance")}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
