"""What the benchmarks share: argparse types checked before any load, the result table, random prompts, the run's fields, the JSON file."""
from __future__ import annotations

import argparse


def positive_int(value: str) -> int:
    """argparse type: an integer >= 1 (a bad value is one ``zpp: error:`` line before any load)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return n


def non_negative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 0")
    return n


def positive_float(value: str) -> float:
    """argparse type: a number > 0 (``inf`` allowed)."""
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number > 0 (inf: no limit)")
    return x


def fraction(value: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number in [0, 1)")
    return x


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in rows) + 2
    print(f"{'=' * 20} {title} {'=' * 20}")
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:.2f}" if abs(v) >= 0.01 or v == 0 else f"{v:.3g}"
        print(f"{k + ':':<{width}} {v}")
    print("=" * (42 + len(title)))


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` random token-id prompts of ``input_len`` tokens (ids drawn from [100, vocab - 100))."""
    import random
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num)]


def run_fields(config) -> dict:
    """What every benchmark's JSON records about the run: model, device, dtype, split, date."""
    import datetime
    return {"model": config.model.model, "device": config.parallel.device,
            "dtype": str(config.torch_dtype).removeprefix("torch."),
            "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "async_scheduling": config.async_scheduling,
            "date": datetime.date.today().isoformat()}


def write_json(path: str | None, data: dict) -> None:
    if path:
        import json
        import os
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
