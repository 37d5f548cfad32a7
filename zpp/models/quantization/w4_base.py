"""What the 4-bit formats share (:class:`W4Config`): each checkpoint layout -- MXFP4
(:mod:`~zpp.models.quantization.mxfp4`), compressed-tensors ``pack-quantized``
(:mod:`~zpp.models.quantization.int4_compressed`), GPTQ (:mod:`~zpp.models.quantization.gptq`),
AWQ (:mod:`~zpp.models.quantization.awq`) -- only says which tensors hold a weight and how to
repack them into the one in-memory layout of :mod:`~zpp.models.quantization.w4_layout`
(``qweight`` uint8 ``[..., N, K // 2]``, ``scales`` ``[..., N, K // G]``, optional ``zeros``).

* **CPU** (and GPUs below compute capability 8.0, or without the W4A16 methods): every 4-bit
  weight is repacked and dequantized on load by
  :func:`~zpp.models.quantization.w4_layout.dequantize_w4`, which is the format's own rule once
  repacked (each format's tests check it against the format's reference: HF transformers for MXFP4,
  ``compressed-tensors`` for pack-quantized, AutoGPTQ's / AutoAWQ's unpacking for GPTQ / AWQ).
* **GPU** (sm80+): where :mod:`zpp.models.quantization.w4a16` (the W4A16 Triton kernels' methods)
  imports, a linear layer / expert layer whose checkpoint weights are all of the format is made by
  ``W4A16LinearMethod(fmt=F, group_size=G, zeros=Z)`` / ``W4A16MoEMethod(...)`` (``Z``: the format
  carries zero points), where the method takes the layer's shapes and group size, and
  receives the canonical tensors (:meth:`W4Config.plan_kept`): a linear weight ``X.weight``'s as
  ``X.qweight``, ``X.scales`` and (asymmetric only) ``X.zeros``; a fused expert tensor ``X``'s (gpt-oss
  ``mlp.experts.gate_up_proj``) as ``X_qweight``, ``X_scales``, ``X_zeros``; every one in the
  w4_layout form, with the weight's rows ``N`` and columns ``K`` as the checkpoint's (gpt-oss's
  ``gate_up`` rows stay interleaved: gate even, up odd).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zpp.models.quantization.base import Getter, PlannedTensor, QuantizationConfig, TensorIndex, TensorInfo
from zpp.models.quantization.w4_layout import dequantize_w4

W4A16_MODULE = "zpp.models.quantization.w4a16"
"""The module of the W4A16 GPU methods (``W4A16LinearMethod``, ``W4A16MoEMethod``)."""

Repacked = tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
"""``(qweight uint8 [..., N, K // 2], scales [..., N, K // G], zeros uint8 [..., N, K // G] | None)``."""


def w4a16_method(name: str, layer: nn.Module, group_size: int, fmt: str, zeros: bool):
    """``zpp.models.quantization.w4a16.<name>(fmt=, group_size=, zeros=)`` for a layer on a CUDA
    device (or ``meta``: ``zpp plan`` for a GPU) whose shapes the method takes (the module's
    ``w4_linear_layout_ok`` / ``w4_moe_layout_ok``); None -- the layer is dequantized -- where that
    module does not import, the layer is elsewhere, or the method refuses the arguments (a group size
    its kernels do not take, e.g. GPTQ's ``-1``)."""
    p = next(layer.parameters(), None)
    if p is None or p.device.type not in ("cuda", "meta"):
        return None
    try:
        import importlib
        mod = importlib.import_module(W4A16_MODULE)
    except ImportError:
        return None
    cls = getattr(mod, name, None)
    ok = getattr(mod, "w4_moe_layout_ok" if "MoE" in name else "w4_linear_layout_ok", None)
    if cls is None or group_size <= 0 or (ok is not None and not ok(layer, group_size)):
        return None
    try:
        return cls(fmt=fmt, group_size=group_size, zeros=zeros)
    except ValueError:
        return None


class W4Config(QuantizationConfig):
    """A 4-bit checkpoint's scheme. A format sets ``method``, ``fmt`` (``int4`` / ``mxfp4``),
    ``group_size``, ``ignore``, and implements :meth:`weight_base` (which tensors are its weights),
    :meth:`aux_names` (what travels with one) and :meth:`repack` (to the w4_layout form).

    ``min_capability`` 8.0: the W4A16 kernels run on any GPU Triton supports from Ampere on.
    """

    method: str
    fmt: str
    group_size: int
    min_capability = (8, 0)
    copies_kept_weight = False
    WEIGHT_SUFFIX: str = ""
    """The suffix of a quantized weight's checkpoint name (``.weight_packed``, ``.qweight``, ``_blocks``)."""
    LOADED_SUFFIX: str = ".weight"
    """What replaces it in the name the dequantized weight loads under."""
    AUX_SUFFIXES: tuple[str, ...] = ()
    """Suffixes of the tensors that only travel with a weight."""
    STORED_DTYPES: tuple[str, ...] = ("I32",)

    # --- format-specific ------------------------------------------------------------------------
    def aux_names(self, base: str) -> dict[str, str]:
        """role (``scales``, ``zeros``, ...) -> checkpoint name of the tensors the weight ``base``
        (its name without :attr:`WEIGHT_SUFFIX`) needs; optional ones are included only when the
        format's config says they exist."""
        raise NotImplementedError

    def repack(self, base: str, get: Getter) -> Repacked:
        """The weight ``base``'s tensors read with ``get`` and repacked into the w4_layout form.

        Raises:
            ValueError: shapes that do not agree with the config (named).
        """
        raise NotImplementedError

    def to_loaded_layout(self, w: torch.Tensor) -> torch.Tensor:
        """The dequantized ``[..., N, K]`` in the layout of the model's unquantized checkpoint
        (default: as is)."""
        return w

    # --- what the checkpoint holds -------------------------------------------------------------
    def weight_base(self, name: str) -> Optional[str]:
        return name[: -len(self.WEIGHT_SUFFIX)] if name.endswith(self.WEIGHT_SUFFIX) else None

    def is_auxiliary(self, name: str) -> bool:
        return name.endswith(self.AUX_SUFFIXES)

    def is_quantized(self, info: TensorInfo) -> bool:
        return info.dtype in self.STORED_DTYPES

    def loaded_name(self, name: str) -> str:
        base = self.weight_base(name)
        return name if base is None else base + self.LOADED_SUFFIX

    def weight_kind(self, index: TensorIndex, name: str) -> Optional[str]:
        """:attr:`fmt` when ``name`` is one of the format's weights with every tensor it needs."""
        base = self.weight_base(name)
        if base is None or name not in index or not self.is_quantized(index[name]):
            return None
        return self.fmt if all(n in index for n in self.aux_names(base).values()) else None

    # --- the CPU's rule ------------------------------------------------------------------------
    def plan_dequantize(self, index: TensorIndex, name: str, dtype: torch.dtype) -> PlannedTensor:
        base = self.weight_base(name)
        if base is None:
            raise ValueError(f"checkpoint tensor {name!r} ({index[name].dtype}) is not a {self.method} weight "
                             f"(no {self.WEIGHT_SUFFIX} suffix)")
        aux = self.aux_names(base)
        missing = [n for n in aux.values() if n not in index]
        if missing:
            raise ValueError(f"checkpoint tensor {name!r} is a {self.method} weight but the checkpoint has no "
                             f"{', '.join(missing)}")
        return PlannedTensor(self.loaded_name(name), "dequantize", name, scale=aux.get("scales"), dtype=dtype)

    _cache: Optional[tuple[str, Repacked]] = None

    def _repacked(self, source: str, get: Getter) -> Repacked:
        """:meth:`repack` of the weight ``source``, the last one remembered (a kept weight's three
        canonical tensors come from one repack)."""
        base = self.weight_base(source)
        if self._cache is None or self._cache[0] != source:
            object.__setattr__(self, "_cache", (source, self.repack(base, get)))
        return self._cache[1]

    def materialize(self, t: PlannedTensor, get: Getter, device: torch.device) -> torch.Tensor:
        """Ops: ``dequantize`` (repacked, then :func:`~zpp.models.quantization.w4_layout.dequantize_w4`
        on ``device`` to ``t.dtype``, in the unquantized checkpoint's layout), ``w4_qweight`` /
        ``w4_scales`` / ``w4_zeros`` (the kept weight's canonical tensors)."""
        qweight, scales, zeros = self._repacked(t.source, get)
        if t.op == "dequantize":
            z = zeros.to(device) if zeros is not None else None
            group = qweight.shape[-1] * 2 // max(scales.shape[-1], 1)        # (GPTQ group_size -1: K)
            w = dequantize_w4(qweight.to(device), scales.to(device), z, group, self.fmt, t.dtype)
            object.__setattr__(self, "_cache", None)
            return self.to_loaded_layout(w)
        if t.op == "w4_qweight":
            return qweight
        if t.op == "w4_scales":
            return scales
        if t.op == "w4_zeros":
            if zeros is None:
                raise ValueError(f"checkpoint tensor {t.source!r}: no zero points to load into {t.name!r}")
            return zeros
        raise ValueError(f"unknown planned op {t.op!r}")

    # --- the GPU's methods ---------------------------------------------------------------------
    def _all_of_format(self, sources: list[str], index: TensorIndex) -> bool:
        return bool(sources) and all(self.weight_kind(index, s) == self.fmt for s in sources)

    def linear_method(self, layer: nn.Module, sources: list[str], index: TensorIndex):
        """``W4A16LinearMethod(group_size, fmt)`` where every source is one of the format's weights
        and the W4A16 methods import (:func:`w4a16_method`); else None (dequantized)."""
        if getattr(layer, "transposed", False) or not self._all_of_format(sources, index):
            return None
        return w4a16_method("W4A16LinearMethod", layer, self.group_size, self.fmt, self.zero_points)

    def moe_method(self, experts: nn.Module, sources: list[str], index: TensorIndex):
        """``W4A16MoEMethod(group_size, fmt)`` where every expert tensor is one of the format's
        weights and the W4A16 methods import; else None (dequantized)."""
        if not self._all_of_format(sources, index):
            return None
        return w4a16_method("W4A16MoEMethod", experts, self.group_size, self.fmt, self.zero_points)

    def kept(self, param: nn.Parameter) -> bool:
        return param.dtype == torch.uint8

    def kept_by(self, module: Optional[nn.Module], param: Optional[nn.Parameter]) -> bool:
        """A layer whose ``quant_method`` is one of the W4A16 methods (it replaced the weight by
        ``qweight`` / ``scales`` / ``zeros``)."""
        method = getattr(module, "quant_method", None) if module is not None else None
        return method is not None and type(method).__module__ == W4A16_MODULE

    def canonical_names(self, loaded: str) -> dict[str, str]:
        """role -> the canonical name of a kept weight loading as ``loaded`` (``X.weight`` ->
        ``X.qweight`` ...; a fused expert tensor ``X`` -> ``X_qweight`` ...)."""
        if loaded.endswith(".weight"):
            stem = loaded[: -len("weight")]
            return {r: stem + r for r in ("qweight", "scales", "zeros")}
        return {r: f"{loaded}_{r}" for r in ("qweight", "scales", "zeros")}

    @property
    def zero_points(self) -> bool:
        """Whether the format's weights carry zero points once repacked (else the symmetric 8)."""
        raise NotImplementedError

    def has_zeros(self, base: str, index: TensorIndex) -> bool:
        """Whether the weight ``base`` carries zero points after repacking (:attr:`zero_points`)."""
        return self.zero_points

    def plan_kept(self, index: TensorIndex, name: str, module: nn.Module) -> list[PlannedTensor]:
        """The kept weight's canonical ``qweight``, ``scales`` and (asymmetric) ``zeros``, repacked."""
        names = self.canonical_names(self.loaded_name(name))
        roles = ["qweight", "scales"] + (["zeros"] if self.has_zeros(self.weight_base(name), index) else [])
        rows = index[name].shape[-2] if len(index[name].shape) >= 2 else 0
        return [PlannedTensor(names[r], f"w4_{r}", name, rows=rows) for r in roles]

    def dummy_target(self, name: str, experts: bool) -> bool:
        """Whether the release quantizes the layer ``name`` (zpp's module name; ``experts``: a
        :class:`~zpp.models.layers.moe.FusedExperts`), for ``--load-format dummy`` where there are
        no tensors to read it from. Default: every decoder layer's linear layers and experts not
        matched by :attr:`ignore`."""
        from zpp.models.quantization.base import ignored
        return ".layers." in f".{name}" and not ignored(f"{name}.0.gate_proj" if experts else name, self.ignore)

    @torch.no_grad()
    def quantize_like_checkpoint(self, model: nn.Module) -> int:
        """``--load-format dummy`` with a 4-bit config where the W4A16 methods run (a GPU of
        compute capability >= 8.0; ``zpp plan``'s meta build for one): the layers the release
        quantizes (:meth:`dummy_target`) made 4-bit by the methods, their random weights quantized
        as the format would (:func:`quantize_w4`; on ``meta`` shapes only), module by module
        (:meth:`quantize_module_like_checkpoint`). Returns the number of layers made 4-bit (0
        without the methods: the random weights stay in the model dtype)."""
        from zpp.models.layers.moe import FusedExperts
        from zpp.models.quantization.base import linear_modules
        n = sum(self.quantize_module_like_checkpoint(name, mod) for name, mod in model.named_modules()
                if isinstance(mod, FusedExperts))
        return n + sum(self.quantize_module_like_checkpoint(name, mod) for name, mod in linear_modules(model))

    @torch.no_grad()
    def quantize_module_like_checkpoint(self, name: str, mod: nn.Module) -> bool:
        """One module ``name`` of :meth:`quantize_like_checkpoint` (also the loader's module-by-module
        dummy start, :func:`zpp.models.loader.init_dummy_weights_quantized`): a linear layer or a
        :class:`~zpp.models.layers.moe.FusedExperts` the release quantizes, where the W4A16 method
        takes it, is made 4-bit -- experts quantized expert by expert, so the float32 / code
        temporaries are one expert's -- and its float weights dropped; any other module is left as
        it is. Returns whether it was made 4-bit."""
        from zpp.models.layers.linear import Linear
        from zpp.models.layers.moe import FusedExperts
        from zpp.models.quantization.base import keeps_dtype
        if getattr(mod, "quant_method", None) is not None:
            return False
        if isinstance(mod, FusedExperts):
            if not self.dummy_target(name, True):
                return False
            method = w4a16_method("W4A16MoEMethod", mod, self.group_size, self.fmt, self.zero_points)
            if method is None:
                return False
            ws = {p: getattr(mod, p).data for p in ("gate_up_proj", "down_proj")}
            method.create_weights(mod)
            for p, w in ws.items():
                if w.device.type != "meta":
                    for e in range(w.shape[0]):
                        _fill(mod, f"{p}_", quantize_w4(w[e], self.group_size, self.fmt, self.zero_points), e)
            return True
        if not isinstance(mod, Linear) or keeps_dtype(name, mod) or not self.dummy_target(name, False):
            return False
        method = w4a16_method("W4A16LinearMethod", mod, self.group_size, self.fmt, self.zero_points)
        if method is None:
            return False
        w = mod.weight.data
        method.create_weights(mod)
        if w.device.type != "meta":
            _fill(mod, "", quantize_w4(w, self.group_size, self.fmt, self.zero_points))
        return True


def _fill(mod: nn.Module, prefix: str, packed: Repacked, expert: Optional[int] = None) -> None:
    """Copy a :func:`quantize_w4` result into ``mod``'s ``{prefix}qweight`` / ``scales`` / ``zeros``
    (into row ``expert`` of each where given)."""
    for role, t in zip(("qweight", "scales", "zeros"), packed):
        p = getattr(mod, prefix + role, None)
        if p is not None and t is not None:
            (p.data if expert is None else p.data[expert]).copy_(t)


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Between consecutive e2m1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6): where rounding to nearest turns."""


@torch.no_grad()
def quantize_w4(w: torch.Tensor, group_size: int, fmt: str, zeros: bool = False) -> Repacked:
    """A float weight ``[..., N, K]`` quantized into the w4_layout form (the random weights of
    ``--load-format dummy``, quantized like a release): ``int4`` symmetric -- ``scale = amax / 7``
    per group, codes ``round(w / scale) + 8`` -- or with ``zeros`` asymmetric -- ``scale = (max -
    min) / 15`` (rounded up to ``w``'s dtype, so nothing clips), ``zero = round(-min / scale)``;
    scales in ``w``'s dtype. ``mxfp4``: per block of 32
    the E8M0 exponent ``ceil(log2(amax / 6))`` (OCP MX v1.0's shared scale), codes the nearest
    e2m1 of ``w / 2^e``.

    Raises:
        ValueError: ``K`` not a multiple of ``group_size``.
    """
    from zpp.models.quantization.w4_layout import pack_codes
    *lead, n, k = w.shape
    if k % group_size or k % 2:
        raise ValueError(f"{k} input columns do not split into groups of {group_size}")
    g = w.float().reshape(*lead, n, k // group_size, group_size)
    if fmt == "mxfp4":
        amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
        e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        x = g / torch.exp2(e)
        mag = torch.bucketize(x.abs(), torch.tensor(E2M1_MIDPOINTS, device=w.device))
        codes = (mag | ((x < 0).to(mag.dtype) << 3)).reshape(*lead, n, k)
        return pack_codes(codes), (e.squeeze(-1) + 127).to(torch.uint8), None
    if zeros:
        lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        s = ((hi - lo) / 15.0 * (1 + 2.0 ** -7)).clamp_min(1e-10).to(w.dtype).float()  # rounded: never < the span
        z = torch.round(-lo / s).clamp(0, 15)
    else:
        s = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-10).to(w.dtype).float()
        z = torch.full_like(s, 8)
    codes = torch.round(g / s + z).clamp(0, 15).reshape(*lead, n, k)
    return (pack_codes(codes), s.squeeze(-1).to(w.dtype),
            z.squeeze(-1).to(torch.uint8) if zeros else None)


def check_group(method: str, field: str, group_size: int, k: int, name: str) -> None:
    """Raise ValueError when ``k`` input columns do not split into groups of ``group_size``."""
    if group_size <= 0 or k % group_size or k % 2:
        raise ValueError(f"checkpoint tensor {name!r}: {k} input columns do not split into {method} groups of "
                         f"{group_size} ({field})")
