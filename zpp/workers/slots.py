"""A worker's per-request state as arrays indexed by slot (the engine's numbering of the requests
the workers hold, see ``zpp.transport.messages``), so that a micro-batch's columns update and read
it with a few numpy operations instead of a Python loop over its sequences."""
from __future__ import annotations

from typing import Optional

import numpy as np

from zpp.models.layers.attention import TABLE_WIDTH_ALIGN, block_table_width
from zpp.sampling_params import SamplingParams
from zpp.transport import messages as m
from zpp.workers.sampler import SeqState, is_plain_greedy


class SlotTable:
    """The requests a worker holds, one row per slot (``S`` = ``num_slots``, the engine's
    ``max_num_seqs``: the engine gives out the lowest free slot and never holds more requests).

    Arrays:
        tokens ``int32[S, max_model_len]``: row ``s`` holds the request's known tokens, the first
            ``num_tokens[s]`` of it valid (with async scheduling the newest may be on the device only).
        blocks ``int32[S, W]``: its KV block table, the first ``num_blocks[s]`` valid (at most
            ``max_blocks = ceil(max_model_len / block_size)``) and the rest 0 (so a row's prefix is a
            block table as is); ``W`` is ``max_blocks`` rounded up to ``TABLE_WIDTH_ALIGN``.
        num_tokens, num_blocks, num_prompt ``int64[S]``; live ``bool[S]`` (the slot holds a request);
        plain ``bool[S]`` (it samples greedily with nothing to adjust or report:
            :func:`~zpp.workers.sampler.is_plain_greedy`).
        prev_src, prev_row ``int64[S]``: async scheduling: where the token this worker last sampled
            for the request lies on the device (a key of ``ModelRunner``'s kept tensors, -1 for
            none, and its row).
        sampling, req_ids: per-slot lists (SamplingParams or None; the id, for error messages).

    Both tables are allocated zeroed (``np.zeros``: calloc, so pages no row reaches are never
    touched): resident memory follows the tokens held, not ``S x max_model_len``.
    """

    def __init__(self, num_slots: int, max_model_len: int, block_size: int):
        S = self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.tokens = np.zeros((S, max_model_len), dtype=np.int32)
        # columns past max_blocks stay 0: room for block_rows' widths rounded up to TABLE_WIDTH_ALIGN
        self.blocks = np.zeros((S, block_table_width(max_model_len, block_size, TABLE_WIDTH_ALIGN)), dtype=np.int32)
        self.num_tokens = np.zeros(S, dtype=np.int64)
        self.num_blocks = np.zeros(S, dtype=np.int64)
        self.num_prompt = np.zeros(S, dtype=np.int64)
        self.live = np.zeros(S, dtype=bool)
        self.plain = np.zeros(S, dtype=bool)
        self.prev_src = np.full(S, -1, dtype=np.int64)
        self.prev_row = np.zeros(S, dtype=np.int64)
        self.sampling: list[Optional[SamplingParams]] = [None] * S
        self.req_ids: list[str] = [""] * S
        self._mark = np.zeros(S, dtype=np.int64)  # scratch of the duplicate-slot check

    # --- applying a micro-batch -------------------------------------------------------------------
    def apply(self, batch: m.ExecuteBatch) -> m.BatchColumns:
        """Apply what ``batch`` changes (freed slots, new requests, each chunk's new tokens and
        blocks, in that order) and check its chunks against the state; returns its columns.

        Raises:
            ValueError: a malformed batch (see :class:`~zpp.transport.messages.BatchColumns`), or one
                that does not fit this worker's state: a slot out of range or not holding a request,
                a request twice, a chunk past the known tokens (or a FROM_PREV one not right after
                them), a chunk without KV blocks for all its positions, a row past ``max_model_len``.
        """
        cols = m.BatchColumns(batch)
        freed = cols.freed_slots
        if len(freed):
            self._check_range(freed, "freed slot")
            self.live[freed] = False
            self.prev_src[freed] = -1
            for s in freed.tolist():
                self.sampling[s] = None
        for r in batch.new_reqs:
            self._add(r)
        if cols.size:
            self._check_slots(cols.slots)
            self._append(cols.slots, cols.new_token_counts, cols.new_tokens, self.tokens, self.num_tokens, "tokens")
            self._append(cols.slots, cols.new_block_counts, cols.new_blocks, self.blocks, self.num_blocks, "blocks",
                         self.max_blocks)
            self._check_chunks(cols)
            if len(cols.draft_tokens):
                self._put_drafts(cols)
        return cols

    def _put_drafts(self, cols: m.BatchColumns) -> None:
        """Speculative decoding: each chunk's draft tokens go right after its request's known
        tokens (inputs of the chunk's positions ``start + 1 ..``), not counted among them: the next
        batch's new tokens (the accepted ones and what follows) overwrite them."""
        has = cols.draft_counts > 0
        slots, counts = cols.slots[has], cols.draft_counts[has]
        ends = np.cumsum(counts, dtype=np.int64)
        owner = np.repeat(np.arange(len(slots)), counts)
        cols_at = np.arange(len(cols.draft_tokens)) - (ends - counts)[owner] + self.num_tokens[slots][owner]
        self.tokens[slots[owner], cols_at] = cols.draft_tokens

    def _check_range(self, slots: np.ndarray, what: str) -> None:
        if int(slots.max()) >= self.num_slots:
            raise ValueError(f"{what} {int(slots.max())} out of range: this worker holds {self.num_slots} slots "
                             f"(--max-num-seqs)")

    def _add(self, r: m.NewRequest) -> None:
        s = r.slot
        if not 0 <= s < self.num_slots:
            raise ValueError(f"sequence {r.req_id}: slot {s} out of range (this worker holds {self.num_slots})")
        toks, blks = m.int32s(r.token_ids), m.int32s(r.block_ids)
        if len(toks) > self.max_model_len or len(blks) > self.max_blocks or not 0 <= r.num_prompt_tokens <= len(toks):
            raise ValueError(f"sequence {r.req_id}: {len(toks)} tokens ({r.num_prompt_tokens} of prompt) and "
                             f"{len(blks)} blocks do not fit max_model_len {self.max_model_len}")
        self.tokens[s, :len(toks)] = toks
        self.blocks[s, :len(blks)] = blks
        self.blocks[s, len(blks):max(len(blks), int(self.num_blocks[s]))] = 0  # the slot's previous request's
        self.num_tokens[s] = len(toks)
        self.num_blocks[s] = len(blks)
        self.num_prompt[s] = r.num_prompt_tokens
        self.live[s] = True
        self.plain[s] = is_plain_greedy(r.sampling)
        self.prev_src[s] = -1
        self.sampling[s] = r.sampling
        self.req_ids[s] = r.req_id

    def _check_slots(self, slots: np.ndarray) -> None:
        self._check_range(slots, "slot")
        dead = ~self.live[slots]
        if dead.any():
            raise ValueError(f"a chunk for slot {int(slots[np.argmax(dead)])}, which holds no request")
        idx = np.arange(len(slots))
        self._mark[slots] = idx
        if not (self._mark[slots] == idx).all():
            raise ValueError("a request with two chunks in one micro-batch")

    @staticmethod
    def _append(slots: np.ndarray, counts: np.ndarray, values: np.ndarray, table: np.ndarray, lengths: np.ndarray,
                what: str, limit: Optional[int] = None) -> None:
        """Append each chunk's ``counts[i]`` entries of ``values`` (chunk after chunk) to row
        ``slots[i]`` of ``table`` after its first ``lengths[slot]`` entries (at most ``limit``
        entries a row, default the table's width)."""
        if not len(values):
            return
        gaining = counts != 0
        if not gaining.all():
            slots, counts = slots[gaining], counts[gaining]
        have = lengths[slots]
        limit = table.shape[1] if limit is None else limit
        if int((have + counts).max()) > limit:
            raise ValueError(f"new {what} past a row of {limit} (max_model_len)")
        if len(values) == len(slots):  # one entry each: the usual case (a token, or a new block)
            table[slots, have] = values
        else:
            ends = np.cumsum(counts, dtype=np.int64)
            owner = np.repeat(np.arange(len(slots)), counts)
            table[slots[owner], np.arange(len(values)) - (ends - counts)[owner] + have[owner]] = values
        lengths[slots] = have + counts

    def _check_chunks(self, cols: m.BatchColumns) -> None:
        slots = cols.slots
        starts = cols.starts.astype(np.int64)
        end = starts + cols.num_tokens
        known = self.num_tokens[slots]
        fp = cols.from_prev
        drafts = cols.draft_counts
        ok = np.where(fp, (starts >= known) & (cols.num_tokens == 1) & cols.sample,
                      (end <= known + drafts) & ((drafts == 0) | (starts + 1 == known)))
        ok &= end <= self.max_model_len
        if not ok.all():
            i = int(np.argmax(~ok))
            raise ValueError(f"sequence {self.req_ids[int(slots[i])]}: chunk [{int(starts[i])}, {int(end[i])})"
                             f"{' (FROM_PREV)' if fp[i] else ''} with {int(known[i])} tokens known")
        short = end > self.num_blocks[slots] * self.block_size
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"sequence {self.req_ids[int(slots[i])]}: no KV slots for position {int(end[i]) - 1} "
                             f"({int(self.num_blocks[slots[i]])} blocks)")

    # --- reading --------------------------------------------------------------------------------
    def block_rows(self, slots: np.ndarray, width: int) -> np.ndarray:
        """``int32[len(slots), width]``: the first ``width`` entries of each slot's block table, 0
        past its blocks."""
        return self.blocks[:, :width][slots]

    def seq_states(self, slots: np.ndarray, sample_ends: np.ndarray) -> list[SeqState]:
        """What the sampler reads of each slot's request, sampling after position ``sample_ends[i] - 1``
        (its token ids: a view of the table)."""
        return [SeqState(self.tokens[s, :self.num_tokens[s]], int(self.num_prompt[s]), self.sampling[s], sample_end=e)
                for s, e in zip(slots.tolist(), sample_ends.tolist())]
