"""Is ``zpp bench serve`` the limit? One client process against two (issue 12, item 6).

Starts ``zpp serve`` on 127.0.0.1 and alternates, ``--repeat`` times, between one ``zpp bench
serve`` process sending ``--num-prompts`` requests and two processes sending half each, started
together (``--start-at``). The total output token throughput of the two is their tokens over the
union of their runs. If the client were the limit, two processes would get more out of the same
server. Writes the runs, medians and load averages to ``--output-json``.

Usage: ``python scripts/bench_serve_clients.py [--pp 2] [--num-prompts 32 --input-len 64 --output-len 32]``
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready in time")


def clients(base: str, args, n_proc: int, seed: int) -> dict:
    """Run ``n_proc`` client processes together, ``num_prompts / n_proc`` requests each."""
    per = args.num_prompts // n_proc
    start_at = time.time() + 15.0  # time for every process to import, connect and warm up
    procs, files = [], []
    for i in range(n_proc):
        f = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        f.close()
        files.append(f.name)
        cmd = [sys.executable, "-m", "zpp.cli", "bench", "serve", "--base-url", base, "--num-prompts", str(per),
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--seed", str(seed + 1000 * i), "--no-progress", "--start-at", str(start_at),
               "--output-json", f.name]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    load = os.getloadavg()
    for p in procs:
        if p.wait(900) != 0:
            raise RuntimeError(f"a client exited with {p.returncode}")
    res = [json.load(open(f)) for f in files]
    for f in files:
        os.unlink(f)
    start, end = min(r["start_time"] for r in res), max(r["end_time"] for r in res)
    tokens = sum(r["total_output_tokens"] for r in res)
    return {"processes": n_proc, "output_tokens": tokens, "duration_s": round(end - start, 3),
            "output_tok_s": round(tokens / (end - start), 2),
            "per_process_output_tok_s": [round(r["output_throughput"], 2) for r in res],
            "start_skew_s": round(max(r["start_time"] for r in res) - start, 4),
            "failed": sum(r["failed"] for r in res), "loadavg": [round(x, 2) for x in load]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the demo SmolLM2)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--server-args", default="", help="extra `zpp serve` flags (quoted)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    model = args.model
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "zpp.cli", "serve", "--model", model, "-pp", str(args.pp), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    runs = []
    try:
        _wait_ready(base, proc)
        clients(base, args, 1, 99)  # warm-up, not reported
        for i in range(args.repeat):
            order = (1, 2) if i % 2 == 0 else (2, 1)
            for n in order:
                r = clients(base, args, n, 7 + i)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    med = {n: statistics.median(r["output_tok_s"] for r in runs if r["processes"] == n) for n in (1, 2)}
    summary = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
               "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
               "server_command": " ".join(cmd[1:]).replace(model, "<demo model>"),
               "median_output_tok_s": {"one_process": med[1], "two_processes": med[2]},
               "two_over_one": round(med[2] / med[1], 3), "runs": runs}
    print(json.dumps({k: summary[k] for k in ("median_output_tok_s", "two_over_one")}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
