"""Writers of 4-bit test checkpoints (the tests' own quantizers, independent of zpp's loader): an HF
checkpoint's weights quantized into a release's exact layout (tensor names, dtypes, shapes,
``quantization_config``), next to a copy with those weights dequantized back by the format's own
library where one exists -- the reference HF transformers loads.

Formats:
    ``mxfp4``: gpt-oss's experts (``*_blocks`` / ``*_scales``), dequantized by transformers'
        ``convert_moe_packed_tensors``.
    ``ct-int4``: compressed-tensors ``pack-quantized`` (``weight_packed`` / ``weight_scale`` /
        ``weight_shape`` [/ ``weight_zero_point``]), packed and dequantized by ``compressed_tensors``.
    ``gptq``: AutoGPTQ's v1 layout (``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``), dequantized by
        :func:`gptq_reference` (AutoGPTQ's rule, loop by loop).
    ``awq``: AutoAWQ GEMM (``qweight`` / ``qzeros`` / ``scales``), dequantized by :func:`awq_reference`.
Tensors that stay in high precision keep the source's dtype (float32: the HF reference runs in float32).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]

GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""``modules_to_not_convert`` of openai/gpt-oss-20b's config.json."""
KIMI_K2_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
"""``ignore`` of moonshotai/Kimi-K2-Thinking's quantization_config: only the routed experts are int4."""


# --- quantizers ------------------------------------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (blocks uint8 ``[..., N, K/32, 16]``, scales uint8 ``[..., N, K/32]``):
    per block of 32 the exponent ``e = ceil(log2(amax / 6))``, codes the nearest e2m1 of ``w / 2^e``."""
    *lead, n, k = w.shape
    g = w.float().reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -120)
    e = torch.ceil(torch.log2(amax / 6.0))
    x = g / torch.exp2(e)
    mag = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)               # nearest magnitude
    codes = (mag | ((x < 0).to(torch.int64) << 3)).to(torch.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()  # [..., N, K/32, 16]
    return blocks, (e.squeeze(-1) + 127).to(torch.uint8)


def quantize_int4(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (q int in ``[0, 15]`` ``[N, K]``, scale ``[N, K/G]`` float32, zero int
    ``[N, K/G]``): symmetric ``scale = amax / 7.5``-ish with zero 8; asymmetric min/max with a zero in
    ``[1, 15]`` (never 0: GPTQ v1 cannot store it)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    if symmetric:
        s = (g.abs().amax(-1) / 7.0).clamp_min(1e-8)
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15.0).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp(1, 15)
    s = s.to(torch.float16).float()  # the checkpoints store fp16 / bf16 scales: quantize with what is stored
    q = torch.round(g / s.unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, 15)
    return q.reshape(n, k).to(torch.int64), s, z.to(torch.int64)


def pack_along(codes: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """int codes 0..15 -> int32 with 8 a word along ``dim``, value ``i`` (or ``order[i]``) at bits 4i."""
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, 8)
    if order is not None:
        c = c[..., order]
    words = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for i in range(8):
        words |= c[..., i].to(torch.int64) << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


# --- the references (the formats' own rules) -------------------------------------------------------
def gptq_reference(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """AutoGPTQ's ``QuantLinear`` dequantization (``qlinear_cuda_old``), v1: weight ``[K, N]`` =
    ``scales[g_idx] * (((qweight >> shifts) & 15) - (((qzeros >> shifts) & 15) + 1))``; returned as
    ``[N, K]`` float32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> shifts.view(1, 1, -1)) & 15              # [G, N/8, 8]
    zeros = zeros.reshape(qzeros.shape[0], -1) + 1                            # [G, N]
    w = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & 15                  # [K/8, 8, N]
    w = w.reshape(-1, qweight.shape[1])                                       # [K, N]
    out = scales.float()[g_idx.long()] * (w - zeros[g_idx.long()]).float()
    return out.t().contiguous()


