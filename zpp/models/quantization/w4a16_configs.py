"""Launch configurations of the W4A16 kernels (:mod:`zpp.models.quantization.w4a16_kernels`): the
batch-size thresholds between GEMV and GEMM, the measured per-shape tables (as vLLM's
``fused_moe/configs/*.json``) and the functions that pick a launch from them. Measured on one
H100 80GB HBM3 with ``python scripts/kernel_bench.py w4a16`` and ``w4a16-gemv`` (raw output:
benchmarks/results/h100_issue48_w4a16/, h100_2026-12-07_w4gemv/)."""
from __future__ import annotations

from zpp.models.layers.fused_moe import bucket_config

W4A16_GEMV_MAX_M = 4
"""Batches of at most this many rows take :func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemv`; larger ones :func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemm`."""

W4_MOE_GEMV_MAX_ASSIGNMENTS = 16
"""Default: MoE batches of at most this many token-assignments (``T * k``) take the per-assignment
GEMV (each assignment re-reads its expert's rows, so past a few per expert the sorted GEMM reads less)."""


def w4a16_gemm_config(M: int, N: int, K: int) -> dict:
    """Tile sizes of :func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemm` by batch size (measured on one H100 with
    ``scripts/kernel_bench.py w4a16``; :data:`W4A16_CONFIGS` holds per-shape overrides)."""
    measured = bucket_config(W4A16_CONFIGS.get(f"N={N},K={K}", {}).get("gemm"), M)
    if measured is not None:
        return measured
    if M <= 16:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def w4a16_gemv_config(N: int, K: int, fmt: str = "int4", M: int = 1, zeros: bool = False) -> dict:
    """Launch of :func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemv` for an ``[N, K]`` weight
    in ``fmt`` (``zeros``: int4 with zero points) and ``M`` rows: :data:`W4A16_CONFIGS`
    (``gemv_int4zp`` / ``gemv_<fmt>``, else ``gemv``), else :data:`W4A16_GEMV_DEFAULT`. For ``M > 1``
    the word-wise kernel takes one word a thread and at most 16 (``M = 2``) / 8 rows a block, no
    prefetch: its accumulators are ``M x`` the registers (measured: the four-words-a-thread layout at
    ``M = 4`` took 2-3.5x the one-word one on the same shape, other kinds, same call)."""
    entry = W4A16_CONFIGS.get(f"N={N},K={K}", {})
    key = "gemv_int4zp" if fmt == "int4" and zeros else f"gemv_{fmt}"
    cfg = dict(entry.get(key) or entry.get(f"gemv_{fmt}") or entry.get("gemv") or W4A16_GEMV_DEFAULT)
    if M > 1 and cfg.get("words"):
        cfg.update(block_n=min(cfg["block_n"], 16 if M == 2 else 8), vec=False, prefetch=False)
    return cfg


W4A16_GEMV_DEFAULT = dict(words=True, block_n=8, block_k=1024, num_warps=4, num_stages=1)
"""The GEMV launch of shapes :data:`W4A16_CONFIGS` does not list: the word-wise kernel
(:mod:`~zpp.models.quantization.w4a16_gemv`), 8 rows x 1024 codes a step, one word a thread: within
10% of the fastest launch on every Llama-3-70B shape and kind on the H100 but int4 ``down`` with
zero points (15%) (benchmarks/results/h100_2026-12-07_w4gemv/)."""

_W = dict(words=True, num_stages=1, num_warps=4, block_k=1024)
W4A16_CONFIGS: dict[str, dict] = {
    # Llama-3-70B layer shapes (qkv, o, gate_up, down): the fastest word-wise launches at M = 1 on one
    # H100 in CUDA graphs, two calls agreeing within 3% (python scripts/kernel_bench.py w4a16-gemv):
    # int4 (group 128 and 32 pick the same), int4 with zero points, mxfp4
    "N=10240,K=8192": dict(gemv=dict(_W, block_n=8)),
    "N=8192,K=8192": dict(gemv=dict(_W, block_n=16), gemv_int4zp=dict(_W, block_n=32, vec=True, prefetch=True),
                          gemv_mxfp4=dict(_W, block_n=8)),
    "N=57344,K=8192": dict(gemv=dict(_W, block_n=32, vec=True), gemv_int4zp=dict(_W, block_n=8),
                           gemv_mxfp4=dict(_W, block_n=8)),
    "N=8192,K=28672": dict(gemv=dict(_W, block_n=16), gemv_int4zp=dict(_W, block_n=32, vec=True, prefetch=True),
                           gemv_mxfp4=dict(_W, block_n=8, block_k=2048, num_warps=8, prefetch=True)),
}
"""Measured launches per weight shape ``"N=..,K=.."``: ``gemv`` / ``gemv_<fmt>`` / ``gemv_int4zp``
(a :func:`~zpp.models.quantization.w4a16_kernels.w4a16_gemv` launch), ``gemm`` (``{max M: tiles}``,
the first bucket ``>= M`` wins). Measured on one H100 80GB HBM3 (raw output:
benchmarks/results/h100_2026-12-07_w4gemv/ for the GEMV, h100_issue48_w4a16/ for the GEMM, whose
defaults (:func:`w4a16_gemm_config`) were the fastest of the sweep for every shape there)."""

