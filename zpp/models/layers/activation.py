"""Activations and the gated MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zpp.models.layers.linear import MergedLinear, RowParallelLinear

_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def check_activation(cfg: dict, key: str, default: str) -> None:
    """Raise ConfigError if the config's activation (``cfg[key]``, else ``default``) is unknown."""
    from zpp.errors import ConfigError
    name = cfg.get(key, default)
    if name not in _ACTS:
        raise ConfigError(f"{key} {name!r} is not supported (supported: {', '.join(sorted(_ACTS))})")


def get_activation(name: str):
    """Activation by HF config name. Raises KeyError (caught by the registry) if unknown."""
    return _ACTS[name]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up merged into one matmul (LLaMA/Qwen2/Mistral).

    ``x: [T, hidden]`` -> ``[T, hidden]``.

    Tensor parallel (``tp_size > 1``, Megatron-LM's MLP split): ``gate_up_proj`` is column-parallel
    (each rank holds ``intermediate_size / tp_size`` rows of gate and of up) and ``down_proj``
    row-parallel, so the activation runs on the rank's slice and one all-reduce (inside
    ``down_proj``) completes the output. Raises ValueError if ``intermediate_size % tp_size``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                         tp_rank=tp_rank, tp_size=tp_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_rank=tp_rank,
                                           tp_size=tp_size)
        self.act = get_activation(act)
        self.intermediate_size = intermediate_size // tp_size  # this rank's share

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """``reduce=False`` (``tp_size > 1``): this rank's partial sum, no all-reduce (see
        :meth:`RowParallelLinear.forward`), for a caller that adds other partials first."""
        return self.forward_gate_up(self.gate_up_proj(x), reduce)

    def forward_gate_up(self, gate_up: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """:meth:`forward` from ``gate_up_proj``'s output ``[T, 2 * intermediate]`` (this rank's gate |
        up), for a caller that computed that product itself (the decoder layer's RMSNorm fused into
        it, :func:`zpp.models.quantization.fp8_linear.rms_norm_fp8_linear`)."""
        if gate_up.is_cuda and self.act is F.silu:
            from zpp.models.quantization.fp8_linear import fuses_input_quant
            if fuses_input_quant(self.down_proj.fp8, gate_up.shape[0], gate_up):
                from zpp.models.quantization import fp8_kernels as K
                if self.intermediate_size <= K.SILU_MUL_QUANT_MAX_N:  # SiLU, mul and FP8 quantization at once
                    xq, xs = K.silu_mul_quant(gate_up)
                    return self.down_proj.forward_fp8_input(xq, xs, gate_up.dtype, reduce)
            from zpp.models.layers.triton_ops import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up), reduce)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up, reduce)
