"""What a micro-batch's step costs on each pipeline stage, learnt online from the stages' own timings.

The scheduler sizes prompt chunks with it (``--target-inter-token-latency``, issue 28; the idea of
Sarathi-Serve's stall-free batching): while streams decode, a chunk is the largest that keeps the
slowest stage's predicted step under the target.

Model, per stage ``k``: the seconds of one micro-batch are

    t_k ~ a + b * decode_rows + c * prompt_tokens + d * prompt_pairs + e * decode_context

over the batch's :class:`StepFeatures` (:data:`FEATURES`). ``a`` is the per-step cost (launches,
Python, on a GPU the weights read once); ``b`` and ``c`` a token through the linear layers (a
decode row also through the LM head on the last stage); ``d`` a query-key pair of a prompt chunk's
causal attention (a chunk of ``C`` tokens from position ``s`` has ``C * s + C * (C + 1) / 2``);
``e`` a position of context a decode row attends (memory-bound: its KV is read once per row; a
prompt chunk's reads of its context are in its pairs, where they are compute-bound). The pipeline's
critical figure is the slowest stage's. (A column for the context every chunk reads, the chunks'
own included, was tried: it is almost collinear with the prompt tokens and pairs, and fits on a
busy 2-core VM put the prompt cost there, predicting decodes at long contexts far too slow.)

Fit: recency-weighted least squares of the relative error (a sample of ``t`` seconds weighs
``1 / t^2``: the per-step cost ``a`` shows in short steps, which absolute errors would drown in
long ones) with non-negative coefficients (Lawson-Hanson on the 5 x 5 normal equations, in the
columns' own scale), one per stage, from the step times the stages report
(``StageStats.step_batches`` / ``step_s``: per micro-batch, the stage's own time for it, waiting
for the previous stage excluded). Each sample's weight decays by ``forget`` per later sample of
its stage (``FORGET``: about the last 200 steps count). A prior (:func:`prior_coefficients`, from
the model's shape and a conservative device speed) counts as ``PRIOR_WEIGHT`` observation of each
coefficient's relative error: the model follows the data where the data varies and the prior
elsewhere (e.g. the attention term before any long prompt was seen).
Costs: an observation is an outer product (microseconds); a refit, done lazily on the first
prediction after new data, a few 5 x 5 solves per stage (well under a millisecond); a prediction
is Python arithmetic on cached floats.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import numpy as np

FEATURES = ("step", "decode_rows", "prompt_tokens", "prompt_pairs", "decode_context")
"""The model's columns (see the module docstring)."""

PRIOR_WEIGHT = 1e-4
"""The prior's worth, in observations, per coefficient."""

FORGET = 0.995
"""Per-sample decay of earlier samples' weight (an effective memory of ~200 steps per stage)."""

MIN_PROMPT_CHUNK = 16
"""Fewest prompt tokens the scheduler gives the oldest prompt of a micro-batch (and the shortest
other, so that a short request is not starved next to a long prefill) under a target inter-token
latency, however slow the model predicts the step: every prompt progresses. Smaller
chunks hardly shorten a step at long contexts on the CPU (demo model, one stage, context 6000:
0.40 s with 16 tokens and 4 decodes, 0.46 s with 32; ``benchmarks/results/cpu_chunk_cost_stage0.json``)."""

GAP_AVERAGING = 0.1
"""Weight of each micro-batch's sample in the scheduler's running average of the measured gap
overhead (``StepTarget.overhead``): about the last 10 micro-batches with decodes count."""

_MIN_SECONDS = 1e-4  # a step's time in a sample's relative weight is at least this
_MAX_RECORDED = 4096  # batch features kept for timings still to come (older ones are dropped)


class StepFeatures(NamedTuple):
    """A micro-batch as the cost model sees it (counts; see the module docstring)."""

    step: float = 1.0
    decode_rows: float = 0.0
    prompt_tokens: float = 0.0
    prompt_pairs: float = 0.0
    decode_context: float = 0.0


def chunk_pairs(start: int, n: int) -> int:
    """Query-key pairs of the causal attention of a chunk of ``n`` tokens at ``[start, start + n)``."""
    return n * start + n * (n + 1) // 2


def tokens_within_pairs(start: int, pairs: int) -> int:
    """Largest chunk ``C`` from position ``start`` with ``chunk_pairs(start, C) <= pairs``."""
    b = start + 0.5
    c = int(math.sqrt(b * b + 2 * pairs) - b)
    while c > 0 and chunk_pairs(start, c) > pairs:
        c -= 1
    while chunk_pairs(start, c + 1) <= pairs:
        c += 1
    return c


