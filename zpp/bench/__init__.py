"""Benchmarks (like vLLM's ``benchmarks/``): ``zpp bench throughput | latency | serve``.

Each prints a final table and can write ``--output-json`` (helpers in ``zpp.bench.common``).
"""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bsub = p.add_subparsers(dest="bench", required=True)
    from zpp.bench import latency, serve, throughput
    throughput.add_parser(bsub)
    latency.add_parser(bsub)
    serve.add_parser(bsub)
