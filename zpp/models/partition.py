"""Split a model's decoder layers into pipeline stages: as even as possible, as given, or balanced
on measured stage costs (``--pp-layer-partition auto``, :func:`balanced_partition`)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from zpp.errors import ConfigError

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


LayerCost = Union[float, Sequence[float]]
"""One stage's layer costs: seconds of every decoder layer (all layers alike), or a list giving
the seconds of each global layer ``i`` on that stage (layers of different kinds, e.g. dense and
mixture-of-experts MLPs)."""


def _range_cost(cost: LayerCost, a: int, b: int, prefix: Optional[list[float]]) -> float:
    """Seconds of layers ``[a, b)`` at ``cost`` (``prefix``: its running sums, for a list)."""
    return (b - a) * cost if prefix is None else prefix[b] - prefix[a]


def _prefix(cost: LayerCost, num_layers: int) -> Optional[list[float]]:
    if isinstance(cost, (int, float)):
        return None
    if len(cost) != num_layers:
        raise ConfigError(f"{len(cost)} per-layer costs for a model of {num_layers} layers")
    out = [0.0]
    for c in cost:
        out.append(out[-1] + float(c))
    return out


def stage_times(sizes: Sequence[int], layer_cost: Sequence[LayerCost], extra_cost: Sequence[float]) -> list[float]:
    """Each stage's time for one micro-batch: its layers' costs (``sizes[s] * layer_cost[s]`` when
    the cost is one number; the sum over the stage's layers when it is a per-layer list) plus
    ``extra_cost[s]``."""
    num_layers = sum(sizes)
    out, start = [], 0
    for n, c, e in zip(sizes, layer_cost, extra_cost):
        out.append(_range_cost(c, start, start + n, _prefix(c, num_layers)) + e)
        start += n
    return out


def balanced_partition(num_layers: int, layer_cost: Sequence[LayerCost],
                       extra_cost: Sequence[float]) -> tuple[int, ...]:
    """Layers per stage (contiguous, each >= 1, summing to ``num_layers``) that minimize the
    slowest stage's time: its layers' costs plus ``extra_cost[s]``.

    Args:
        num_layers: decoder layers of the model.
        layer_cost: per stage, seconds one decoder layer takes on that stage's device for the
            representative micro-batch (stages may differ: different devices or hosts); either
            one number for every layer, or a list of ``num_layers`` numbers, the cost of each
            global layer on that stage (models whose layers differ: dense and MoE layers).
        extra_cost: per stage, seconds of its work besides the layers (embedding on the first
            stage; final norm, LM head and sampling on the last), same micro-batch.

    Among the splits with the smallest maximum, the one closest to the even split
    (:func:`even_sizes`, by the sum of absolute differences) is returned, so equal costs give the
    even split. Dynamic programming over (stage, layers so far): O(stages x layers^2).

    Raises:
        ConfigError: more stages than layers, cost lists of a length other than the stages', or a
            per-layer list of a length other than ``num_layers``.
    """
    pp = len(layer_cost)
    if len(extra_cost) != pp or pp < 1:
        raise ConfigError(f"{pp} layer costs and {len(extra_cost)} extra costs for a pipeline")
    if pp > num_layers:
        raise ConfigError(f"--pipeline-parallel-size {pp} is larger than the model's {num_layers} layers")
    inf = float("inf")
    prefixes = [_prefix(c, num_layers) for c in layer_cost]

    def time(s: int, k: int, n: int) -> float:
        """Stage ``s`` holding the ``n`` layers that end at layer ``k`` (exclusive)."""
        return _range_cost(layer_cost[s], k - n, k, prefixes[s]) + extra_cost[s]

    # best[s][k]: smallest slowest-stage time over stages 0..s holding the first k layers.
    best = [[inf] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        best[0][k] = time(0, k, k)
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            best[s][k] = min(max(best[s - 1][k - n], time(s, k, n)) for n in range(1, k - s + 1))
    limit = best[pp - 1][num_layers]
    limit += 1e-9 * abs(limit)  # float slack: splits at the optimum must pass the test below
    # Among splits whose every stage is within the optimum, the one closest to the even split.
    even = even_sizes(num_layers, pp)
    dev = [[inf] * (num_layers + 1) for _ in range(pp)]
    choice = [[0] * (num_layers + 1) for _ in range(pp)]
    for k in range(1, num_layers - pp + 2):
        if time(0, k, k) <= limit:
            dev[0][k], choice[0][k] = abs(k - even[0]), k
    for s in range(1, pp):
        for k in range(s + 1, num_layers - (pp - 1 - s) + 1):
            for n in range(1, k - s + 1):
                if time(s, k, n) <= limit and dev[s - 1][k - n] + abs(n - even[s]) < dev[s][k]:
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
