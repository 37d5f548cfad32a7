"""Start-up time: seconds from the command to a server that answers ``/health`` (``zpp serve``, a new
process each run), and seconds an ``LLM(...)`` takes in a process that has imported zpp and loaded the
tokenizer once (what a notebook or a test run sees).

    python scripts/bench_startup.py [MODEL_DIR] [--pp 1 2] [--runs 3]

MODEL_DIR defaults to the packaged demo model. Prints one line per setting: min / median / max.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_to_health(model: str, pp: int, timeout_s: float = 300.0) -> float:
    """Seconds from starting ``zpp serve MODEL -pp PP`` to its first 200 on /health; the server is
    stopped (SIGTERM) afterwards. Raises RuntimeError if it exits or times out first."""
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "zpp.cli", "serve", model, "-pp", str(pp), "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"zpp serve exited with {proc.returncode} before answering /health")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no /health answer within {timeout_s} s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(60)


def llm_start(model: str, pp: int) -> float:
    """Seconds ``LLM(model, pipeline_parallel_size=pp)`` takes to return (then shut down)."""
    from zpp import LLM
    t0 = time.perf_counter()
    llm = LLM(model, pipeline_parallel_size=pp)
    took = time.perf_counter() - t0
    llm.shutdown()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="model directory (default: the packaged demo model)")
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2], help="pipeline-parallel sizes")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from zpp.demo import prepare_demo_model
        model = prepare_demo_model()
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(model)  # LLM runs: the tokenizer's first load is not counted
    for what, fn in (("zpp serve -> /health", serve_to_health), ("LLM(...) in a warm process", llm_start)):
        for pp in args.pp:
            xs = [fn(model, pp) for _ in range(args.runs)]
            print(f"{what:28s} pp={pp}: min {min(xs):.2f} s, median {statistics.median(xs):.2f} s, "
                  f"max {max(xs):.2f} s ({args.runs} runs)", flush=True)


if __name__ == "__main__":
    main()
