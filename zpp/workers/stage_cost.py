"""``--pp-layer-partition auto``: what a stage's forward costs, measured before its weights load.

Each worker builds throw-away one-layer models with random weights (``load_format`` dummy: a
layer's time does not depend on its values) on its own device, with the model's shapes, for every
kind of decoder layer the model has (:meth:`zpp.models.base.StageModel.layer_kinds`: one kind for
most families; dense and mixture-of-experts layers for Qwen3-MoE with ``mlp_only_layers``):

* ``mid``: one layer of the kind as a middle stage would run it (activations in, activations out);
* ``own``: one layer plus this stage's other work (the embedding on the first stage; the final
  norm, the LM head and sampling on the last), with the kind of the stage's own first (last, on
  the last stage) layer;

and times each on a representative micro-batch: a decode step of ``num_seqs`` sequences, one new
token each at ``context_len`` (the steady state of a loaded server, where the LM head's share is
largest: prefill chunks run many tokens through the layers but few through the head). The median
of ``reps`` runs of ``mid`` is the stage's cost of a layer of that kind; ``own - mid`` its extra
cost. The engine then expands the per-kind costs to a per-layer list and chooses the split with
:func:`zpp.models.partition.balanced_partition`.
"""
from __future__ import annotations

import statistics
import time

import torch

from zpp.models.base import StageInfo


def representative_batch(max_num_seqs: int, max_num_batched_tokens: int, pipeline_depth: int,
                         max_model_len: int) -> tuple[int, int]:
    """(sequences, context length) of the micro-batch to measure: the decoding sequences one
    micro-batch carries when ``max_num_seqs`` are spread over ``pipeline_depth`` micro-batches
    (at most 256), at context min(128, max_model_len - 1)."""
    num_seqs = max(1, min(256, max_num_seqs, max_num_batched_tokens) // max(1, pipeline_depth))
    return num_seqs, max(1, min(128, max_model_len - 1))


def distinct_kinds(kinds: list[str]) -> list[str]:
    """The layer kinds of a model in order of first appearance: the order of per-kind costs."""
    return list(dict.fromkeys(kinds))


@torch.inference_mode()
def measure_stage_cost(model_dir: str, cfg: dict, stage: StageInfo, dtype: torch.dtype, device: torch.device,
                       max_model_len: int, block_size: int, num_seqs: int, context_len: int, seed: int = 0,
                       reps: int = 5) -> tuple[list[float], float]:
    """Return ``(layer_s, extra_s)``: seconds of one decoder layer of each kind (in the order of
    :func:`distinct_kinds` of the model's ``layer_kinds``) and of the stage's other work, for one
    decode micro-batch of ``num_seqs`` tokens at ``context_len`` (see the module docstring).

    With tensor parallelism every TP rank of the stage must call this with the same arguments
    (the layers' all-reduces pair up; the number of runs is fixed, never time-dependent).
    ``extra_s`` is 0 for a middle stage and never negative. Memory: at most two one-layer models
    at a time (one kind after the other), the LM head, a one-layer KV cache for the batch; all
    freed before returning.
    """
    from zpp.models.layers.attention import build_attention_metadata
    from zpp.models.loader import load_stage_model
    from zpp.models.registry import resolve_model_class

    kinds = resolve_model_class(cfg, stage.tp_size).layer_kinds(cfg)
    a = stage.layer_end - 1 if stage.is_last else stage.layer_start
    middle = not stage.is_first and not stage.is_last
    B, ctx = num_seqs, context_len
    per_seq = -(-(ctx + 1) // block_size)
    heads = int(cfg.get("num_attention_heads") or cfg.get("n_head") or 1)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
    ids = torch.zeros(B, dtype=torch.int64, device=device)
    pos = torch.full((B,), ctx, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def run(model, kv, meta, acts) -> None:
        first = model.stage.is_first
        out = model(ids if first else None, pos, None if first else acts, kv, meta)
        if model.stage.is_last and model.stage.produces_results:
            logits = model.compute_logits(out)              # [B, V] float32
            logits.softmax(-1).argmax(-1)                   # sampling's share: a softmax over V

    def timed(model, *args) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        run(model, *args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    layer_s, extra_s = [], 0.0
    for kind in distinct_kinds(kinds):
        i = a if kinds[a] == kind else kinds.index(kind)  # the stage's own layer where it is of this kind
        mid = load_stage_model(model_dir, cfg, StageInfo(1, 3, i, i + 1, stage.tp_rank, stage.tp_size),  # neither
                               dtype, device, max_model_len, "dummy", seed)                             # first nor last
        own = None
        if not middle and i == a:
            own = load_stage_model(model_dir, cfg, StageInfo(stage.pp_rank, stage.pp_size, a, a + 1, stage.tp_rank,
                                                             stage.tp_size), dtype, device, max_model_len, "dummy", seed)
        kv = [torch.zeros(mid.kv_cache_shape(B * per_seq + 1, block_size), dtype=dtype, device=device)]
        group = max(1, heads // max(1, mid.num_kv_heads * stage.tp_size))
        meta = build_attention_metadata([ctx] * B, [1] * B, tables, block_size, device, group)
        acts = torch.randn((mid.num_acts, B, mid.hidden_size), generator=gen, device=device).to(dtype)
        run(mid, kv, meta, acts)
        if own is not None:
            run(own, kv, meta, acts)
        t_mid, t_own = [], []
        for _ in range(reps):  # interleaved, so a slow spell of the machine hits both
            t_mid.append(timed(mid, kv, meta, acts))
            if own is not None:
                t_own.append(timed(own, kv, meta, acts))
        layer_s.append(statistics.median(t_mid))
        if own is not None:
            extra_s = max(0.0, statistics.median(t_own) - layer_s[-1])
        del own, mid, kv, meta, acts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return layer_s, extra_s
