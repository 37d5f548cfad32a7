"""compressed-tensors ``pack-quantized`` INT4 (W4A16): :class:`PackQuantizedConfig`.

What llm-compressor writes for ``W4A16`` / ``W4A16_ASYM`` and what Kimi K2-Thinking / K2.5 ship
(group 32, routed experts only). Per quantized linear ``X``:

* ``X.weight_packed`` int32 ``[N, ceil(K / 8)]``: eight 4-bit values a word along ``K``, value ``i``
  of a row at bits ``4i`` of the stream (``compressed_tensors``' ``pack_to_int32``), each stored
  as ``q + 8`` (``q`` the signed int4 in ``[-8, 7]``);
* ``X.weight_scale`` ``[N, K / G]`` (bf16 / fp16 / fp32), ``X.weight_shape`` int ``[2]`` = ``(N, K)``;
* asymmetric only: ``X.weight_zero_point`` int32 ``[ceil(N / 8), K / G]``, the signed zero points
  packed the same way along ``N`` (``packed_dim=0``).

The rule (``compressed_tensors.quantization.lifecycle.forward.dequantize``): ``w = (q - zp) * scale``
per group of ``G`` columns, ``zp = 0`` when symmetric. Repacked, the stored ``q + 8`` is the
w4_layout's code and ``zp + 8`` its zero (symmetric: 8), so on a little-endian host the packed
int32 words read as bytes are already ``qweight``. ``ignore`` (``lm_head``, ``re:`` patterns) only
explains which layers are stored in high precision; what is quantized is read from the tensors.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from zpp.errors import ConfigError
from zpp.models.quantization.base import Getter
from zpp.models.quantization.base import ignored  # noqa: F401  (compressed-tensors' rule)
from zpp.models.quantization.w4_base import Repacked, W4Config, check_group
from zpp.models.quantization.w4_layout import unpack_codes

GROUP_SIZES = (32, 64, 128)


def _as_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., W]`` -> uint8 ``[..., 4W]`` in the order of the packed bit stream (byte 0 =
    bits 0..7 of word 0)."""
    b = words.contiguous().reshape(-1).view(torch.uint8)            # (flat: a size-1 dim's stride is free)
    if sys.byteorder == "big":
        b = b.reshape(-1, 4).flip(-1)
    return b.reshape(*words.shape[:-1], -1)


@dataclass
class PackQuantizedConfig(W4Config):
    """compressed-tensors ``pack-quantized`` int4: ``group_size`` 32 / 64 / 128, ``symmetric``,
    ``ignore`` (informational)."""

    method: str = "compressed-tensors"
    fmt: str = "int4"
    group_size: int = 128
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    WEIGHT_SUFFIX = ".weight_packed"
    AUX_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")

    def aux_names(self, base: str) -> dict[str, str]:
        out = {"scales": f"{base}.weight_scale", "shape": f"{base}.weight_shape"}
        if not self.symmetric:
            out["zeros"] = f"{base}.weight_zero_point"
        return out

    @property
    def zero_points(self) -> bool:
        return not self.symmetric

    def repack(self, base: str, get: Getter) -> Repacked:
        packed, scale = get(f"{base}.weight_packed"), get(f"{base}.weight_scale")
        shape = tuple(int(x) for x in get(f"{base}.weight_shape").reshape(-1).tolist())
        if packed.dtype != torch.int32 or len(shape) != 2 or packed.dim() != 2:
            raise ValueError(f"checkpoint tensor {base}.weight_packed: int32 [N, K/8] with a weight_shape (N, K) "
                             f"expected, got {packed.dtype} {tuple(packed.shape)}, shape {shape}")
        n, k = shape
        check_group(self.method, "group_size", self.group_size, k, f"{base}.weight_packed")
        if packed.shape != (n, -(-k // 8)) or tuple(scale.shape) != (n, k // self.group_size):
            raise ValueError(f"checkpoint tensor {base}.weight_packed {tuple(packed.shape)} / weight_scale "
                             f"{tuple(scale.shape)} do not agree with weight_shape ({n}, {k}) in groups of "
                             f"{self.group_size}")
        qweight = _as_bytes(packed)[:, : k // 2].contiguous()                 # [N, K/2]
        zeros = None
        if not self.symmetric:
            zp = get(f"{base}.weight_zero_point")
            g = k // self.group_size
            if zp.dtype != torch.int32 or tuple(zp.shape) != (-(-n // 8), g):
                raise ValueError(f"checkpoint tensor {base}.weight_zero_point: int32 [{-(-n // 8)}, {g}] expected, "
                                 f"got {zp.dtype} {tuple(zp.shape)}")
            zeros = unpack_codes(_as_bytes(zp.t()))[:, :n].t().contiguous()   # [N, K/G], zp + 8
        return qweight, scale.contiguous(), zeros


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"compressed-tensors checkpoint: {what} is not supported (zpp loads pack-quantized int4 "
                       "weights, symmetric or asymmetric, group 32 / 64 / 128, with bf16 / fp16 activations)")


def parse_pack_quantized(q: dict) -> PackQuantizedConfig:
    """compressed-tensors with every config group ``pack-quantized`` -> :class:`PackQuantizedConfig`.

    Raises:
        ConfigError: one line naming the field it refuses (bits other than 4, a strategy other than
            ``group``, ``actorder``, quantized activations, groups of different schemes, ...).
    """
    fmt = q.get("format")
    scheme = None
    for name, g in (q.get("config_groups") or {}).items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise _refuse(f"config group {name!r} without weights")
        gfmt = g.get("format") or fmt
        if gfmt != "pack-quantized":
            raise _refuse(f"format {gfmt!r} (config group {name!r}) next to pack-quantized groups")
        w = g["weights"]
        if w.get("type") != "int" or int(w.get("num_bits", 0)) != 4:
            raise _refuse(f"weights of type {w.get('type')!r} with {w.get('num_bits')} bits (config group {name!r})")
        if w.get("strategy") != "group":
            raise _refuse(f"weight strategy {w.get('strategy')!r} (config group {name!r}; 'group' only)")
        gs = w.get("group_size")
        if gs not in GROUP_SIZES:
            raise _refuse(f"group_size {gs!r} (config group {name!r})")
        if w.get("actorder") not in (None, False, "static"):
            raise _refuse(f"actorder {w.get('actorder')!r} (config group {name!r})")
        if w.get("dynamic"):
            raise _refuse(f"dynamic weights (config group {name!r})")
        if g.get("input_activations") or g.get("output_activations"):
            raise _refuse(f"quantized activations (config group {name!r})")
        s = (int(gs), w.get("symmetric", True) is not False)
        if scheme not in (None, s):
            raise _refuse("config groups with different group sizes or symmetry")
        scheme = s
    if scheme is None:
        raise _refuse("a quantization_config without config_groups")
    if q.get("kv_cache_scheme"):
        raise _refuse(f"kv_cache_scheme {q['kv_cache_scheme']!r} with int4 weights")
    return PackQuantizedConfig(group_size=scheme[0], symmetric=scheme[1], ignore=tuple(q.get("ignore") or ()))


def is_pack_quantized(q: dict) -> bool:
    """Whether a compressed-tensors config's groups are ``pack-quantized`` (any of them: a mix with
    another format is refused by :func:`parse_pack_quantized`)."""
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict):
        return False
    return any(isinstance(g, dict) and (g.get("format") or q.get("format")) == "pack-quantized"
               for g in groups.values())


