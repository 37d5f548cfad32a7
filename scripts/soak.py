#!/usr/bin/env python
"""Soak benchmark: N minutes of mixed traffic against a `zpp serve` this script starts itself on
127.0.0.1 (and stops at the end). Not a test: run it by hand and keep its report.

Traffic (each of --concurrency client loops picks a kind at random, seeded, until the time is up
or it has sent --max-requests-per-loop requests):

  greedy / greedy-stream / chat-greedy / stop / logprobs / long-prompt   answers checked against a
      reference computed at start, one request at a time (text and finish_reason; streams are
      joined first; logprobs: one entry per generated token)
  seeded / seeded-n2   temperature sampling with a seed: also checked against the reference
  stream-hang-up       a stream the client closes after a few chunks
  bad-body             a malformed or hostile body: must get a 4xx in OpenAI's error shape

A small KV cache (--num-kv-blocks) and a small prefill budget keep the scheduler preempting.
The report (stdout and --output JSON): requests done per kind, errors by kind (wrong answer, 5xx,
unexpected 4xx, a bad body not refused, streamed error events, connection errors, hangs = no answer
within --request-timeout), p50/p99 latency per kind, preemptions, engine and worker RSS after
start-up, after the reference phase, every minute and at the end, and whether the server went back
to idle (nothing running or waiting, KV usage 0), exited 0 on SIGTERM and left no process behind.

    python scripts/soak.py --minutes 10 -pp 2 --output benchmarks/results/soak_cpu_pp2.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict

import aiohttp

HOST = "127.0.0.1"  # traffic never leaves this machine

COMPLETION_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
                      "List three colours:", "The best way to learn a language is"]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name two planets."]
LONG_PROMPT = ("In the beginning the pipeline had two stages, and every token went from the first to the "
               "second and back to the engine. ") * 14  # ~330 tokens: several prefill chunks
STOPS = [".", " and", "\n"]

BAD_BODIES = [b"", b'{"prompt": "hi", "max_tok', b"[1, 2]", b'{"prompt": "hi", "temperature": NaN}',
              b'{"prompt": "\xff\xfe"}', b'{"prompt": [49152]}', b'{"prompt": "hi", "n": 1000}',
              b'{"prompt": "hi", "logprobs": 50}', b'{"prompt": "hi", "max_tokens": 1000000}',
              b'{"prompt": "hi", "foo": 1}', b'{"prompt": ""}', b'{"prompt": "hi", "seed": -1e30}',
              json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(1000)]}).encode(),
              b'{"a":' * 50_000 + b"1" + b"}" * 50_000, json.dumps({"prompt": "a" * 2_000_000}).encode()]
BAD_CHAT_BODIES = [b'{"messages": []}', b'{"messages": [{"role": "wizard", "content": "hi"}]}',
                   b'{"messages": "hi"}', b'{"messages": [{"role": "user", "content": 5}]}']


# --- the server -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zpp-soak-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "zpp.cli", "serve", args.model, "--host", HOST, "--port", str(self.port),
               "--pipeline-parallel-size", str(args.pp), "--max-model-len", "1024",
               "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--max-request-body-bytes", "1MiB"]
        if args.kill_stage_every:  # every kill within 10 minutes is a restart the server must allow
            cmd += ["--max-stage-restarts", str(int(600 // args.kill_stage_every) + 2)]
        self.cmd = " ".join(cmd[1:])
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
        self.kill()
        raise SystemExit("the server did not become healthy in 300 s")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def worker_pids(self) -> dict[str, int]:
        return {f"stage {s}": pid for s, pid in self.stage_pids().items()}

    def stage_pids(self) -> dict[int, int]:
        """stage -> its current worker's pid (TP rank 0; the newest after a restart)."""
        import re
        out = {}
        for m in re.finditer(r"placement: rank (\d+) = stage (\d+)(?: TP rank (\d+))? on .*? pid (\d+)", self.output()):
            if not m.group(3) or m.group(3) == "0":
                out[int(m.group(2))] = int(m.group(4))
        return out

    def rss_mib(self) -> dict[str, float]:
        pids = {"engine": self.proc.pid, **self.worker_pids()}
        return {name: _rss_mib(pid) for name, pid in pids.items()}

    def descendants(self) -> list[int]:
        kids: dict[int, list[int]] = defaultdict(list)
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        kids[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        out, stack = [], [self.proc.pid]
        while stack:
            for c in kids.get(stack.pop(), []):
                out.append(c)
                stack.append(c)
        return out

    def stop(self) -> tuple[int, list[int]]:
        """SIGTERM; returns (exit status, descendants still alive 10 s later)."""
        kids = self.descendants()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in kids):
            time.sleep(0.1)
        return rc, [p for p in kids if _alive(p)]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(10)


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --- requests -------------------------------------------------------------------------------------
class Failure(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def request_for(kind: str, i: int) -> tuple[str, dict]:
    """(path, body) of the ``i``-th variant of a checked kind."""
    if kind in ("greedy", "greedy-stream", "logprobs", "stop"):
        p = COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)]
        body = {"prompt": p, "max_tokens": 24, "temperature": 0}
        if kind == "greedy-stream":
            body["stream"] = True
        if kind == "logprobs":
            body["logprobs"] = 3
        if kind == "stop":
            body["stop"] = STOPS
        return "/v1/completions", body
    if kind == "chat-greedy":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                                        "max_tokens": 24, "temperature": 0}
    if kind == "seeded":
        return "/v1/completions", {"prompt": COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)], "max_tokens": 24,
                                   "temperature": 0.9, "top_p": 0.95, "seed": 1000 + i % len(COMPLETION_PROMPTS)}
    if kind == "seeded-n2":
        return "/v1/completions", {"prompt": COMPLETION_PROMPTS[i % len(COMPLETION_PROMPTS)], "max_tokens": 20,
                                   "temperature": 1.0, "n": 2, "seed": 7 + i % len(COMPLETION_PROMPTS)}
    if kind == "long-prompt":
        return "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    raise ValueError(kind)


