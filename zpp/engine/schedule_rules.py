"""The scheduler's per-request rules (a mixin of :class:`zpp.engine.scheduler.Scheduler`, kept apart to
keep that module short): whether a request in flight may have another chunk in the next
micro-batch (chunked prefill pipelining, async scheduling) and LongRoPE's variant switch."""
from __future__ import annotations

from zpp.engine.request import Request


class RequestRules:
    """Needs the scheduler's ``chunked``, ``async_scheduling``, ``rope_switch_len`` and ``max_model_len``."""

    def _can_pipeline(self, req: Request) -> bool:
        """Whether ``req``, in flight, may have its next prefill chunk in this micro-batch too.

        Stages run micro-batches in the order sent, so a chunk finds in the KV cache of every stage
        the chunks sent before it, whether or not they have come back: a long prompt's chunks can
        follow each other down the pipeline, keeping every stage busy, instead of one chunk going
        through the stages alone. Only prompt tokens (or a recompute) qualify, never a decode,
        which needs the token its previous batch samples."""
        return self.chunked and req.num_scheduled_tokens < req.num_tokens

    def _can_async(self, req: Request) -> bool:
        """Whether ``req``, in flight, may decode in this micro-batch too with async scheduling:
        its newest chunk in flight samples the token at ``num_scheduled_tokens`` (every known
        token is scheduled), its sampling needs no token history on the host, and that token will
        not be its last by length (``max_tokens``, ``max_model_len``): such a step would only be
        dropped. A request finishing on EOS or a stop token still gets one dropped step."""
        if not self.async_scheduling or not req.in_flight or req.num_scheduled_tokens < req.num_tokens:
            return False
        if not req.async_sampling_ok:
            return False
        n_after = req.num_scheduled_tokens + 1  # tokens known once the token in flight is back
        if self._crosses_rope_switch(req, n_after):
            return False  # the request is recomputed once that token is back
        return n_after - req.num_prompt_tokens < req.max_tokens and n_after < self.max_model_len

    # --- LongRoPE -------------------------------------------------------------------------------
    def _set_kv_variant(self, req: Request) -> None:
        """On admission: the request's KV variant from its length now (1: longer than
        ``rope_switch_len``, long rotary factors), its block hashes recomputed if it changed."""
        if self.rope_switch_len is None:
            return
        variant = 1 if req.num_tokens > self.rope_switch_len else 0
        if variant != req.kv_variant:
            req.kv_variant = variant
            req.block_hashes = []

    def _crosses_rope_switch(self, req: Request, num_tokens: int) -> bool:
        """Whether ``req``, computed with the short factors, must be recomputed once it has
        ``num_tokens`` tokens."""
        return self.rope_switch_len is not None and req.kv_variant == 0 and num_tokens > self.rope_switch_len
