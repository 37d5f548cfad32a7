"""The cost of a speculative-decoding verify step against a 1-token decode step, batch 1 (GPU).

    python scripts/gpu_verify_cost.py [scripts/configs/llama3-8b] [--out results.json]

Builds one stage of the whole model (dummy weights, bf16) behind a ``ModelRunner`` as the engine's
worker does (KV cache, decode CUDA graphs), prefills a 256-token prompt, then times, with the result
on the host after every step (speculation needs it before the next step is placed):

* ``decode graph``: a 1-token decode step (the engine's CUDA-graph path);
* ``decode eager``: the same step on a runner without graphs (the same model and weights);
* ``verify k+1``: a verify chunk of the last token and ``k`` drafts (k = 1..4: ``ExecuteBatch.draft_counts``),
  which runs eagerly today (``ModelRunner.execute``: graphs serve decode batches only), its
  ``1 + k`` rows sampled and verified (``zpp.workers.rejection_sampler``);
* ``verify k+1 graphed forward``: the same chunk's forward and logits replayed from a CUDA graph
  captured for that shape (the ceiling a graphed verify step could reach; no sampling, no host work);
* ``verify k+1 verify graph``: the same step end to end through the engine's verify-graph path
  (``zpp.workers.verify_graphs``: a runner with decode and verify graphs, the graph picked by
  ``ModelRunner.execute``, rejection sampling and the result on the host), and a parity check: a
  run of verify steps (k = 1..4 in turn) through that path gives the same tokens as the eager
  runner (printed as ``verify graph tokens equal eager``; bf16, so a near-tie may flip one).

Each is the median of ``--steps`` steps (ms per step, wall clock with a synchronize). The ratio
``verify / decode graph`` is what speculation pays per step: with a mean acceptance length
``L``, n-gram speculation speeds decode up by about ``L / ratio``. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from zpp.models.base import StageInfo
from zpp.models.loader import load_stage_model
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m
from zpp.workers.model_runner import ModelRunner
from zpp.workers.runner_state import PendingResult

PROMPT = 256


class Seq:
    """One greedy request in slot 0 of ``runner``, driven as the engine core drives it (no async
    scheduling: each step's tokens come back before the next step is built)."""

    def __init__(self, runner: ModelRunner, rid: str, blocks: list[int]):
        self.r = runner
        self.tokens = list(range(1000, 1000 + PROMPT))
        self.sent = PROMPT
        self.bid = 0
        b = m.BatchBuilder()
        b.add(0, 0, PROMPT, m.SAMPLE)
        b.new_request(0, rid, self.tokens, PROMPT, blocks,
                      SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True))
        self._run(b)

    def _run(self, b: m.BatchBuilder) -> m.StepResult:
        self.bid += 1
        res = self.r.execute(b.build(self.bid))
        res = res.finish(self.r) if isinstance(res, PendingResult) else res
        toks = m.int32s(res.tokens).tolist()
        self.tokens.append(toks[-1])
        return res

    def step(self, k: int) -> None:
        """A decode (k = 0) or a verify chunk of k drafts; the drafts are then kept as if accepted
        (the dummy model accepts none; the cost of a step does not depend on it)."""
        start = len(self.tokens) - 1
        drafts = [(start * 7 + i) % 30000 + 5 for i in range(k)]
        b = m.BatchBuilder()
        b.add(0, start, 1 + k, m.SAMPLE, self.tokens[self.sent:], (), drafts)
        self.sent = len(self.tokens)
        self._run(b)
        self.tokens[-1:-1] = drafts  # the drafts "accepted", then the returned token
        self.sent = len(self.tokens) - 1 - k  # the workers know the chunk's input tokens only


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int) -> float:
    for _ in range(5):
        fn()
    _sync()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


