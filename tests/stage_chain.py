"""A model's pipeline stages built and chained in the test process, no workers: each stage loaded as
a worker loads its own (``load_stage_model`` with its ``StageInfo``: only its layers' tensors,
embeddings on the first, norm + lm_head on the last) with a paged KV cache per stage, the
activations handed from one stage's forward to the next. fp32 on the CPU.

Cheap enough to check every split of a model against HF's greedy tokens; the engine path itself
(worker processes, transport, scheduler, sampler) is checked by the callers' one real start per
model and layout."""
from __future__ import annotations

import json
import os
from typing import Sequence

import torch

BLOCK = 16  # KV block size of the in-process runs


def stage_config(model_dir: str) -> dict:
    """``model_dir``'s ``config.json`` as a worker reads it (``registry.normalize_config``)."""
    from zpp.models.registry import normalize_config
    with open(os.path.join(model_dir, "config.json")) as f:
        return normalize_config(json.load(f))


class Chain:
    """The stages of ``sizes`` (layers per stage; one entry: PP=1) of ``model_dir``, each with KV
    room for ``num_seqs`` sequences of up to ``max_len`` tokens; :meth:`step` runs one chunk of every
    sequence through them."""

    def __init__(self, model_dir: str, sizes: Sequence[int], num_seqs: int, max_len: int,
                 max_positions: int = 256):
        from zpp.models.base import StageInfo
        from zpp.models.loader import load_stage_model
        from zpp.models.partition import partition_layers
        from zpp.models.registry import resolve_model_class
        cfg = stage_config(model_dir)
        n = resolve_model_class(cfg).num_layers_of(cfg)
        assert sum(sizes) == n, f"split {tuple(sizes)} of {n} layers"
        ranges = partition_layers(n, len(sizes), tuple(sizes))
        self.stages = [load_stage_model(model_dir, cfg, StageInfo(r, len(sizes), a, b), torch.float32,
                                        torch.device("cpu"), max_positions) for r, (a, b) in enumerate(ranges)]
        per = -(-max_len // BLOCK)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(num_seqs)]
        self.caches = [[torch.zeros(m.kv_cache_shape(per * num_seqs, BLOCK)) for _ in range(m.num_local_layers)]
                       for m in self.stages]
        self.starts = [0] * num_seqs

    def step(self, chunks: list[list[int]]) -> list[list[int]]:
        """``chunks[i]``: sequence i's next tokens -> the argmax after each of them."""
        from zpp.models.layers.attention import build_attention_metadata
        lens = [len(c) for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c])
        pos = torch.tensor([s + j for s, c in zip(self.starts, chunks) for j in range(len(c))])
        meta = build_attention_metadata(self.starts, lens, self.tables, BLOCK, torch.device("cpu"))
        with torch.inference_mode():
            acts = None
            for m, kv in zip(self.stages, self.caches):
                acts = m(ids, pos, acts, kv, meta)
            top = self.stages[-1].compute_logits(acts).argmax(-1).tolist()
        self.starts = [s + n for s, n in zip(self.starts, lens)]
        ends = torch.tensor(lens).cumsum(0).tolist()
        return [top[e - n:e] for e, n in zip(ends, lens)]


def greedy_in_process(model_dir: str, sizes: Sequence[int], prompts: list[list[int]], n: int,
                      max_positions: int = 256) -> list[list[int]]:
    """Greedy decoding through a :class:`Chain`: the prompts prefilled as one batch, then ``n - 1``
    decode steps of every sequence together."""
    chain = Chain(model_dir, sizes, len(prompts), max(map(len, prompts)) + n, max_positions)
    out = [[t[-1]] for t in chain.step(prompts)]
    for _ in range(n - 1):
        for o, t in zip(out, chain.step([[o[-1]] for o in out])):
            o.append(t[0])
    return out


def forced_in_process(model_dir: str, sizes: Sequence[int], prompts: list[list[int]], ref: list[list[int]],
                      max_positions: int = 256) -> list[list[int]]:
    """The greedy tokens of a :class:`Chain` given ``ref`` (HF's tokens) as the inputs (teacher
    forcing: greedy decoding yields ``ref`` exactly when the argmax after each prefix is ``ref``'s
    next token), in two chunks -- the prompts, then every sequence's ``ref[:-1]`` at once over the
    first chunk's KV cache."""
    chain = Chain(model_dir, sizes, len(prompts), max(map(len, prompts)) + max(map(len, ref)), max_positions)
    first = chain.step(prompts)
    return [[f[-1]] + s for f, s in zip(first, chain.step([r[:-1] for r in ref]))]


def even_split(model_dir: str, pp: int) -> tuple[int, ...]:
    """The engine's default split of ``model_dir``'s layers over ``pp`` stages."""
    from zpp.models.partition import even_sizes
    from zpp.models.registry import resolve_model_class
    cfg = stage_config(model_dir)
    return tuple(even_sizes(resolve_model_class(cfg).num_layers_of(cfg), pp))


def pp_splits(model_dir: str, *pps: int) -> list[tuple[int, ...]]:
    """The splits the family tests chain: PP=1 (the whole model), the engine's even split at each
    of ``pps``, and an uneven one (one layer, then the rest)."""
    n = sum(even_split(model_dir, 1))
    return [(n,), *(even_split(model_dir, pp) for pp in pps), (1, n - 1)]


def check_splits(model_dir: str, prompts: list[list[int]], ref: list[list[int]],
                 splits: Sequence[Sequence[int]], label: str = "", max_positions: int = 256) -> None:
    """Every split of ``splits`` gives ``ref`` for every prompt: a one-stage split decodes token by
    token (:func:`greedy_in_process`), the others are teacher-forced (:func:`forced_in_process`).
    Fails naming the split and the prompt."""
    n = len(ref[0])
    for sizes in splits:
        got = greedy_in_process(model_dir, sizes, prompts, n, max_positions) if len(sizes) == 1 else \
            forced_in_process(model_dir, sizes, prompts, ref, max_positions)
        for i, (g, r) in enumerate(zip(got, ref)):
            assert g == r, f"{label} in-process split {tuple(sizes)}, prompt {i} ({len(prompts[i])} tokens)"


__all__ = ["BLOCK", "Chain", "check_splits", "even_split", "forced_in_process", "greedy_in_process", "stage_config"]
