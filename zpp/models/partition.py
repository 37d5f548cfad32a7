"""Split a model's decoder layers into pipeline stages."""
from __future__ import annotations

from typing import Optional, Sequence

from zpp.config import ConfigError


def partition_layers(num_layers: int, pp_size: int,
                     partition: Optional[Sequence[int]] = None) -> list[tuple[int, int]]:
    """Return the ``[start, end)`` layer range of each stage.

    Without ``partition`` the layers are split as evenly as possible, the remainder going to the
    earliest stages (30 layers on 4 stages: 8/8/7/7). The last stage also runs the final norm,
    the LM head and the sampler, so giving it the smaller share keeps the pipeline balanced.

    Raises:
        ConfigError: more stages than layers, or a partition with the wrong length, a stage with
            no layers, or a sum different from ``num_layers``.
    """
    if pp_size > num_layers:
        raise ConfigError(
            f"--pipeline-parallel-size {pp_size} is larger than the model's {num_layers} layers")
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        sizes = [base + (1 if i < extra else 0) for i in range(pp_size)]
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


def parse_partition(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """Parse ``"10,10,5,5"``. Raises ConfigError on anything but comma-separated integers."""
    if text is None or text == "":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-layer-partition {text!r} must be comma-separated integers, e.g. 10,10,5,5") from None
