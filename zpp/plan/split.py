"""Splits that weigh memory: a min-max dynamic program over contiguous layer ranges, and the
memory-aware ``--pp-layer-partition auto`` built on it (:func:`memory_aware_partition`)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

AUTO_TIME_SLACK = 0.10
"""``--pp-layer-partition auto`` with memory known: the split may make the slowest stage up to this
much slower than the fastest split that fits, to give the KV cache (whose block count is the
smallest stage's) more room; a smaller card then gets fewer layers."""


def minmax_partition(num_layers: int, pp: int, cost: Callable[[int, int, int], float]) -> Optional[tuple[int, ...]]:
    """Layers per stage (contiguous, each >= 1) minimizing the largest ``cost(stage, a, b)`` of a stage
    holding layers ``[a, b)``; among the optimal splits, the one closest to the even split (sum of
    absolute differences). None when every split costs infinity. Dynamic programming,
    O(pp x layers^2) calls of ``cost``."""
    from zpp.models.partition import even_sizes
    inf = float("inf")
    if pp > num_layers:
        return None
    best = [[inf] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        best[0][k] = cost(0, 0, k)
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            best[s][k] = min(max(best[s - 1][k - n], cost(s, k - n, k)) for n in range(1, k - s + 1))
    limit = best[pp - 1][num_layers]
    if limit == inf:
        return None
    limit += 1e-9 * abs(limit)
    even = even_sizes(num_layers, pp)
    dev = [[inf] * (num_layers + 1) for _ in range(pp)]
    choice = [[0] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        if cost(0, 0, k) <= limit:
            dev[0][k], choice[0][k] = abs(k - even[0]), k
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            for n in range(1, k - s + 1):
                d = dev[s - 1][k - n] + abs(n - even[s])
                if d < dev[s][k] and cost(s, k - n, k) <= limit:
                    dev[s][k], choice[s][k] = d, n
    sizes, k = [], num_layers
    for s in range(pp - 1, -1, -1):
        sizes.append(choice[s][k])
        k -= choice[s][k]
    return tuple(reversed(sizes))


def memory_aware_partition(mm: Any, usable: Sequence[int], max_model_len: int,
                           stage_time: Optional[Callable[[int, int, int], float]] = None) -> Optional[tuple[int, ...]]:
    """``--pp-layer-partition auto`` with each stage's usable memory known (bytes; GPUs): among the
    splits where every stage holds its weights, margins and the KV cache of one ``max_model_len``
    sequence, take the fastest (``stage_time(stage, a, b)``: measured seconds; default: layers held,
    all devices alike) and, within :data:`AUTO_TIME_SLACK` of it, the one whose smallest stage KV
    cache (the engine's block count) is largest. None when no split fits."""
    pp, L = len(usable), mm.num_layers
    if stage_time is None:
        def stage_time(s, a, b):
            return float(b - a)

    def kv_tokens(s: int, a: int, b: int) -> float:
        pos = mm.position(s, pp)
        left = usable[s] - mm.need(pos, a, b)
        return left / max(1, mm.kv_per_token(a, b))

    def fits(s, a, b) -> bool:
        return kv_tokens(s, a, b) >= max_model_len

    fastest = minmax_partition(L, pp, lambda s, a, b: stage_time(s, a, b) if fits(s, a, b) else float("inf"))
    if fastest is None:
        return None
    t_best = max(stage_time(s, a, b) for s, (a, b) in enumerate(_ranges(fastest)))
    limit = t_best * (1 + AUTO_TIME_SLACK) + 1e-12
    return minmax_partition(L, pp, lambda s, a, b: -kv_tokens(s, a, b)
                            if fits(s, a, b) and stage_time(s, a, b) <= limit else float("inf"))


def _ranges(sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for n in sizes:
        out.append((a, a + n))
        a += n
    return out
