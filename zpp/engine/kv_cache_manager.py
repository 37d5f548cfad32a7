"""The engine's paged KV block manager: one global block-id space shared by every stage.

Each stage holds K/V tensors for its own layers indexed by these ids; the engine decides which
blocks a request uses and tells the workers the block table once (then only appended blocks).

Automatic prefix caching follows vLLM V1's design: a full block is identified by a hash chained
over the token ids of every block before it (seeded with the request's ``kv_variant``); freed blocks keep their hash and stay reusable until
they are evicted, least recently freed first (free queue ordered, tail blocks of a sequence freed
first so that its shared prefix outlives its private tail).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from zpp.engine.request import Request


class KVCacheManager:
    """Allocates fixed-size KV blocks to requests.

    Args:
        num_blocks: blocks in the cache (the minimum any stage can hold).
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks across requests sharing a token prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0  # tokens served from the prefix cache
        self.lookahead = 0
        """Slots given beyond what a request asks for (speculative decoding with MTP: the draft chain
        writes the MTP layer's KV up to ``k - 1`` positions past a step's tokens), up to ``lookahead_limit``."""
        self.lookahead_limit = 1 << 62
        self.recompute_last_hit = False
        """A prefix-cache hit leaves its last block to be computed again (MTP: the MTP layer's KV at a
        position depends on the token after it, which the next block holds; vLLM does the same for
        EAGLE / MTP)."""

    def _ahead(self, num_tokens: int) -> int:
        return min(num_tokens + self.lookahead, max(num_tokens, self.lookahead_limit)) if self.lookahead else num_tokens

    # --- observability ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_of(self, req: Request) -> list[int]:
        return self.req_blocks.get(req.req_id, [])

    def has_slots(self, req: Request, num_tokens: int) -> bool:
        """Whether the blocks ``req`` already holds have room for ``num_tokens`` tokens."""
        return len(self.req_blocks.get(req.req_id, ())) * self.block_size >= self._ahead(num_tokens)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix caching -----------------------------------------------------------------------
    def _update_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes = req.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else req.kv_variant
            hashes.append(hash((parent, tuple(req.token_ids[i * bs:(i + 1) * bs]))))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of ``req``: (block ids, number of tokens). At least one token is
        always left to compute so the last position's logits exist; none for a request that must
        compute every prompt position (``req.skip_prefix_cache``)."""
        if not self.enable_prefix_caching or req.skip_prefix_cache:
            return [], 0
        usable = (req.num_tokens - 1) // self.block_size
        self._update_hashes(req, usable)
        blocks = []
        for h in req.block_hashes[:usable]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        if self.recompute_last_hit and blocks:
            blocks.pop()
        return blocks, len(blocks) * self.block_size

    def record_prefix_lookup(self, req: Request, num_cached: int) -> None:
        """Count one admitted request's lookup in the prefix-cache statistics (``prefix_queries``:
        its tokens, ``prefix_hits``: those served from the cache). The scheduler calls it once per
        request, when it is admitted for the first time: a lookup for a request that then does not
        fit and waits, or for the recompute after a preemption, is not a query (vLLM counts the same
        way), else the hit rate counted every retry of a waiting request."""
        if self.enable_prefix_caching and not req.skip_prefix_cache:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_cached

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.req_id, [])
        n_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        self._update_hashes(req, n_full)
        for i in range(n_full):
            b = blocks[i]
            if self.block_hash[b] is None:
                h = req.block_hashes[i]
                if h not in self.cached:
                    self.cached[h] = b
                    self.block_hash[b] = h

    # --- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> Optional[list[int]]:
        """Give ``req`` enough blocks for ``num_tokens`` tokens.

        ``computed_blocks`` (prefix-cache hits from :meth:`get_computed_blocks`) are taken first on
        admission. Returns the block ids added to the request's table, or None (nothing changed)
        when the free blocks do not suffice.
        """
        num_tokens = self._ahead(num_tokens)
        blocks = self.req_blocks.get(req.req_id)
        if blocks is None:
            blocks = []
        elif not computed_blocks and len(blocks) * self.block_size >= num_tokens:
            return []  # the common decode step: the last block still has room
        need = self.blocks_needed(num_tokens) - len(blocks) - len(computed_blocks)
        reusable_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need > self.num_free_blocks - reusable_free:
            return None
        added = []
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            added.append(b)
        for _ in range(max(0, need)):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            added.append(b)
        self.req_blocks[req.req_id] = blocks + added
        return added

    def free(self, req: Request) -> None:
        """Release the request's blocks (tail first into the free queue)."""
        blocks = self.req_blocks.pop(req.req_id, [])
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def forget_cached_blocks(self) -> None:
        """Drop every prefix-cache entry (a restarted stage lost its KV: no block's content can be
        trusted). Blocks held by requests stay allocated; the caller frees those separately."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
