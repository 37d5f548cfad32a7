"""Which global ranks run on which host of a multi-host run (shared by the head and the nodes).

Ranks are contiguous blocks in host order: the head (host 0) first, then each node. A host may pin
its number of ranks (``--nodes user@host:N``); the others share the rest as evenly as possible,
earlier hosts taking one more. Rank ``r`` is stage ``r // tensor_parallel_size``, so whole stages
land on one host whenever the counts are multiples of the TP size. Every ``zpp serve --node-rank R``
of a per-node launch computes the same split from the same flags, so nothing needs to be sent.
"""
from __future__ import annotations

from typing import Optional, Sequence

from zpp.errors import ConfigError


def split_ranks(world: int, pins: Sequence[Optional[int]]) -> list[list[int]]:
    """Global ranks per host.

    Args:
        world: number of ranks (pipeline stages x tensor-parallel size).
        pins: one entry per host, head first: N ranks pinned there, or None (an even share).
    Returns:
        ``len(pins)`` lists of consecutive ranks covering ``range(world)``.
    Raises:
        ConfigError: the pinned counts exceed ``world``.
    """
    pinned = sum(n or 0 for n in pins)
    free_hosts = sum(1 for n in pins if n is None)
    rest = world - pinned
    if rest < 0:
        raise ConfigError(f"--nodes pins {pinned} ranks but only {world} exist")
    base, extra = divmod(rest, free_hosts) if free_hosts else (0, 0)
    counts, k = [], 0
    for pin in pins:
        if pin is None:
            counts.append(base + (1 if k < extra else 0))
            k += 1
        else:
            counts.append(pin)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def describe_stages(ranks: Sequence[int], tp_size: int) -> str:
    """``stage 1`` / ``stages 1, 2`` for the ranks of one host."""
    stages = sorted({r // tp_size for r in ranks})
    return f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))}"
