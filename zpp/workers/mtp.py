"""Speculative decoding with MTP on the last stage: the checkpoint's multi-token-prediction layer
(:mod:`zpp.models.deepseek_mtp`) drafts each request's next ``k`` tokens.

After a micro-batch's forward and sampling (or verification), on the result rank:

1. **The MTP layer runs on every position of the batch** (prefill chunks included: its attention
   needs KV for every position, kept in the stage's extra latent cache, indexed by the request's
   block table as the main layers' caches are). Position ``p`` takes the main model's final hidden
   state ``h_p`` (after the final norm) and the token at ``p + 1``: the next prompt token, a draft
   the chunk carried, or the token just sampled; it writes its KV at ``p`` with the batch's own
   attention metadata (same positions, same slots).
2. For a chunk that sampled, the row of its last accepted position ``p`` (a verify chunk with ``a``
   drafts accepted: its row ``a``, whose next token is the one the target sampled after them;
   rows past it computed garbage at positions that are rolled back and written again) gives
   draft ``d_1 = argmax(shared_head(MTP(h_p, t_{p+1})))``, the token after the one just sampled.
3. **Chained** ``k - 1`` more times as vLLM does with one MTP layer: step ``j`` runs the layer at
   position ``p + j`` on its own previous output and ``d_j``, a one-token decode whose KV lands in
   the slots the core reserved past the step's tokens (``KVCacheManager.lookahead = k - 1``); the
   next step's forward overwrites them with the right values. A chain stops at ``max_model_len``
   or the blocks the request holds (its entries are -1).

The drafts (greedy: a one-hot draft distribution, so the rejection sampler's rule is exact for
sampled requests too) travel back with the result (``StepResult.draft_tokens``); the core keeps them
and schedules them as the request's next verify chunk (:meth:`zpp.engine.spec_decode.SpecDecoder.
propose`): every decision stays in the core's one schedule (invariant 9), and a request is in at
most one micro-batch in flight, so the drafts are known before its next step is scheduled.
"""
from __future__ import annotations

import numpy as np
import torch

from zpp.models.layers.attention import build_attention_metadata
from zpp.transport import messages as m


class MTPDrafter:
    """Runs the MTP layer of ``runner``'s model (its last stage; one MTP layer: DeepSeek-V3's) for
    ``k`` draft tokens per sampling chunk (``--speculative-config`` ``num_speculative_tokens``)."""

    def __init__(self, runner, k: int):
        model = runner.model
        self.runner = runner
        self.k = k
        self.layer = model.model.layers[int(model.cfg["num_hidden_layers"])]
        self.kv_index = model.stage.layer_end - model.stage.layer_start  # its cache: after the stage's layers

    def draft(self, cols: m.BatchColumns, hidden: torch.Tensor, positions: torch.Tensor, meta,
              result: m.StepResult) -> None:
        """Step 1-3 of the module docstring for one batch: ``hidden [T, H]`` the last stage's output
        rows, ``positions [T]`` and ``meta`` the forward's; sets ``result.draft_tokens``
        (``int32[S * k]``, ``S`` the batch's sampling chunks)."""
        r = self.runner
        table, kv = r.table, r.kv_caches[self.kv_index]
        q = cols.num_tokens.astype(np.int64)
        starts = cols.starts.astype(np.int64)
        offsets = np.cumsum(q) - q
        owner = np.repeat(np.arange(cols.size), q)
        pos = np.arange(int(q.sum())) - offsets[owner] + starts[owner]
        nxt = table.tokens[cols.slots[owner], np.minimum(pos + 1, table.max_model_len - 1)].astype(np.int64)
        chunks = np.flatnonzero(cols.sample)
        src = np.zeros(0, dtype=np.int64)
        if len(chunks) and result.tokens:
            toks = m.int32s(result.tokens).astype(np.int64)
            counts = m.int32s(result.token_counts).astype(np.int64) if result.token_counts \
                else np.ones(len(chunks), dtype=np.int64)
            src = offsets[chunks] + q[chunks] - 1 - cols.draft_counts[chunks].astype(np.int64) + counts - 1
            nxt[src] = toks[np.cumsum(counts) - 1]  # the token after each chunk's last accepted position
        r.trace.mark("mtp", r._batch_id, args={"rows": len(nxt)})
        ids = r.staging.upload([nxt] + ([src] if len(src) else []))
        x = self.layer(positions, ids[0], hidden, kv, meta)                       # [T, H]
        if not len(src):
            return
        out = np.full((len(chunks), self.k), -1, dtype=np.int64)
        h = x[ids[1]]                                                             # [S, H]
        d = self.layer.logits(h).argmax(dim=-1)                                   # [S]
        out[:, 0] = d.tolist()
        rows = np.arange(len(chunks))  # the chunks still chaining
        p = pos[src]
        slots = cols.slots[chunks]
        bs = table.block_size
        for j in range(1, self.k):
            at = p[rows] + j
            ok = (at < table.max_model_len) & (at < table.num_blocks[slots[rows]] * bs)
            if not ok.all():
                keep = np.flatnonzero(ok)
                rows, at = rows[keep], at[keep]
                sel = torch.as_tensor(keep, device=h.device)
                h, d = h[sel], d[sel]
            if not len(rows):
                break
            width = int(at.max()) // bs + 1
            step_meta = build_attention_metadata(at.tolist(), [1] * len(rows), table.block_rows(slots[rows], width),
                                                 bs, r.device, r.group)
            h = self.layer(r.staging.upload([at])[0], d, h, kv, step_meta)         # [S', H]
            d = self.layer.logits(h).argmax(dim=-1)
            out[rows, j] = d.tolist()
        result.draft_tokens = m.pack_int32(out.reshape(-1).tolist())
        r.trace.mark("mtp_drafted", r._batch_id, args={"chunks": len(chunks)})
