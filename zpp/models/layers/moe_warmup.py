"""Start-up warm-up of the MoE kernels: every Triton variant a batch of up to
``--max-num-batched-tokens`` tokens can launch, built before serving.

The memory profile runs one token count (the largest micro-batch) and the decode graphs the
captured batch sizes, but the expert GEMMs pick their tiles by the number of token-assignments
``M = T * k`` (:func:`zpp.models.quantization.fp8_moe_kernels.fp8_moe_config` /
:func:`~zpp.models.quantization.fp8_moe_kernels.use_fp8_moe_gemv` for FP8 experts,
:func:`zpp.models.layers.fused_moe.moe_block_config` for bf16), and Triton compiles one variant per
launch configuration and per class of the integer ``M`` it is given (1, a multiple of 16, other).
Eager prefill batches of other sizes then compiled a variant mid-serving
(:mod:`zpp.utils.late_compiles` logged ``_moe_gemm_kernel`` / ``_moe_fp8_gemm_kernel`` "while
serving" in the H100 throughput runs, the batch waiting for it). :func:`warmup_token_counts` lists one
token count per distinct variant set; :func:`warm_up_moe` runs each
:class:`~zpp.models.layers.moe.FusedExperts` shape once at each of them (random routing, no
attention, no KV cache).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _int_class(n: int) -> int:
    """How Triton specialises an integer argument: 1, divisible by 16, or neither (0)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def _cfg_key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def moe_variant(experts: nn.Module, num_tokens: int, top_k: int) -> tuple:
    """A key naming the Triton variants a forward of ``num_tokens`` tokens through ``experts``
    (top-``top_k`` routing) launches: the path and its tile configurations (as the forward picks
    them) and the class of ``M = num_tokens * top_k``; two token counts with one key compile
    nothing new for each other."""
    from zpp.models.layers.fused_moe import moe_block_config
    M = num_tokens * top_k
    method = experts.quant_method
    if hasattr(method, "variant"):  # a method that names its own variants (W4A16)
        return method.variant(experts, M)
    E, I2, H = experts.gate_up_proj.shape
    block = getattr(method, "block", None)
    if method is not None and experts.gate_up_proj.dtype == torch.float8_e4m3fn:
        from zpp.models.quantization.fp8_moe_kernels import fp8_moe_config, use_fp8_moe_gemv
        if use_fp8_moe_gemv(M, E, I2, H, block):
            return ("fp8-gemv",)  # the GEMV kernels take no M: one variant for every such size
        c1, c2 = fp8_moe_config(M, E, I2, H, block), fp8_moe_config(M, E, H, I2 // 2, block)
        c2 = dict(c2, BLOCK_M=c1["BLOCK_M"])
        return ("fp8-gemm", _cfg_key(c1), _cfg_key(c2), _int_class(M))
    return ("gemm", _cfg_key(moe_block_config(M, E)), _int_class(M))


def warmup_token_counts(experts: nn.Module, top_k: int, max_tokens: int) -> list[int]:
    """The smallest token count ``T <= max_tokens`` of every distinct :func:`moe_variant`, ascending."""
    seen: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        seen.setdefault(moe_variant(experts, t, top_k), t)
    return sorted(seen.values())


def _shape_key(ex: nn.Module) -> tuple:
    """Experts with one key run the same kernel variants (weights, scales, bias, activation alike)."""
    method = ex.quant_method
    w_gu = ex.gate_up_proj if ex.gate_up_proj is not None else getattr(ex, "gate_up_proj_qweight", None)
    w_dn = ex.down_proj if ex.down_proj is not None else getattr(ex, "down_proj_qweight", None)
    parts = [type(method).__name__, getattr(method, "block", None), getattr(method, "fmt", None),
             getattr(method, "group_size", None), w_gu.dtype, tuple(w_gu.shape), tuple(w_dn.shape),
             ex.gate_up_proj_bias is not None,
             ex._down_bias is not None, repr(getattr(ex.act, "triton_kind", ex.act))]
    for name in ("gate_up_proj_scale", "down_proj_scale", "gate_up_proj_scales", "down_proj_scales"):
        s = getattr(ex, name, None)
        parts.append(None if s is None else (tuple(s.shape), s.stride()))
    return tuple(parts)


@torch.inference_mode()
def warm_up_moe(model: nn.Module, top_k: Optional[int], max_tokens: int, device: torch.device,
                dtype: torch.dtype) -> int:
    """Run every distinct :class:`~zpp.models.layers.moe.FusedExperts` shape of ``model`` once at each
    of its :func:`warmup_token_counts` (``top_k`` experts a token, up to ``max_tokens`` tokens),
    random inputs and routing on ``device``. Returns the number of forwards run (0: no experts, or
    ``top_k`` None). Any device: on the CPU it runs the PyTorch path (tests)."""
    from zpp.models.layers.moe import FusedExperts
    if not top_k:
        return 0
    groups: dict[tuple, nn.Module] = {}
    for mod in model.modules():
        if isinstance(mod, FusedExperts):
            groups.setdefault(_shape_key(mod), mod)
    t0, runs = time.perf_counter(), 0
    gen = torch.Generator(device="cpu").manual_seed(0)
    for ex in groups.values():
        E, H = ex.num_experts, ex.hidden_size
        k = min(top_k, E)
        counts = warmup_token_counts(ex, k, max_tokens)
        x_all = (torch.randn(counts[-1], H, generator=gen) * 0.1).to(device=device, dtype=dtype)
        for t in counts:
            ids = torch.rand(t, E, generator=gen).argsort(dim=1)[:, :k].to(device)   # k distinct experts a token
            w = torch.full((t, k), 1.0 / k, dtype=torch.float32, device=device)
            ex(x_all[:t], w, ids, reduce=False)
            runs += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if runs:
        logger.info("MoE kernels warmed up: %d expert shape(s), %d token counts (up to %d) in %.1fs",
                    len(groups), runs, max_tokens, time.perf_counter() - t0)
    return runs
