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
``kv_cache_scheme``).
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


def _ct_config(layout: str, kv_scales: bool) -> dict:
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
           "ignore": ["lm_head"], "kv_cache_scheme": None}
    if kv_scales:
        cfg["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                  "strategy": "tensor", "group_size": None, "block_structure": None,
                                  "observer": "minmax"}
    return cfg


def write_fp8_checkpoint(src: str, dst: str, layout: str, block=(128, 128), dequantized_dst: str | None = None,
                         kv_scales: bool = False, drop: tuple[str, ...] = ()) -> list[str]:
    """Write ``src`` (an HF checkpoint dir) to ``dst`` with its decoder linear weights in FP8
    (``layout``); with ``dequantized_dst`` also the same model, every FP8 weight dequantized to
    float32, unquantized config. ``drop``: tensor names left out of ``dst`` (tests of missing
    tensors). Returns the names of the FP8 weights."""
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
            out[name] = t
            deq[name] = t.float() if t.is_floating_point() else t
    if kv_scales:
        layers = sorted({int(m.group(1)) for n in tensors for m in [re.search(r"\.layers\.(\d+)\.", n)] if m})
        for i in layers:
            out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + 0.01 * i)
            out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.03 + 0.01 * i)
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
        cfg["quantization_config"] = _ct_config(layout, kv_scales)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return names
