"""The model runner's start-up passes: the memory profile's forward pass and the warm-ups that
build, before serving, the kernel variants a step could otherwise compile mid-run (the LM head at
every logit bucket, the MoE experts at every tile configuration).

A mixin of :class:`zpp.workers.model_runner.ModelRunner`: it uses the runner's ``model``,
``stage``, ``device``, ``dtype``, ``block_size``, ``max_model_len``, ``group``, ``kv_caches`` and
``init_kv_cache``.
"""
from __future__ import annotations

import logging
import time

import torch

from zpp.models.layers.attention import build_attention_metadata
from zpp.workers.runner_state import logit_buckets

logger = logging.getLogger("zpp.workers.model_runner")


class StartUpPasses:
    """Start-up passes of a stage's model runner (see the module docstring)."""

    @torch.inference_mode()
    def warm_up_logits(self, max_rows: int) -> None:
        """CUDA, result rank: run the LM head (and argmax, and the float32 upcast) once at every
        row count of :func:`logit_buckets` up to ``max_rows`` -- at most the rows the memory profile
        covered -- so no step of a run loads a cuBLAS kernel (a device-wide wait) for a new shape."""
        if self.device.type != "cuda" or not self.stage.produces_results:
            return
        t = time.perf_counter()
        buckets = logit_buckets(max_rows)
        h = torch.zeros(buckets[-1], self.model.hidden_size, dtype=self.dtype, device=self.device)
        for b in buckets:
            logits = self.model.compute_logits(h[:b], upcast=False)
            logits.argmax(dim=-1)
            logits.float()
        torch.cuda.synchronize()
        self._logit_buckets = buckets
        logger.info("LM head warmed up at %d row counts (up to %d) in %.1fs", len(buckets), max_rows,
                    time.perf_counter() - t)

    def profile_batch(self, num_tokens: int) -> tuple[list[int], torch.Tensor, list[list[int]]]:
        """The memory profile's micro-batch of ``num_tokens`` prompt tokens as the scheduler could
        send it: sequences of at most ``max_model_len`` tokens each (``--max-num-batched-tokens`` may
        exceed ``--max-model-len``), so no position reaches past the tables sized by
        ``max_model_len`` (rotary cos/sin, position embeddings: one sequence of ``num_tokens``
        positions read past their end -- the device-side index assert of a DeepSeek-V3 start-up at
        ``--max-model-len 512``). Returns ``(query lengths, positions int64 [num_tokens], block
        tables)``, blocks numbered from 0 without overlap."""
        cap = max(1, self.max_model_len)
        lens = [min(cap, num_tokens - s) for s in range(0, num_tokens, cap)]
        tables, nxt = [], 0
        for n in lens:
            b = -(-n // self.block_size)
            tables.append(list(range(nxt, nxt + b)))
            nxt += b
        pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
        return lens, pos, tables

    def warm_up_experts(self, max_tokens: int) -> int:
        """Run the stage's MoE experts at every token count up to ``max_tokens`` that launches a
        kernel variant of its own (:func:`zpp.models.layers.moe_warmup.warm_up_moe`); the number of
        forwards run (0 without experts)."""
        from zpp.models.layers.moe_warmup import warm_up_moe
        return warm_up_moe(self.model, self.model.cfg.get("num_experts_per_tok"), max_tokens, self.device,
                           self.dtype)

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_logit_rows: int) -> int:
        """CUDA: run the largest micro-batch once (:meth:`profile_forward`) and return the peak bytes
        allocated, weights included."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_forward(num_tokens, num_logit_rows)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_logit_rows: int) -> None:
        """The memory profile's forward pass (any device): ``num_tokens`` prompt tokens in sequences
        of at most ``max_model_len`` (:meth:`profile_batch`), logits, log-softmax and the sort of
        ``num_logit_rows`` rows on the result rank, in a KV cache of its own (dropped after)."""
        lens, pos, tables = self.profile_batch(num_tokens)
        self.init_kv_cache(sum(len(t) for t in tables))
        meta = build_attention_metadata([0] * len(lens), lens, tables, self.block_size, self.device, self.group)
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = pos.to(self.device)
        acts = None if self.stage.is_first else torch.zeros(
            self.model.num_acts, num_tokens, self.model.hidden_size, dtype=self.dtype, device=self.device)
        out = self.model(ids if self.stage.is_first else None, pos, acts, self.kv_caches, meta)
        if self.stage.produces_results:
            rows = out[:1].expand(num_logit_rows, -1).contiguous()
            logits = self.model.compute_logits(rows)
            torch.log_softmax(logits, -1)
            logits.softmax(-1).sort(-1)
        self.kv_caches = []


def warm_up_and_watch(runner, cfg_all) -> None:
    """Start-up's last step on a GPU: build the kernel variants serving can launch that the memory
    profile and the decode graphs did not -- the LM head at every logit bucket up to the rows the
    profile covered, the MoE experts at every tile configuration and argument class up to
    ``--max-num-batched-tokens`` tokens (:func:`zpp.models.layers.moe_warmup.warm_up_moe`) -- then
    report every later compile (:func:`zpp.utils.late_compiles.watch_late_compiles`)."""
    runner.warm_up_logits(min(cfg_all.scheduler.max_num_seqs, cfg_all.max_num_batched_tokens))
    runner.warm_up_experts(cfg_all.max_num_batched_tokens)
    from zpp.utils.late_compiles import watch_late_compiles
    watch_late_compiles()