def awq_reference(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """AutoAWQ's ``dequantize_gemm`` (``unpack_awq`` + ``reverse_awq_order``): ``(q - z) * s``,
    returned as ``[N, K]`` float32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    rev = [0, 4, 1, 5, 2, 6, 3, 7]

    def unpack(t):
        x = (t.unsqueeze(-1) >> shifts) & 15                                  # [R, N/8, 8] nibble order
        return x[..., rev].reshape(t.shape[0], -1)                            # column order
    iw, iz = unpack(qweight), unpack(qzeros)
    z = iz.repeat_interleave(group, dim=0)
    s = scales.float().repeat_interleave(group, dim=0)
    return ((iw - z).float() * s).t().contiguous()


# --- checkpoint writers ----------------------------------------------------------------------------
def _load(src: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _write(src: str, dst: str, tensors: dict, quant: dict | None) -> None:
    from safetensors.torch import save_file
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.pop("quantization_config", None)
    if quant is not None:
        cfg["quantization_config"] = quant
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})


_LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def write_w4_checkpoint(src: str, dst: str, fmt: str, dequantized_dst: str, group: int = 128,
                        symmetric: bool = True) -> list[str]:
    """Write ``src`` (an HF float32 checkpoint) in ``fmt`` to ``dst`` and its dequantized twin to
    ``dequantized_dst``; returns the names of the weights quantized."""
    t = _load(src)
    out, deq, done = {}, {}, []
    for name, w in t.items():
        if fmt == "mxfp4" and re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            blocks, scales = quantize_mxfp4(w.transpose(1, 2))              # [E, N, K] rows as released
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            deq[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            done.append(name)
        elif fmt == "ct-int4" and _ROUTED.search(name):
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            from compressed_tensors.quantization import QuantizationArgs
            from compressed_tensors.quantization.lifecycle.forward import dequantize
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
            q, s, z = quantize_int4(w, group, symmetric)
            base = name[: -len(".weight")]
            out[base + ".weight_packed"] = pack_to_int32((q - 8).to(torch.int8), 4)
            out[base + ".weight_scale"] = s.to(torch.bfloat16)
            out[base + ".weight_shape"] = torch.tensor(w.shape)
            zp = None
            if not symmetric:
                zp = (z - 8).to(torch.int8)
                out[base + ".weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
            args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
            unpacked = unpack_from_int32(out[base + ".weight_packed"], 4, w.shape)
            deq[name] = dequantize(unpacked, out[base + ".weight_scale"].float(), zp, args).float()
            done.append(name)
        elif fmt in ("gptq", "awq") and _LINEAR.search(name):
            q, s, z = quantize_int4(w, group, symmetric)                      # [N, K], [N, K/G]
            base = name[: -len(".weight")]
            if fmt == "gptq":
                out[base + ".qweight"] = pack_along(q.t(), 0)                 # [K/8, N]
                out[base + ".qzeros"] = pack_along((z - 1).t(), 1)            # [K/G, N/8], v1: zero - 1
                out[base + ".scales"] = s.t().to(torch.float16)               # [K/G, N]
                out[base + ".g_idx"] = (torch.arange(w.shape[1]) // group).to(torch.int32)
                deq[name] = gptq_reference(out[base + ".qweight"], out[base + ".qzeros"], out[base + ".scales"],
                                           out[base + ".g_idx"])
            else:
                out[base + ".qweight"] = pack_along(q.t(), 1, AWQ_ORDER)      # [K, N/8]
                out[base + ".qzeros"] = pack_along(z.t(), 1, AWQ_ORDER)       # [K/G, N/8]
                out[base + ".scales"] = s.t().to(torch.float16)
                deq[name] = awq_reference(out[base + ".qweight"], out[base + ".qzeros"], out[base + ".scales"], group)
            done.append(name)
        else:
            out[name] = deq[name] = w
    quant = {
        "mxfp4": lambda: {"modules_to_not_convert": GPT_OSS_NOT_CONVERTED, "quant_method": "mxfp4"},
        "ct-int4": lambda: {
            "config_groups": {"group_0": {
                "input_activations": None, "output_activations": None, "targets": ["Linear"],
                "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group,
                            "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                            "symmetric": symmetric, "type": "int"}}},
            "format": "pack-quantized", "ignore": KIMI_K2_THINKING_IGNORE, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed"},
        "gptq": lambda: {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False,
                         "group_size": group, "model_file_base_name": None, "model_name_or_path": None,
                         "quant_method": "gptq", "static_groups": False, "sym": symmetric, "true_sequential": True},
        "awq": lambda: {"bits": 4, "group_size": group, "modules_to_not_convert": None, "quant_method": "awq",
                        "version": "gemm", "zero_point": True},
    }[fmt]()
    _write(src, dst, out, quant)
    _write(src, dequantized_dst, deq, None)
    return done