def prior_coefficients(hf: dict, layers: int, device: str, last: bool = False) -> tuple[float, ...]:
    """A stage's prior coefficients (seconds per unit of each of :data:`FEATURES`) from the model's
    shape (``hf``: its normalized ``config.json``), the stage's number of decoder ``layers``, whether
    it is the ``last`` stage (LM head per decode row) and the ``device`` (``cpu`` / ``cuda``).

    Conservative device speeds, so that an unfitted model errs towards smaller chunks: CPU 20
    GFLOP/s for matrix products and 8 for attention (one core of the 2-core development VM ran the
    demo model's layers at ~30 and its attention at ~15: README, ``scripts/cpu_chunk_cost.py``), 5 GB/s
    of KV reads, 10 ms per step; CUDA 300 TFLOP/s (an H200 peaks at ~790 in bf16), 100 for
    attention, 1.5 TB/s, 3 ms per step plus the stage's weights read once. A decode row's context
    position costs a pair's arithmetic plus its K and V read.
    """
    h = int(hf.get("hidden_size") or hf.get("n_embd") or 1024)
    heads = int(hf.get("num_attention_heads") or hf.get("n_head") or 16)
    head_dim = int(hf.get("head_dim") or h // max(1, heads))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    inter = int(hf.get("intermediate_size") or hf.get("n_inner") or 4 * h)
    if hf.get("num_experts_per_tok"):  # mixture of experts: the experts a token goes through
        inter = int(hf.get("moe_intermediate_size") or inter) * int(hf["num_experts_per_tok"])
    vocab = int(hf.get("vocab_size") or 32000)
    q, kv = heads * head_dim, kv_heads * head_dim
    params = layers * (2 * h * q + 2 * h * kv + 3 * h * inter)  # weights a token goes through
    head = h * vocab if last else 0
    gpu = device == "cuda"
    flops, attn_flops, bandwidth, step = (3e14, 1e14, 1.5e12, 3e-3) if gpu else (2e10, 8e9, 5e9, 1e-2)
    elem = 2 if gpu else 4  # bytes per value (bf16 / float32)
    a = step + (params + head) * elem / bandwidth if gpu else step
    token = 2 * params / flops
    pair = 4 * q * layers / attn_flops
    return (a, token + 2 * head / flops, token, pair, pair + 2 * kv * layers * elem / bandwidth)


def _nnls(G: np.ndarray, h: np.ndarray) -> np.ndarray:
    """``argmin_{x >= 0} x'Gx - 2h'x`` for a symmetric positive definite ``G`` [n, n] and ``h`` [n]
    (Lawson-Hanson's active set on the normal equations)."""
    n = len(h)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(h).max()))
    for _ in range(3 * n):
        w = h - G @ x
        free = ~passive & (w > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, w, -np.inf))] = True
        for _ in range(3 * n):
            z = np.zeros(n)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.solve(G[np.ix_(idx, idx)], h[idx])
            if (z[idx] > 0).all():
                x = z
                break
            neg = idx[z[idx] <= 0]
            alpha = float(np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


class StepCostModel:
    """One linear cost model per pipeline stage (see the module docstring).

    Args:
        priors: per stage, the prior coefficients (``len(FEATURES)`` seconds per unit each).
        prior_weight, forget: see :data:`PRIOR_WEIGHT`, :data:`FORGET`.
    """

    def __init__(self, priors: Sequence[Sequence[float]], prior_weight: float = PRIOR_WEIGHT,
                 forget: float = FORGET):
        n = len(FEATURES)
        if not priors or any(len(p) != n or min(p) < 0 for p in priors):
            raise ValueError(f"priors: one sequence of {n} non-negative coefficients per stage")
        self.num_stages = len(priors)
        self.forget = forget
        # The prior: per coefficient, one observation of its relative error (beta / prior - 1)^2,
        # the measure the samples are weighted by.
        inv = [1.0 / np.maximum(np.asarray(p, dtype=np.float64), 1e-12) for p in priors]
        self._prior_G = [np.diag(prior_weight * v * v) for v in inv]
        self._prior_h = [prior_weight * v for v in inv]
        self._G = [np.zeros((n, n)) for _ in priors]
        self._h = [np.zeros(n) for _ in priors]
        self.num_samples = [0] * self.num_stages
        self._coef: list[tuple[float, ...]] = [tuple(float(v) for v in p) for p in priors]
        self._dirty = [False] * self.num_stages
        self._batches: dict[int, list] = {}  # batch id -> [features, stages that reported it]

    # --- learning -------------------------------------------------------------------------------
    def add_sample(self, stage: int, x: Sequence[float], seconds: float) -> None:
        """One observation: stage ``stage`` took ``seconds`` for a batch of features ``x``."""
        w = 1.0 / max(seconds, _MIN_SECONDS)  # relative errors: short steps count as much as long ones
        v = np.asarray(x, dtype=np.float64) * w
        G, h = self._G[stage], self._h[stage]
        G *= self.forget
        h *= self.forget
        G += np.outer(v, v)
        h += v * (seconds * w)
        self.num_samples[stage] += 1
        self._dirty[stage] = True

    def record(self, batch_id: int, x: StepFeatures) -> float:
        """Remember a micro-batch sent to the stages, for their timings of it (:meth:`observe`).
        Returns its predicted seconds on the slowest stage."""
        self._batches[batch_id] = [x, 0]
        if len(self._batches) > _MAX_RECORDED:
            del self._batches[next(iter(self._batches))]
        return self.predict(x)

    def observe(self, stage: int, batch_ids: Sequence[int], seconds: Sequence[float]) -> None:
        """Stage ``stage``'s times of recorded micro-batches (unknown ids are ignored: sent before a
        restart, or dropped as too old)."""
        for b, t in zip(batch_ids, seconds):
            entry = self._batches.get(b)
            if entry is None or not t >= 0:
                continue
            self.add_sample(stage, entry[0], float(t))
            entry[1] += 1
            if entry[1] >= self.num_stages:
                del self._batches[b]

    def coefficients(self, stage: int) -> tuple[float, ...]:
        """Stage ``stage``'s coefficients now (seconds per unit of each feature, all >= 0)."""
        if self._dirty[stage]:
            G = self._G[stage] + self._prior_G[stage]
            h = self._h[stage] + self._prior_h[stage]
            s = np.sqrt(np.diag(G))  # solve in the columns' own scale
            x = _nnls(G / np.outer(s, s), h / s) / s
            self._coef[stage] = tuple(float(v) for v in x)
            self._dirty[stage] = False
        return self._coef[stage]

    # --- predicting -----------------------------------------------------------------------------
    def stage_times(self, x: Sequence[float]) -> list[float]:
        """Predicted seconds of a micro-batch of features ``x`` on each stage."""
        out = []
        for k in range(self.num_stages):
            out.append(sum(c * v for c, v in zip(self.coefficients(k), x)))
        return out

    def predict(self, x: Sequence[float]) -> float:
        """The pipeline's critical figure: the slowest stage's predicted seconds for ``x``."""
        return max(self.stage_times(x))

    def chunk_times(self, start: int, n: int) -> list[float]:
        """Per stage, the seconds a prompt chunk of ``n`` tokens from position ``start`` adds to a
        step (additive: the chunk from ``start`` plus the one from ``start + n`` cost the whole)."""
        pairs = chunk_pairs(start, n)
        return [c[2] * n + c[3] * pairs for c in map(self.coefficients, range(self.num_stages))]

    def max_chunk(self, time_left: Sequence[float], start: int) -> Optional[int]:
        """The most prompt tokens from position ``start`` whose chunk adds at most ``time_left[k]``
        seconds on every stage ``k`` (0 when none fits; None when no stage charges for prompt
        tokens: no limit)."""
        best = math.inf
        for k in range(self.num_stages):
            room = time_left[k]
            if room <= 0:
                return 0
            _, _, c, d, _ = self.coefficients(k)
            quad, lin = d / 2, c + d * (start + 0.5)  # cost(C) = quad C^2 + lin C
            if quad > 0:
                n = (-lin + math.sqrt(lin * lin + 4 * quad * room)) / (2 * quad)
            elif lin > 0:
                n = room / lin
            else:
                continue
            best = min(best, n)
        if best == math.inf:
            return None
        n = int(min(best, 1 << 30))
        while n > 0 and max(t - r for t, r in zip(self.chunk_times(start, n), time_left)) > 1e-12:
            n -= 1  # rounding
        return n


class StepTarget:
    """The step time a target inter-token latency allows (``--target-inter-token-latency``).

    A stream's gap between tokens spans ``tokens_per_gap`` micro-batches (the pipeline depth; 1 with
    async scheduling), each bounded by its slowest stage, plus what the engine adds (its round
    trip, the transfers, the host's other work on a shared CPU, the model's own bias): measured
    as the streams' gaps less the compute predicted for them (:meth:`add_gaps`), averaged over
    recent micro-batches, and taken off the target (at most half of it) before dividing.

    Args:
        cost: the stages' cost model.
        target: seconds between a stream's tokens.
        tokens_per_gap: micro-batches between a stream's tokens.
    """

    def __init__(self, cost: StepCostModel, target: float, tokens_per_gap: int):
        self.cost = cost
        self.target = target
        self.tokens_per_gap = tokens_per_gap
        self.overhead = 0.0
        """Seconds a stream's measured gap exceeds the compute predicted for it (running average)."""

    @property
    def step_s(self) -> float:
        """Seconds the slowest stage's step may take."""
        return (self.target - min(max(self.overhead, 0.0), self.target / 2)) / self.tokens_per_gap

    def time_left(self, decode_rows: int, decode_context: int, waiting_per_stream: float = 0.0) -> list[float]:
        """Per stage, the seconds a step may take less what these decodes take: :attr:`step_s`, times
        ``waiting_per_stream`` when more requests wait for their first token than streams decode
        (a burst of new requests: a longer step costs each stream less than it saves each of the
        waiting, so they are prefilled in chunks as large as without a target, as that many
        streams' gaps are worth)."""
        step = self.step_s * max(1.0, waiting_per_stream)
        return [step - t for t in self.cost.stage_times(StepFeatures(1.0, decode_rows, 0.0, 0.0, decode_context))]

    def add_gaps(self, gaps: Sequence[float], predicted: float) -> None:
        """The gaps (seconds) the streams of a returned micro-batch saw before their new tokens, and
        the slowest stage's predicted seconds for that micro-batch."""
        extra = sum(gaps) / len(gaps) - self.tokens_per_gap * predicted
        extra = min(max(extra, -self.target), self.target)  # a gap spanning a preemption is no sample
        self.overhead += GAP_AVERAGING * (extra - self.overhead)

