"""Token sampling on the last pipeline stage.

Order of logit processing follows HF transformers' ``generate`` and vLLM's sampler: penalties
(repetition, CTRL paper, Keskar et al. 2019; frequency and presence, OpenAI API) on the raw logits,
``min_tokens`` suppression of stop tokens, temperature, top-k, top-p (nucleus, Holtzman et al.
2019), min-p (Nguyen et al. 2024), then a draw.

Draws use the "exponential race": ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. is an exact sample
of ``p``. A request with a ``seed`` draws ``E`` from a generator seeded by ``(seed, output index)``,
so its tokens are a pure function of the seed and the logits: the same at any PP size, in any
batch, and after preemption and recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from zpp.sampling_params import SamplingParams
from zpp.transport.messages import PromptLogprobsOutput, TokenLogprobs

_MASK64 = (1 << 63) - 1


@dataclass
class SeqState:
    """What the sampler reads of a sequence: every token known so far and how to sample."""

    token_ids: Sequence[int]
    """A list, or on a worker a view of its slot table's row (``zpp.workers.slots``)."""
    num_prompt_tokens: int
    sampling: Optional[SamplingParams]
    sample_end: int = -1
    """Tokens before the one being sampled now (the sampling chunk's end), as the model runner sets
    it; -1: ``len(token_ids)``. With async scheduling the last of them may still be on the device
    only, not in ``token_ids``."""

    @property
    def num_output_tokens(self) -> int:
        """Output tokens generated before the one being sampled (``min_tokens``, seeds)."""
        end = self.sample_end if self.sample_end >= 0 else len(self.token_ids)
        return end - self.num_prompt_tokens


def _seeded_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    return torch.Generator(device=device).manual_seed(mixed)


