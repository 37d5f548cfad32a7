"""A writer of FP8 test checkpoints (the tests' own, independent of zpp's loader): an HF checkpoint's
linear-layer weights quantized to float8_e4m3fn in one of the layouts zpp loads, next to a copy of
the same model with those FP8 weights dequantized back (the reference HF transformers loads where it
cannot load the FP8 layout itself).

Layouts:
    ``ct-channel``: compressed-tensors ``float-quantized``, per-output-channel ``weight_scale [N, 1]``,
        dynamic per-token input activations, ``ignore: [lm_head]`` (llm-compressor's FP8_DYNAMIC).
    ``ct-tensor``: compressed-tensors, per-tensor ``weight_scale [1]`` and static per-tensor
        ``input_scale [1]`` (llm-compressor's FP8 scheme).
    ``block``: ``quant_method: fp8``, ``weight_block_size: [bn, bk]``, ``weight_scale_inv
        [ceil(N/bn), ceil(K/bk)]``, dynamic activations (DeepSeek-V3 / Qwen3-FP8).
Optional ``kv_scales``: per-layer ``self_attn.k_scale`` / ``v_scale`` (compressed-tensors'
``kv_cache_scheme``); ``high_precision``: the dtype of every tensor left unquantized (the releases:
bf16 embeddings, norms, routers, lm_head; DeepSeek's ``e_score_correction_bias`` stays float32);
``ignore``: compressed-tensors' list of layers left unquantized (the MoE releases add their routers,
``re:.*mlp.gate$``); ``fused_experts``: each layer's experts stacked into HF transformers 5's fused
names (``mlp.experts.gate_up_proj [E, 2I, H]`` + ``gate_up_proj_scale_inv``, ``down_proj`` +
``down_proj_scale_inv``; block layout, ``gate_proj`` / ``up_proj`` / ``down_proj`` experts).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil

import torch

FP8 = torch.float8_e4m3fn
_QUANTIZED = re.compile(r"\.layers\.\d+\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3|"
                        r"q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$")


def _amax_scale(t: torch.Tensor) -> torch.Tensor:
    s = t.abs().amax() / 448.0
    return s if s > 0 else torch.ones(())


def quantize(w: torch.Tensor, layout: str, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (fp8 weight, scale as stored, dequantized float32 weight). Plain loops, no vectorised tricks."""
    w = w.float()
    N, K = w.shape
    if layout == "ct-tensor":
        s = _amax_scale(w)
        q = (w / s).clamp(-448, 448).to(FP8)
        return q, s.reshape(1), q.float() * s
    if layout == "ct-channel":
        s = w.abs().amax(1, keepdim=True) / 448.0                          # [N, 1]
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (w / s).clamp(-448, 448).to(FP8)
        return q, s, q.float() * s
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    q = torch.empty(N, K, dtype=FP8)
    s = torch.empty(nb, kb)
    deq = torch.empty(N, K)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = _amax_scale(tile)
            qt = (tile / s[i, j]).clamp(-448, 448).to(FP8)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt.float() * s[i, j]
    return q, s, deq


_KEEP_FP32 = re.compile(r"e_score_correction_bias$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def _fuse_experts(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert FP8 weights and block scales -> HF 5's fused names (gate rows, then up rows, per expert)."""
    found: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
    rest = {}
    for name, t in out.items():
        m = _EXPERT.match(name)
        if m:
            found.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3), m.group(4))] = t
        else:
            rest[name] = t
    for prefix, parts in found.items():
        n = 1 + max(e for e, _, _ in parts)
        for kind, suffix in (("weight", ""), ("weight_scale_inv", "_scale_inv")):
            rest[f"{prefix}.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj", kind)], parts[(e, "up_proj", kind)]]) for e in range(n)])
            rest[f"{prefix}.down_proj{suffix}"] = torch.stack([parts[(e, "down_proj", kind)] for e in range(n)])
    return rest


def _ct_config(layout: str, kv_scales: bool, ignore=("lm_head",)) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if layout == "ct-channel" else "tensor", "group_size": None,
               "block_structure": None, "observer": "minmax"}
    if layout == "ct-channel":
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                "group_size": None, "block_structure": None, "observer": None}
    else:
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor",
                "group_size": None, "block_structure": None, "observer": "minmax"}
    cfg = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                         "output_activations": None}},
           "ignore": list(ignore), "kv_cache_scheme": None}
    if kv_scales:
        cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                  "strategy": "tensor", "group_size": None, "block_structure": None,
                                  "observer": "minmax"}
    return cfg


def write_fp8_checkpoint(src: str, dst: str, layout: str, block=(128, 128), dequantized_dst: str | None = None,
                         kv_scales: bool = False, drop: tuple[str, ...] = (),
                         high_precision: torch.dtype | None = None, ignore: tuple[str, ...] = ("lm_head",),
                         fused_experts: bool = False) -> list[str]:
    """Write ``src`` (an HF checkpoint dir) to ``dst`` with its decoder linear weights in FP8
    (``layout``); with ``dequantized_dst`` also the same model, every FP8 weight dequantized to
    float32 (the others: their values in ``dst``, as float32), unquantized config. ``drop``: tensor
    names left out of ``dst`` (tests of missing tensors). Returns the names of the FP8 weights
    (per-expert names, also with ``fused_experts``)."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(load_file(path))
    out, deq, names = {}, {}, []
    for name, t in tensors.items():
        if _QUANTIZED.search(name) and t.dim() == 2:
            q, s, d = quantize(t, layout, block)
            base = name[: -len(".weight")]
            out[name] = q
            out[base + (".weight_scale_inv" if layout == "block" else ".weight_scale")] = s
            if layout == "ct-tensor":
                out[base + ".input_scale"] = torch.tensor([0.02 + 0.001 * (len(names) % 7)])
            deq[name] = d
            names.append(name)
        else:
            if high_precision is not None and t.is_floating_point() and not _KEEP_FP32.search(name):
                t = t.to(high_precision)
            out[name] = t
            deq[name] = t.float() if t.is_floating_point() else t
    if kv_scales:
        layers = sorted({int(m.group(1)) for n in tensors for m in [re.search(r"\.layers\.(\d+)\.", n)] if m})
        for i in layers:
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + 0.01 * i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03 + 0.01 * i)
    if fused_experts:
        if layout != "block":
            raise ValueError("fused_experts: block layout only")
        out = _fuse_experts(out)
    for n in drop:
        out.pop(n)
    # Two shards, the scales of the first few weights in the second one (a scale need not sit next to its weight).
    keys = sorted(out)
    first = {k: out[k].contiguous() for k in keys[: len(keys) // 2]}
    second = {k: out[k].contiguous() for k in keys[len(keys) // 2:]}
    save_file(first, os.path.join(dst, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, os.path.join(dst, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "config.json" and f != "model.safetensors.index.json":
            p = os.path.join(src, f)
            if os.path.isfile(p):
                shutil.copy(p, dst)
                if dequantized_dst:
                    os.makedirs(dequantized_dst, exist_ok=True)
                    shutil.copy(p, dequantized_dst)
    if dequantized_dst:
        os.makedirs(dequantized_dst, exist_ok=True)
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(dequantized_dst, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(dequantized_dst, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    if layout == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    else:
        cfg["quantization_config"] = _ct_config(layout, kv_scales, ignore)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return names
