"""Split a model's decoder layers into pipeline stages: as even as possible, as given, or balanced
on measured stage costs (``--pp-layer-partition auto``, :func:`balanced_partition`)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from zpp.config import ConfigError

AUTO = "auto"
"""``--pp-layer-partition auto``: each stage measures its costs at start-up and the engine picks
the split with :func:`balanced_partition`."""


def even_sizes(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage as even as possible, the remainder to the earliest stages (30 on 4: 8/8/7/7)."""
    base, extra = divmod(num_layers, pp_size)
    return [base + (1 if i < extra else 0) for i in range(pp_size)]


def partition_layers(num_layers: int, pp_size: int,
                     partition: Union[Sequence[int], str, None] = None) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` layer range of each stage.

    Without ``partition`` (or with ``"auto"``, whose measured split replaces this one at start-up)
    the layers are split as evenly as possible, the remainder going to the earliest stages (30
    layers on 4 stages: 8/8/7/7). The last stage also runs the final norm, the LM head and the
    sampler, so giving it the smaller share keeps the pipeline balanced.

    Raises:
        ConfigError: more stages than layers, or a partition with the wrong length, a stage with
            no layers, or a sum different from ``num_layers``.
    """
    if pp_size > num_layers:
        raise ConfigError(
            f"--pipeline-parallel-size {pp_size} is larger than the model's {num_layers} layers")
    if partition is None or partition == AUTO:
        sizes = even_sizes(num_layers, pp_size)
    else:
        sizes = list(partition)
        if len(sizes) != pp_size:
            raise ConfigError(
                f"--pp-layer-partition has {len(sizes)} entries but --pipeline-parallel-size is {pp_size}")
        if any(s < 1 for s in sizes):
            raise ConfigError(f"--pp-layer-partition {','.join(map(str, sizes))}: every stage needs >= 1 layer")
        if sum(sizes) != num_layers:
            raise ConfigError(
                f"--pp-layer-partition {','.join(map(str, sizes))} sums to {sum(sizes)}, "
                f"but the model has {num_layers} layers")
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges


def stage_times(sizes: Sequence[int], layer_cost: Sequence[float], extra_cost: Sequence[float]) -> list[float]:
    """Each stage's time for one micro-batch: ``sizes[s] * layer_cost[s] + extra_cost[s]``."""
    return [n * c + e for n, c, e in zip(sizes, layer_cost, extra_cost)]


def balanced_partition(num_layers: int, layer_cost: Sequence[float],
                       extra_cost: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage (contiguous, each >= 1, summing to ``num_layers``) that minimize the
    slowest stage's time ``n_s * layer_cost[s] + extra_cost[s]``.

    Args:
        num_layers: decoder layers of the model.
        layer_cost: per stage, seconds one decoder layer takes on that stage's device for the
            representative micro-batch (stages may differ: different devices or hosts).
        extra_cost: per stage, seconds of its work besides the layers (embedding on the first
            stage; final norm, LM head and sampling on the last), same micro-batch.

    Among the splits with the smallest maximum, the one closest to the even split
    (:func:`even_sizes`, by the sum of absolute differences) is returned, so equal costs give the
    even split. Dynamic programming over (stage, layers so far): O(stages x layers^2).

    Raises:
        ConfigError: more stages than layers, or cost lists of a length other than the stages'.
    """
    pp = len(layer_cost)
    if len(extra_cost) != pp or pp < 1:
        raise ConfigError(f"{pp} layer costs and {len(extra_cost)} extra costs for a pipeline")
    if pp > num_layers:
        raise ConfigError(f"--pipeline-parallel-size {pp} is larger than the model's {num_layers} layers")
    inf = float("inf")

    def time(s: int, n: int) -> float:
        return n * layer_cost[s] + extra_cost[s]

    # best[s][k]: smallest slowest-stage time over stages 0..s holding the first k layers.
    best = [[inf] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        best[0][k] = time(0, k)
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            best[s][k] = min(max(best[s - 1][k - n], time(s, n)) for n in range(1, k - s + 1))
    limit = best[pp - 1][num_layers]
    limit += 1e-9 * abs(limit)  # float slack: splits at the optimum must pass the test below
    # Among splits whose every stage is within the optimum, the one closest to the even split.
    even = even_sizes(num_layers, pp)
    dev = [[inf] * (num_layers + 1) for _ in range(pp)]
    choice = [[0] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        if time(0, k) <= limit:
            dev[0][k], choice[0][k] = abs(k - even[0]), k
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            for n in range(1, k - s + 1):
                if time(s, n) <= limit and dev[s - 1][k - n] + abs(n - even[s]) < dev[s][k]:
                    dev[s][k], choice[s][k] = dev[s - 1][k - n] + abs(n - even[s]), n
    sizes, k = [], num_layers
    for s in range(pp - 1, -1, -1):
        sizes.append(choice[s][k])
        k -= choice[s][k]
    return tuple(reversed(sizes))


def parse_partition(text: Optional[str]) -> Union[tuple[int, ...], str, None]:
    """Parse ``"10,10,5,5"`` or ``"auto"``. Raises ConfigError on anything else but
    comma-separated integers."""
    if text is None or text == "":
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-layer-partition {text!r} must be comma-separated integers, e.g. 10,10,5,5, or auto") from None