VARIANTS = {"greedy": 5, "greedy-stream": 5, "logprobs": 5, "stop": 5, "chat-greedy": 3, "seeded": 5,
            "seeded-n2": 5, "long-prompt": 1}
REFERENCE_OF = {"greedy-stream": "greedy", "logprobs": "greedy"}  # checked against another kind's answer


async def send(session, url: str, path: str, body: dict, timeout: float) -> dict:
    """The answer as {"choices": [(text, finish_reason, n_logprob_tokens)], "tokens": completion tokens}.
    Raises Failure."""
    try:
        async with session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status >= 500:
                raise Failure("http_5xx", f"{r.status} {(await r.text())[:200]}")
            if r.status != 200:
                raise Failure("unexpected_4xx", f"{r.status} {(await r.text())[:200]}")
            if not body.get("stream"):
                data = await r.json()
                return {"choices": [_choice(c) for c in sorted(data["choices"], key=lambda c: c["index"])],
                        "tokens": data["usage"]["completion_tokens"]}
            text: dict[int, str] = defaultdict(str)
            finish: dict[int, str] = {}
            async for raw in r.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    break
                if line.startswith("data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise Failure("stream_error_event", ev["error"]["message"][:200])
                    for c in ev["choices"]:
                        text[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                        if c.get("finish_reason"):
                            finish[c["index"]] = c["finish_reason"]
            return {"choices": [(text[i], finish.get(i), None) for i in sorted(text)], "tokens": None}
    except asyncio.TimeoutError:
        raise Failure("hang", f"no answer within {timeout} s") from None
    except aiohttp.ClientError as e:
        raise Failure("connection_error", repr(e)[:200]) from None


def _choice(c: dict):
    text = c["message"]["content"] if "message" in c else c["text"]
    lp = c.get("logprobs")
    n_lp = None
    if lp:
        n_lp = len(lp["content"]) if "content" in lp else len(lp["tokens"])
    return (text, c["finish_reason"], n_lp)


async def hang_up(session, url: str, rng: random.Random, timeout: float) -> None:
    body = {"prompt": rng.choice(COMPLETION_PROMPTS), "max_tokens": 64, "stream": True, "ignore_eos": True,
            "temperature": rng.choice([0, 0.8])}
    k = rng.randint(0, 6)
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise Failure("http_5xx" if r.status >= 500 else "unexpected_4xx", str(r.status))
            got = 0
            async for raw in r.content:
                if raw.startswith(b"data: {") and b'"error"' in raw:
                    raise Failure("stream_error_event", raw.decode()[:200])
                got += raw.startswith(b"data: ")
                if got > k:
                    break  # leaving the block closes the connection mid-stream
    except asyncio.TimeoutError:
        raise Failure("hang", f"no answer within {timeout} s") from None
    except aiohttp.ClientError as e:
        raise Failure("connection_error", repr(e)[:200]) from None


async def bad_body(session, url: str, rng: random.Random, timeout: float) -> None:
    chat = rng.random() < 0.25
    data = rng.choice(BAD_CHAT_BODIES if chat else BAD_BODIES)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with session.post(url + path, data=data, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            if r.status >= 500:
                raise Failure("http_5xx", f"{r.status} {raw[:200]!r}")
            if not 400 <= r.status < 500:
                raise Failure("bad_body_not_refused", f"{r.status} for {data[:80]!r}")
            err = json.loads(raw).get("error", {})
            if set(err) != {"message", "type", "param", "code"}:
                raise Failure("bad_body_wrong_error_shape", raw[:200].decode(errors="replace"))
    except asyncio.TimeoutError:
        raise Failure("hang", f"no answer within {timeout} s") from None
    except aiohttp.ClientError as e:
        raise Failure("connection_error", repr(e)[:200]) from None


KINDS = {"greedy": 3, "greedy-stream": 2, "chat-greedy": 2, "stop": 1, "logprobs": 1, "seeded": 2,
         "seeded-n2": 1, "long-prompt": 2, "stream-hang-up": 2, "bad-body": 1}  # relative weights


_MODEL_NAME_LABEL = re.compile(r'model_name="[^"]*",?')


async def scrape(session, url: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` without the ``model_name`` label every series has."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[_MODEL_NAME_LABEL.sub("", key).replace(",}", "}").replace("{}", "")] = float(value)
    return out


async def soak(args, server: Server) -> dict:
    report: dict = {"rss_mib": {"after_start": server.rss_mib()}, "load_average_1m": {"start": os.getloadavg()[0]}}
    url = server.url
    async with aiohttp.ClientSession() as session:
        # Reference answers, one request at a time, nothing else running.
        reference: dict[tuple[str, int], dict] = {}
        t0 = time.monotonic()
        for kind, n in VARIANTS.items():
            if kind in REFERENCE_OF:
                continue
            for i in range(n):
                path, body = request_for(kind, i)
                reference[(kind, i)] = await send(session, url, path, body, args.request_timeout)
        report["reference_s"] = round(time.monotonic() - t0, 1)
        report["reference_answers"] = {f"{k}/{i}": v["choices"][0][0] for (k, i), v in reference.items()}
        report["rss_mib"]["after_reference"] = server.rss_mib()
        metrics0 = await scrape(session, url)

        done: Counter = Counter()
        errors: Counter = Counter()
        examples: dict[str, str] = {}
        latency: dict[str, list[float]] = defaultdict(list)
        rss_trace = []
        deadline = time.monotonic() + args.minutes * 60
        kinds, weights = list(KINDS), list(KINDS.values())

        async def loop(j: int) -> None:
            rng = random.Random(args.seed * 1000 + j)
            for _ in range(args.max_requests_per_loop):
                if time.monotonic() >= deadline:
                    return
                kind = rng.choices(kinds, weights)[0]
                t = time.monotonic()
                try:
                    if kind == "stream-hang-up":
                        await hang_up(session, url, rng, args.request_timeout)
                    elif kind == "bad-body":
                        await bad_body(session, url, rng, args.request_timeout)
                    else:
                        i = rng.randrange(VARIANTS[kind])
                        path, body = request_for(kind, i)
                        got = await send(session, url, path, body, args.request_timeout)
                        want = reference[(REFERENCE_OF.get(kind, kind), i)]
                        texts = [(c[0], c[1]) for c in got["choices"]]
                        if texts != [(c[0], c[1]) for c in want["choices"]]:
                            raise Failure("wrong_output", f"{kind}/{i}: {texts} != {want['choices']}")
                        if kind == "logprobs" and got["choices"][0][2] != got["tokens"]:
                            raise Failure("wrong_output", f"logprobs: {got['choices'][0][2]} entries for "
                                                          f"{got['tokens']} tokens")
                    latency[kind].append(time.monotonic() - t)
                    done[kind] += 1
                except Failure as f:
                    errors[f.kind] += 1
                    examples.setdefault(f.kind, f"{kind}: {f}")

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(60)
                rss_trace.append({"t_min": round((time.monotonic() - (deadline - args.minutes * 60)) / 60, 1),
                                  **server.rss_mib()})
                print(f"  {rss_trace[-1]['t_min']} min: {sum(done.values())} done, {dict(errors)} errors, "
                      f"RSS {rss_trace[-1]}", flush=True)

        kills: list[dict] = []

        async def kill_stages() -> None:
            """--kill-stage-every S: SIGKILL one stage (in turn) every S seconds; the server restarts it."""
            n = 0
            while time.monotonic() + args.kill_stage_every < deadline:
                await asyncio.sleep(args.kill_stage_every)
                stage = n % args.pp
                pid = server.stage_pids()[stage]
                os.kill(pid, signal.SIGKILL)
                kills.append({"t_s": round(time.monotonic() - t_start, 1), "stage": stage, "pid": pid})
                print(f"  killed stage {stage} (pid {pid})", flush=True)
                n += 1

        t_start = time.monotonic()
        sampler = asyncio.create_task(sample_rss())
        killer = asyncio.create_task(kill_stages()) if args.kill_stage_every else None
        await asyncio.gather(*(loop(j) for j in range(args.concurrency)))
        duration = time.monotonic() - t_start
        sampler.cancel()
        if killer is not None:
            killer.cancel()

        # Back to idle?
        idle, t_idle = None, time.monotonic()
        while time.monotonic() - t_idle < 30:
            idle = await scrape(session, url)
            if (idle["zpp:num_requests_running"], idle["zpp:num_requests_waiting"],
                    idle["zpp:kv_cache_usage_perc"]) == (0, 0, 0):
                break
            await asyncio.sleep(0.2)
        async with session.get(url + "/health") as r:
            health = r.status

    def pct(xs, q):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else None

    all_lat = [x for v in latency.values() for x in v]
    report.update({
        "duration_s": round(duration, 1),
        "requests_done": sum(done.values()),
        "requests_done_by_kind": dict(sorted(done.items())),
        "errors_by_kind": dict(sorted(errors.items())),
        "error_examples": examples,
        "latency_ms": {"all": {"p50": pct(all_lat, 0.5), "p99": pct(all_lat, 0.99)},
                       **{k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v)} for k, v in sorted(latency.items())}},
        "preemptions": idle["zpp:num_preemptions_total"] - metrics0["zpp:num_preemptions_total"],
        "aborted": idle.get('zpp:request_success_total{finished_reason="abort"}', 0)
        - metrics0.get('zpp:request_success_total{finished_reason="abort"}', 0),
        "idle_after": {"num_requests_running": idle["zpp:num_requests_running"],
                       "num_requests_waiting": idle["zpp:num_requests_waiting"],
                       "kv_cache_usage_perc": idle["zpp:kv_cache_usage_perc"]},
        "health_after": health,
        "rss_trace_mib": rss_trace,
        "output_tokens_per_s": round((idle["zpp:generation_tokens_total"] - metrics0["zpp:generation_tokens_total"])
                                     / duration, 2),
        "stage_kills": kills,
        "stage_recoveries_s": _recoveries(idle, metrics0),
    })
    report["rss_mib"]["end"] = server.rss_mib()
    report["load_average_1m"]["end"] = os.getloadavg()[0]  # other jobs on the machine slow everything
    start, end = report["rss_mib"]["after_reference"], report["rss_mib"]["end"]
    report["rss_growth_pct"] = {k: round(100 * (end[k] - start[k]) / start[k], 1) for k in start if k in end}
    return report


def _recoveries(now: dict, before: dict) -> dict:
    n = now.get("zpp:stage_recovery_seconds_count", 0) - before.get("zpp:stage_recovery_seconds_count", 0)
    total = now.get("zpp:stage_recovery_seconds_sum", 0) - before.get("zpp:stage_recovery_seconds_sum", 0)
    return {"count": n, "mean_s": round(total / n, 2) if n else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--pp", "-pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--concurrency", type=int, default=8, help="client loops")
    ap.add_argument("--max-requests-per-loop", type=int, default=100_000)
    ap.add_argument("--num-kv-blocks", type=int, default=32, help="small, to keep the scheduler preempting")
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--request-timeout", type=float, default=180.0, help="seconds; past it a request is a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-stage-every", type=float, default=0.0,
                    help="SIGKILL a stage worker (stages in turn) every this many seconds: the server restarts it "
                         "(--max-stage-restarts is raised to cover them); 0: never")
    ap.add_argument("--output", default=None, help="write the report here (JSON)")
    args = ap.parse_args()
    if args.model is None:
        from zpp.demo import prepare_demo_model
        args.model = prepare_demo_model()
    print(f"starting zpp serve (PP={args.pp}) on {HOST} ...", flush=True)
    server = Server(args)
    try:
        print(f"serving at {server.url}; reference answers, then {args.minutes:g} min of traffic", flush=True)
        report = asyncio.run(soak(args, server))
    except BaseException:
        server.kill()
        raise
    rc, left = server.stop()
    report.update({"server_exit_status": rc, "processes_left": left, "server_command": f"zpp {server.cmd.split(' ', 2)[2]}",
                   "soak_command": "python " + " ".join(sys.argv), "log": server.log.name,
                   "tracebacks_in_log": server.output().count("Traceback"),
                   "config": {k: v for k, v in vars(args).items() if k != "output"}})
    report["ok"] = (not report["errors_by_kind"] and rc == 0 and not left and report["health_after"] == 200
                    and report["idle_after"] == {"num_requests_running": 0, "num_requests_waiting": 0,
                                                 "kv_cache_usage_perc": 0})
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
