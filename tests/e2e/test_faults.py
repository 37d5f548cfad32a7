"""Fault injection on a PP=2 server (CPU, the real SmolLM2 weights): never a hang, never an orphan.

- Each stage worker SIGKILLed or SIGSTOPped (one round per signal and stage, seeded) while requests
  are in flight at every stage of their life: one mid-stream (after a seeded number of chunks), one
  in chunked prefill (a long prompt sent a seeded moment before), one sent a few milliseconds before
  the signal (before its first token) and one non-streaming n=2 sampled request. Every request
  ends — a completion, or an error in OpenAI's shape naming the stage — within the bound
  (--worker-heartbeat-timeout 3 for SIGSTOP), the server exits non-zero, and after SIGCONT every
  process it had started is gone.
- Clients hanging up at seeded random points (right after sending, mid-stream, a non-streaming
  client giving up, a body cut off mid-upload, headers cut off) with a small KV cache: the KV
  blocks are all freed (zpp:kv_cache_usage_perc back to 0, nothing running or waiting), no
  traceback in the log, the server still serves; then the engine process is SIGKILLed and every
  worker is gone within 5 s.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
import pytest

from helpers import ServerProcess, descendants, parse_metrics, stage_pids, wait_gone

pytestmark = pytest.mark.slow

HEARTBEAT_S = 3
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens: several prefill chunks


def _server(demo_model, *extra) -> ServerProcess:
    # Fail-stop (no stage restarts): tests/e2e/test_stage_restarts.py covers the supervised default.
    return ServerProcess([demo_model, "--pipeline-parallel-size", "2", "--max-model-len", "1024",
                          "--worker-heartbeat-timeout", str(HEARTBEAT_S), "--max-stage-restarts", "0", *extra])


@dataclass
class Req:
    """One request and how it ended: ``completed`` (every choice finished), ``error`` (an error in
    OpenAI's shape: a JSON error response or a streamed error event), ``dropped`` (the connection
    closed without either) or ``hang`` (still open at the deadline)."""
    name: str
    body: dict
    chunks: int = 0
    outcome: Optional[str] = None
    message: str = ""
    ended_at: Optional[float] = None
    got_chunk: asyncio.Event = field(default_factory=asyncio.Event)

    def state(self) -> str:
        return "ended" if self.outcome else (f"{self.chunks} chunks" if self.chunks else "no token yet")


async def _run(session: aiohttp.ClientSession, url: str, r: Req, hang_up: Optional[float] = None) -> None:
    """Send ``r`` and record how it ends."""
    try:
        async with session.post(url + "/v1/completions", json=r.body) as resp:
            if resp.status != 200 or not r.body.get("stream"):
                data = await resp.json()
                if resp.status == 200:
                    ok = all(c["finish_reason"] for c in data["choices"])
                    r.outcome = "completed" if ok else "dropped"
                else:
                    err = data["error"]
                    assert set(err) == {"message", "type", "param", "code"}, data
                    r.outcome, r.message = "error", err["message"]
                return
            finished = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if r.outcome is None:
                        r.outcome = "completed" if finished else "dropped"
                    return
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    r.outcome, r.message = "error", event["error"]["message"]
                    continue
                r.chunks += 1
                r.got_chunk.set()
                finished += sum(c["finish_reason"] is not None for c in event["choices"])
            r.outcome = r.outcome or "dropped"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as e:
        r.outcome, r.message = "dropped", repr(e)
    finally:
        r.ended_at = time.monotonic()
        r.got_chunk.set()


async def _until(pred, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


ROUNDS = [(signal.SIGKILL, 0, 0), (signal.SIGKILL, 1, 1), (signal.SIGSTOP, 0, 2), (signal.SIGSTOP, 1, 3)]


@pytest.mark.parametrize("sig,stage,seed", ROUNDS, ids=[f"{s.name}-stage{st}-seed{sd}" for s, st, sd in ROUNDS])
def test_stage_fault_ends_every_request(demo_model, sig, stage, seed):
    rng = random.Random(seed)
    k_chunks, prefill_wait, last_wait = rng.randint(1, 6), rng.uniform(0.05, 0.6), rng.uniform(0.0, 0.03)
    s = _server(demo_model, "--max-num-batched-tokens", "64")
    pids: dict[int, int] = {}
    kids: list[int] = []
    try:
        kids, pids = descendants(s.proc.pid), stage_pids(s)
        assert sorted(pids) == [0, 1] and set(pids.values()) <= set(kids), s.output()
        reqs = {
            "mid-stream": Req("mid-stream", {"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                                             "temperature": 0, "ignore_eos": True}),
            "sampled-n2": Req("sampled-n2", {"prompt": "List some colours:", "max_tokens": 300, "n": 2,
                                             "seed": seed, "ignore_eos": True}),
            "prefill": Req("prefill", {"prompt": LONG_PROMPT, "max_tokens": 50, "stream": True, "temperature": 0}),
            "first-token": Req("first-token", {"prompt": "Hello there,", "max_tokens": 50, "stream": True}),
        }

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                tasks = [asyncio.create_task(_run(session, s.url, reqs["mid-stream"])),
                         asyncio.create_task(_run(session, s.url, reqs["sampled-n2"]))]
                assert await _until(lambda: reqs["mid-stream"].chunks >= k_chunks, 60), "no tokens streamed"
                tasks.append(asyncio.create_task(_run(session, s.url, reqs["prefill"])))
                await asyncio.sleep(prefill_wait)
                tasks.append(asyncio.create_task(_run(session, s.url, reqs["first-token"])))
                await asyncio.sleep(last_wait)
                os.kill(pids[stage], sig)
                t_sig = time.monotonic()
                states = {n: r.state() for n, r in reqs.items()}
                limit = (HEARTBEAT_S if sig == signal.SIGSTOP else 0) + 7
                done, pending = await asyncio.wait(tasks, timeout=limit + 5)
                for t in pending:
                    t.cancel()
                return t_sig, states, limit

        t_sig, states, limit = asyncio.run(go())
        print(f"seed {seed}: {sig.name} stage {stage} with requests at {states}")
        for r in reqs.values():
            assert r.outcome in ("completed", "error"), (r.name, states[r.name], r.outcome, r.message)
            assert r.ended_at - t_sig < limit, (r.name, r.ended_at - t_sig)
            if r.outcome == "error":
                assert f"stage {stage} " in r.message, (r.name, r.message)
        assert any(r.outcome == "error" for r in reqs.values())
        assert s.proc.wait(30) != 0
    finally:
        for p in pids.values():
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass
        s.stop()
    assert wait_gone(kids, 10) == [], "processes left after the server exited (and SIGCONT)"


async def _scrape(session, url) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


def _raw_hang_up(port: int, cut: str) -> None:
    """A client that goes away mid-upload (``body``) or mid-headers (``headers``)."""
    body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 50}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(head[:40] if cut == "headers" else head + body[:len(body) // 2])


ABORTED = 'zpp:request_success_total{finished_reason="abort"}'


def test_client_hang_ups_free_kv_then_engine_sigkill(demo_model):
    rng = random.Random(7)
    s = _server(demo_model, "--num-kv-blocks", "40", "--max-num-batched-tokens", "128")
    kids: list[int] = []
    try:
        kids = descendants(s.proc.pid)
        assert len(kids) >= 2

        # Where each client hangs up: right after sending (a stream or not), after a few streamed
        # chunks, a non-streaming client giving up after a while; two stay to the end.
        points = ["after-send", "after-send-stream", "mid-stream", "mid-stream", "mid-stream", "gives-up",
                  "gives-up", "stays", "stays-stream"]
        rng.shuffle(points)

        async def client(session, i: int, point: str) -> tuple[str, bool]:
            """One seeded client; returns (its hang-up point, whether it hung up before the end)."""
            body = {"prompt": " ".join(rng.choice(["red", "cat", "sea", "run", "blue", "tree"])
                                       for _ in range(rng.randint(3, 120))),
                    "max_tokens": rng.randint(16, 48), "n": rng.choice([1, 1, 2]), "ignore_eos": True,
                    "temperature": rng.choice([0, 0.8]), "seed": i, "stream": "stream" in point}
            r = Req(f"client-{i}", body)
            if point.startswith("stays"):
                await _run(session, s.url, r)
                assert r.outcome == "completed", (r.outcome, r.message)
                return point, False
            task = asyncio.create_task(_run(session, s.url, r))
            if point == "mid-stream":
                k = rng.randint(1, 4)
                await _until(lambda: r.chunks >= k or r.outcome, 60)
            else:
                await asyncio.sleep(rng.uniform(0.0, 0.05) if point.startswith("after-send") else rng.uniform(0.3, 3.0))
            ended = r.outcome is not None
            task.cancel()  # closes the connection
            await asyncio.gather(task, return_exceptions=True)
            return point, not ended

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                before = await _scrape(session, s.url)
                clients = [asyncio.create_task(client(session, i, p)) for i, p in enumerate(points)]
                await asyncio.sleep(0.3)
                for cut in ("body", "headers"):
                    await asyncio.get_running_loop().run_in_executor(None, _raw_hang_up, s.port, cut)
                busy = await _scrape(session, s.url)
                results = await asyncio.gather(*clients)
                idle = await _idle(session)
                check = Req("after", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
                await _run(session, s.url, check)
                return before, busy, results, idle, check

        async def _idle(session):
            deadline = time.monotonic() + 30
            while True:
                m = await _scrape(session, s.url)
                if (m["zpp:num_requests_running"], m["zpp:num_requests_waiting"], m["zpp:kv_cache_usage_perc"]) \
                        == (0, 0, 0) or time.monotonic() > deadline:
                    return m
                await asyncio.sleep(0.1)

        before, busy, results, idle, check = asyncio.run(go())
        print("hang-up points:", results)
        hung_up = sum(early for _, early in results)
        assert hung_up >= 5, results  # hung up before their request ended
        assert busy["zpp:kv_cache_usage_perc"] > 0 or busy["zpp:num_requests_waiting"] > 0
        assert idle["zpp:kv_cache_usage_perc"] == 0, idle
        assert idle["zpp:num_requests_running"] == 0 and idle["zpp:num_requests_waiting"] == 0, idle
        assert 1 <= idle.get(ABORTED, 0) - before.get(ABORTED, 0) <= hung_up
        assert check.outcome == "completed", (check.outcome, check.message)
        assert "Traceback" not in s.output(), s.output()[-3000:]

        kids = descendants(s.proc.pid)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        t0 = time.monotonic()
        assert wait_gone(kids, 5) == [], "workers outlived their SIGKILLed engine by more than 5 s"
        print(f"engine SIGKILL: {len(kids)} descendants gone in {time.monotonic() - t0:.2f} s")
    finally:
        for p in descendants(s.proc.pid) if s.proc.poll() is None else []:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        s.stop()