def token_logprobs(logprobs_row: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """Chosen token's logprob and rank plus the top-k, from one row of log-softmax values ``[V]``."""
    lp = float(logprobs_row[token_id])
    rank = int((logprobs_row > logprobs_row[token_id]).sum()) + 1
    if k > 0:
        vals, ids = logprobs_row.topk(k)
        return TokenLogprobs(token_id, lp, rank, ids.tolist(), vals.tolist())
    return TokenLogprobs(token_id, lp, rank, [], [])


def unpack_bitmask(bitmask: bytes, num_rows: int, vocab_size: int, device: torch.device,
                   staging: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Structured outputs: xgrammar's packed token bitmask -> a boolean mask of the tokens that
    are NOT allowed (what the logits need: ``masked_fill_(mask, -inf)``).

    Args:
        bitmask: ``int32[num_rows, W]`` little-endian, as bytes or a flat uint8 array; bit ``t % 32``
            of word ``t // 32`` set means token ``t`` is allowed (xgrammar's layout,
            :meth:`zpp.workers.grammar.SlotGrammars.fill`).
        vocab_size: columns of the result (the logits' width); tokens beyond ``32 * W`` are
            disallowed.

        staging: GPU only: pinned host memory of at least ``len(bitmask)`` bytes (uint8) to copy
            through, so the copy to the device does not wait for the GPU's queued work (a copy from
            pageable memory would, and the host would lose its lead on the GPU). It must not be
            reused before this copy is done.

    Returns ``bool[num_rows, vocab_size]`` on ``device``, True = disallowed. On the CPU the bits
    are unpacked by numpy; on a GPU the packed words (32x smaller) are copied and unpacked there.
    """
    if device.type == "cpu":
        packed = np.frombuffer(bitmask, dtype=np.uint8).reshape(num_rows, -1)
        bits = np.unpackbits(~packed, axis=1, bitorder="little").view(np.bool_)  # little-endian words
        out = torch.from_numpy(bits)
    else:
        n = len(bitmask)
        if staging is None:
            staging = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        staging[:n].numpy()[:] = np.frombuffer(bitmask, dtype=np.uint8)
        words = staging[:n].to(device, non_blocking=True).view(torch.int32).view(num_rows, -1)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        out = ((words.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1) == 0
    if out.shape[1] >= vocab_size:
        return out[:, :vocab_size]
    return torch.nn.functional.pad(out, (0, vocab_size - out.shape[1]), value=True)


def apply_allowed(logits: torch.Tensor, allowed) -> None:
    """Set the logits of disallowed tokens to -inf in place. ``allowed`` is ``(rows: int64[R],
    disallowed: bool[R, V])``, ``rows`` increasing indices into ``logits [N, V]`` and
    ``disallowed`` from :func:`unpack_bitmask`, or None (nothing to do)."""
    if allowed is None:
        return
    rows, disallowed = allowed
    if rows.shape[0] == logits.shape[0]:  # every row constrained: rows is 0..N-1
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))


def apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """Add OpenAI's ``logit_bias`` (token id -> bias) to one row of logits ``[V]`` in place; ids
    at or past ``V`` are skipped (the front end refuses ids outside the vocabulary)."""
    V = row.shape[0]
    ids = [t for t in bias if t < V]
    if ids:
        row[torch.tensor(ids, dtype=torch.int64, device=row.device)] += torch.tensor(
            [bias[t] for t in ids], dtype=row.dtype, device=row.device)


class Sampler:
    """Samples one token per row of logits.

    ``__call__(logits [N, V] float32, seqs: list[SeqState], eos_token_ids, allowed=None)`` ->
    ``(token_ids: list[int], logprobs: list[TokenLogprobs | None])``. ``allowed`` (structured
    outputs) is ``(rows int64[R], disallowed bool[R, V])`` (see :func:`apply_allowed`): those rows
    may only pick a token whose ``disallowed`` is False; it is applied before penalties, temperature, top-k/p, min-p and the draw, so it holds
    in every sampling mode, and other rows are untouched. Each row's ``logit_bias`` is added next
    (after the mask, so a biased token the grammar forbids stays forbidden), before penalties. Logprobs are the model's own (before
    the mask).
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @staticmethod
    def plain_greedy(seqs: list[SeqState]) -> bool:
        """Every row is greedy with nothing to adjust or report: the token is just the argmax."""
        return all(is_plain_greedy(s.sampling) for s in seqs)

    @staticmethod
    def greedy(logits: torch.Tensor, allowed=None, keep: Optional[list] = None) -> torch.Tensor:
        """The plain greedy rows' tokens ``int64[N]`` on the device: ``allowed`` applied to
        ``logits`` in place, then the argmax (appended to ``keep`` if given)."""
        apply_allowed(logits, allowed)
        tokens = logits.argmax(dim=-1)
        if keep is not None:
            keep.append(tokens)
        return tokens

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[SeqState], eos_token_ids: set[int], allowed=None,
                 keep: Optional[list] = None):
        """``keep``: if given, the sampled ids as a device tensor ``int64[N]`` are appended to it
        (async scheduling feeds them to the next step without a host round trip)."""
        N, V = logits.shape
        if self.plain_greedy(seqs):
            return self.greedy(logits, allowed, keep).tolist(), [None] * N  # one kernel, one copy
        params = [s.sampling or _GREEDY for s in seqs]
        want_lp = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        logits = logits.clone()
        apply_allowed(logits, allowed)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if p.logit_bias:
                apply_logit_bias(logits[i], p.logit_bias)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._apply_penalties(logits[i], s, p)
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    stop_ids |= eos_token_ids
                ids = [t for t in stop_ids if 0 <= t < V]
                if ids:
                    logits[i, ids] = float("-inf")

        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, seqs, params)
            tokens = torch.where(greedy, tokens, sampled)
        if keep is not None:
            keep.append(tokens)
        token_list = tokens.tolist()

        lps: list[Optional[TokenLogprobs]] = [None] * N
        if raw_logprobs is not None:
            for i, p in enumerate(params):
                if want_lp[i]:
                    lps[i] = token_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
        return token_list, lps

    @staticmethod
    def _apply_penalties(row: torch.Tensor, s: SeqState, p: SamplingParams) -> None:
        V = row.shape[0]
        ids = torch.tensor(s.token_ids, dtype=torch.int64, device=row.device).clamp(0, V - 1)
        if p.repetition_penalty != 1.0:
            seen = torch.unique(ids)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            out = ids[s.num_prompt_tokens:]
            if out.numel():
                counts = torch.bincount(out, minlength=V).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _sample(self, logits: torch.Tensor, seqs: list[SeqState], params: list[SamplingParams]) -> torch.Tensor:
        N, V = logits.shape
        dev = logits.device
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
        logits = logits / temp[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k > 0 for k in top_k):
            k = torch.tensor([k if k > 0 else V for k in top_k], device=dev).clamp(max=V)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(tp < 1.0 for tp in top_p):
            # Follows HF TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1 token.
            tp = torch.tensor(top_p, device=dev)
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cum <= (1 - tp)[:, None]
            remove[:, -1] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(mp > 0 for mp in min_p):
            mp = torch.tensor(min_p, device=dev)
            probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if p.seed is not None and p.temperature > 0:
                g = _seeded_generator(p.seed, s.num_output_tokens, dev)
                noise[i] = torch.empty(V, device=dev).exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def prompt_logprobs(table, cols, logits: torch.Tensor, spans) -> list:
    """The prompt logprobs of a batch's chunks (the model runner's): ``spans`` are ``(chunk index,
    first row of logits, count)`` (``ModelRunner._logit_plan``), ``logits [N, V]``, ``table`` the
    worker's :class:`~zpp.workers.slots.SlotTable`, ``cols`` the batch's columns. Returns one
    :class:`PromptLogprobsOutput` per span."""
    plps: list[PromptLogprobsOutput] = []
    for ci, first, n in spans:
        slot, start = int(cols.slots[ci]), int(cols.starts[ci])
        sp = table.sampling[slot]
        k = (sp.prompt_logprobs if sp else 0) or 0
        lp = torch.log_softmax(logits[first:first + n].float(), dim=-1)
        targets = table.tokens[slot, start + 1:start + 1 + n].tolist()
        entries = [token_logprobs(lp[j], targets[j], k) for j in range(n)]
        plps.append(PromptLogprobsOutput(ci, start + 1, entries))
    return plps


def is_plain_greedy(p: Optional[SamplingParams]) -> bool:
    """Greedy with nothing to adjust or report (None: greedy): the token is just the argmax."""
    p = p or _GREEDY
    return not (p.temperature != 0.0 or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.frequency_penalty or p.presence_penalty or p.min_tokens or p.logit_bias)


_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