W4A16_GEMV_BYTEWISE: dict[str, dict] = {
    # the byte-wise GEMV's fastest launches (h100_issue48_w4a16/), the baseline of kernel_bench.py w4a16-gemv
    "N=10240,K=8192": dict(block_n=16, block_k=512, num_warps=4, num_stages=3, x_split=True),
    "N=8192,K=8192": dict(block_n=16, block_k=1024, num_warps=8, num_stages=3, x_split=False),
    "N=57344,K=8192": dict(block_n=32, block_k=512, num_warps=4, num_stages=3, x_split=True),
    "N=8192,K=28672": dict(block_n=16, block_k=1024, num_warps=8, num_stages=3, x_split=False),
}
"""The byte-wise kernel's launches (``words=False``) per shape, measured before the word-wise one."""


W4_MOE_GEMV_DEFAULT = dict(block_n=4, block_k=512, num_warps=4, num_stages=3)

_MOE_SMALL = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
W4_MOE_CONFIGS: dict[str, dict] = {
    # gpt-oss-20b (32 experts) / -120b (128 experts) expert shapes, mxfp4 group 32, one H100: the GEMV
    # launch fastest at T = 1, the GEMM tiles fastest of 7 at T = 256 (M = 1024), 16-row tiles below
    # (the default there, measured in the whole feed-forward at T = 8 .. 64)
    "E=32,N=5760,K=2880": dict(gemv=dict(block_n=8, block_k=512, num_warps=4),
                               gemm={256: _MOE_SMALL, 4096: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                                                  num_stages=3)}),
    "E=32,N=2880,K=2880": dict(gemv=dict(block_n=4, block_k=1024, num_warps=4),
                               gemm={256: _MOE_SMALL, 4096: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8,
                                                                  num_stages=3)}),
    "E=128,N=5760,K=2880": dict(gemv=dict(block_n=8, block_k=512, num_warps=4),
                                gemm={4096: dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)}),
    "E=128,N=2880,K=2880": dict(gemv=dict(block_n=4, block_k=1024, num_warps=4),
                                gemm={4096: _MOE_SMALL}),
}
"""Measured MoE launches per expert-GEMM shape ``"E=..,N=..,K=.."``: ``gemv_max``, ``gemv``,
``gemm`` (``{max M: tiles}``), as :data:`zpp.models.quantization.fp8_moe_kernels.FP8_MOE_CONFIGS`."""


def w4_moe_gemm_config(M: int, E: int, N: int, K: int) -> dict:
    """Tiles of :func:`~zpp.models.quantization.w4a16_kernels.moe_w4a16_gemm` for ``M`` assignments (measured bucket, else by rows per expert)."""
    measured = bucket_config(W4_MOE_CONFIGS.get(f"E={E},N={N},K={K}", {}).get("gemm"), M)
    if measured is not None:
        return measured
    per_expert = M / max(1, E)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if per_expert <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def w4_moe_gemv_config(E: int, N: int, K: int) -> dict:
    entry = W4_MOE_CONFIGS.get(f"E={E},N={N},K={K}")
    return dict(entry["gemv"]) if entry and "gemv" in entry else dict(W4_MOE_GEMV_DEFAULT)


def use_w4_moe_gemv(M: int, E: int, N: int, K: int) -> bool:
    """Whether ``M`` token-assignments of an ``[E, N, K]`` 4-bit expert weight take the GEMV."""
    entry = W4_MOE_CONFIGS.get(f"E={E},N={N},K={K}")
    limit = entry["gemv_max"] if entry and "gemv_max" in entry else W4_MOE_GEMV_MAX_ASSIGNMENTS
    return 0 < M <= limit
