#!/usr/bin/env python
"""Stage-restart benchmark: how long a pipeline is gone when one of its stage workers dies.

Starts `zpp serve` (arguments after ``--``), keeps ``--streams`` streaming completions running in
closed loops, signals stage ``--stage`` after ``--kill-after`` seconds (``--kills`` times, the
stages in turn from ``--stage`` when it is ``all``; ``--signals`` in turn: SIGKILL, or SIGSTOP,
which the engine's heartbeat watchdog finds after ``--worker-heartbeat-timeout`` and kills), and
reports for each kill:

* ``recovery_s``: what the server logs as "pipeline formed again in X s" (loss noticed to every
  stage formed again: the new process started, its weights loaded, survivors rejoined);
* ``pause_s``: the longest gap between two tokens (of any stream) around the kill, the pause the
  clients see (recovery plus the recompute of the requeued requests' prompts and outputs), and
  ``death_to_resume_s``: from the SIGKILL to the token that ends that pause;

plus the output tokens per second before the first kill and after the last, any stream error (there
must be none), how many completed streams' text differs from the undisturbed one (the same greedy
prompt: the most common text of the streams finished before the first kill; on a GPU a batch's
composition may legitimately change a bf16 argmax, so it is reported, not failed on), the process
group backend the workers logged, and the server's exit. Not a test: run it by hand and keep its JSON.

    python scripts/stage_restart_bench.py --output benchmarks/results/stage_restart_cpu_pp2.json -- \\
        -pp 2 --max-model-len 512
    # one H200, every stage on the GPU, Llama-3-8B shape (dummy weights):
    ZPP_SHARE_GPU=1 python scripts/stage_restart_bench.py --streams 64 --max-tokens 256 -- \\
        scripts/configs/llama3-8b --load-format dummy -pp 2 --device cuda
    # two GPUs, stages over NCCL (issue 52), a SIGKILL then a SIGSTOP of each stage:
    python scripts/stage_restart_bench.py --streams 64 --max-tokens 256 --kills 4 --signals KILL,KILL,STOP,STOP \\
        --kill-after 30 --between 30 --output benchmarks/results/stage_restart_nccl_pp2.json -- \\
        DIR --load-format dummy -pp 2 --device cuda --worker-heartbeat-timeout 5
    (DIR: ``scripts/configs/llama3-8b``'s config.json with the demo model's tokenizer files.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, serve_args: list[str]):
        self.port = _free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zpp-restart-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "zpp.cli", "serve", *serve_args, "--host", HOST, "--port", str(self.port)]
        self.cmd = " ".join(cmd[3:])
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
        raise SystemExit("the server did not become healthy in 900 s")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stage_pids(self) -> dict[int, int]:
        out = {}
        for m in re.finditer(r"placement: rank (\d+) = stage (\d+)(?: TP rank (\d+))? on .*? pid (\d+)", self.output()):
            if not m.group(3) or m.group(3) == "0":
                out[int(m.group(2))] = int(m.group(4))
        return out

    def recoveries(self) -> list[float]:
        return [float(x) for x in re.findall(r"pipeline formed again in ([\d.]+)s", self.output())]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)


async def run(args, server: Server) -> dict:
    token_times: list[float] = []
    errors: list[str] = []
    stop = asyncio.Event()
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}

    texts: list[tuple[float, float, str]] = []  # (start, end, text) of each completed stream

    async def loop(session):
        while not stop.is_set():
            try:
                t0, parts, failed = time.monotonic(), [], False
                async with session.post(server.url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}: {(await r.text())[:300]}")
                        continue
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            errors.append(ev["error"]["message"][:300])
                            failed = True
                        elif ev["choices"] and ev["choices"][0].get("text") is not None:
                            token_times.append(time.monotonic())
                            parts.append(ev["choices"][0]["text"])
                if not failed and not stop.is_set():
                    texts.append((t0, time.monotonic(), "".join(parts)))
            except aiohttp.ClientError as e:
                errors.append(repr(e))

    def rate(t0: float, t1: float) -> float:
        return round(sum(1 for t in token_times if t0 <= t < t1) / max(1e-9, t1 - t0), 2)

    signals = [getattr(signal, "SIG" + x.strip().upper().removeprefix("SIG")) for x in args.signals.split(",")]
    kills = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.create_task(loop(session)) for _ in range(args.streams)]
        t_start = time.monotonic()
        await asyncio.sleep(args.kill_after)
        stages = sorted(server.stage_pids())
        for i in range(args.kills):
            stage = stages[i % len(stages)] if args.stage == "all" else int(args.stage)
            sig = signals[i % len(signals)]
            pid = server.stage_pids()[stage]
            before = len(server.recoveries())
            t_kill = time.monotonic()
            os.kill(pid, sig)
            deadline = t_kill + args.timeout
            while len(server.recoveries()) == before and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            recovered = len(server.recoveries()) > before
            while recovered and not any(t > t_kill for t in token_times[-args.streams * 4:]) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(min(5.0, args.between))  # tokens flow again meanwhile
            pause, resume = _pause_after(token_times, t_kill)
            kills.append({"stage": stage, "signal": sig.name, "pid": pid, "recovery_s": server.recoveries()[-1] if recovered else None,
                          "pause_s": pause, "death_to_resume_s": round(resume - t_kill, 3) if resume else None,
                          "new_pid": server.stage_pids().get(stage)})
            print(f"kill {i + 1}: {kills[-1]}", flush=True)
            await asyncio.sleep(args.between)
        t_end = time.monotonic()
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    first_kill = t_start + args.kill_after
    undisturbed = [t for a, b, t in texts if b < first_kill]
    reference = max(set(undisturbed), key=undisturbed.count) if undisturbed else None
    return {"kills": kills, "errors": errors[:20], "num_errors": len(errors),
            "streams_completed": len(texts), "streams_completed_before_first_kill": len(undisturbed),
            "streams_text_differs": sum(t != reference for _, _, t in texts) if reference is not None else None,
            "out_tok_s_before_kills": rate(t_start + 2.0, first_kill),
            "out_tok_s_after_last_recovery": rate(t_end - args.between + 2.0, t_end),
            "streams": args.streams, "max_tokens": args.max_tokens}


def _pause_after(times: list[float], t_kill: float) -> tuple:
    """(longest gap between consecutive tokens of any stream from just before ``t_kill`` on, the
    arrival of the token that ends it): the pause the clients saw and when streaming resumed
    (tokens already computed before the death may still arrive just after it)."""
    ts = sorted(t for t in times if t >= t_kill - 1.0)
    if len(ts) < 2:
        return None, None
    gap, end = max((b - a, b) for a, b in zip(ts, ts[1:]))
    return round(gap, 3), end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Tell me a long story about a pipeline with several stages.")
    ap.add_argument("--stage", default="all", help="the stage to kill, or all (in turn)")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--signals", default="KILL",
                    help="comma-separated signals used in turn (KILL, STOP); a stopped stage is found by the "
                         "heartbeat watchdog (pass --worker-heartbeat-timeout to zpp serve) and killed by the engine")
    ap.add_argument("--kill-after", type=float, default=20.0, help="seconds of traffic before the first kill")
    ap.add_argument("--between", type=float, default=20.0, help="seconds between kills (and after the last)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--output", default=None)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then zpp serve's arguments")
    args = ap.parse_args()
    serve = [a for a in args.serve_args if a != "--"]
    if not serve or serve[0].startswith("-"):
        from zpp.demo import prepare_demo_model
        serve = [prepare_demo_model(), *serve]
    serve += ["--max-stage-restarts", str(args.kills + 1)]
    server = Server(serve)
    try:
        report = asyncio.run(run(args, server))
    finally:
        rc = server.stop()
    log = server.output()
    report.update({"server_command": "zpp " + server.cmd, "bench_command": "python " + " ".join(sys.argv),
                   "server_exit_status": rc, "log": server.log.name,
                   "process_group_backends": sorted(set(re.findall(r"process groups of generation \d+ \((\w+)\)", log)))})
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if not report["num_errors"] and all(k["recovery_s"] is not None for k in report["kills"]) else 1


if __name__ == "__main__":
    sys.exit(main())