@torch.inference_mode()  # the runner's KV cache and inputs are inference tensors
def graphed_verify(runner: ModelRunner, seq: Seq, k: int, steps: int):
    """Capture the forward (and logits of its 1 + k rows) of one verify chunk's shape from the
    arguments the eager path built, and time its replays; None (with the reason) if it cannot be captured."""
    model = runner.model
    seen = {}
    real = model.forward

    def spy(*args, **kw):
        seen["args"], seen["kw"] = args, kw
        return real(*args, **kw)
    model.forward = spy
    try:
        seq.step(k)
    finally:
        model.forward = real
    args, kw = seen["args"], seen["kw"]
    T = 1 + k
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                h = model(*args, **kw)
                model.compute_logits(h[-T:], upcast=False)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            h = model(*args, **kw)
            model.compute_logits(h[-T:], upcast=False)
    except Exception as e:  # report, do not hide
        return None, f"{type(e).__name__}: {e}"[:300]
    return timed(g.replay, steps), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default="scripts/configs/llama3-8b")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: no graphs (the CPU's decode and verify steps)")
    ap.add_argument("--dtype", default="bfloat16", help="float32: the CPU's serving dtype (oneDNN linears)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    cfg = json.load(open(f"{args.config}/config.json"))
    dev = torch.device(args.device)
    max_len = 4096
    model = load_stage_model(args.config, cfg, StageInfo(0, 1, 0, cfg["num_hidden_layers"]), dtype, dev,
                             max_len, "dummy")
    graphed = ModelRunner(model, dev, dtype, 16, None, {0}, max_model_len=max_len, max_num_seqs=1)
    graphed.init_kv_cache(256)
    if dev.type == "cuda":
        graphed.capture_graphs(max_len, 1)
    eager = ModelRunner(model, dev, dtype, 16, None, {0}, max_model_len=max_len, max_num_seqs=1)
    eager.init_kv_cache(256)
    # decode graphs and verify graphs (zpp.workers.verify_graphs), as the worker captures them; on the
    # CPU (a dry run) the verify graphs' stand-in
    from zpp.spec_config import SpeculativeConfig
    from zpp.workers.verify_graphs import EagerVerifyGraphs, VerifyGraphs
    vg = ModelRunner(model, dev, dtype, 16, None, {0}, max_model_len=max_len, max_num_seqs=1)
    vg.init_kv_cache(256)
    spec = SpeculativeConfig("ngram", 4)
    if dev.type == "cuda":
        vg.capture_graphs(max_len, 1)
        vg.verify_graphs = VerifyGraphs(model, vg.kv_caches, 16, max_len, 1, spec, vg.scratch_slot, dtype,
                                        dev, vg.group)
        vg.verify_graphs.capture()
    else:
        vg.verify_graphs = EagerVerifyGraphs(model, vg.kv_caches, 16, 1, spec, vg.scratch_slot, dev, vg.group)
    sg, se = Seq(graphed, "g", list(range(200))), Seq(eager, "e", list(range(200)))
    sv = Seq(vg, "v", list(range(200)))
    # parity first: the same verify steps on a fresh eager runner and the graphed path
    pr = ModelRunner(model, dev, dtype, 16, None, {0}, max_model_len=max_len, max_num_seqs=1)
    pr.init_kv_cache(256)
    pe = Seq(pr, "p", list(range(200)))
    for i in range(24):
        pe.step(1 + i % 4)
        sv.step(1 + i % 4)
    n = sum(a == b for a, b in zip(pe.tokens[PROMPT:], sv.tokens[PROMPT:]))
    rows_parity = f"{n}/{len(pe.tokens) - PROMPT}"
    del pe, pr
    rows = {"card": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "config": args.config, "context": PROMPT, "steps": args.steps}
    rows["verify graph tokens equal eager"] = rows_parity
    # A/B interleaved rounds: every figure is the median over the rounds' medians.
    res: dict[str, list[float]] = {}
    for _ in range(3):
        res.setdefault("decode graph", []).append(timed(lambda: sg.step(0), args.steps))
        res.setdefault("decode eager", []).append(timed(lambda: se.step(0), args.steps))
        for k in range(1, 5):
            res.setdefault(f"verify {k + 1}", []).append(timed(lambda: sg.step(k), args.steps))
            res.setdefault(f"verify {k + 1} verify graph", []).append(timed(lambda: sv.step(k), args.steps))
    for k in range(1, 5 if dev.type == "cuda" else 1):
        t, err = graphed_verify(eager, se, k, args.steps)
        res[f"verify {k + 1} graphed forward"] = [t] if t is not None else []
        if err:
            rows[f"verify {k + 1} graphed forward error"] = err
    base = statistics.median(res["decode graph"])
    rows["ms"] = {name: statistics.median(v) for name, v in res.items() if v}
    rows["rounds"] = res
    rows["ratio_to_decode_graph"] = {name: t / base for name, t in rows["ms"].items()}
    print(f"{rows['card']}, {args.config}, batch 1, context {PROMPT}: ms per step (median of {args.steps}, "
          f"3 interleaved rounds)")
    for name, t in rows["ms"].items():
        print(f"  {name:28s} {t:7.3f} ms   {t / base:5.2f}x decode graph")
    for key, v in rows.items():
        if key.endswith(("error", "equal eager")):
            print(f"  {key}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
