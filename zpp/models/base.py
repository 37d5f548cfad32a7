"""What every pipeline-stage model shares: stage bookkeeping, weight-name ownership, loading."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from zpp.errors import ConfigError
from zpp.models.layers.linear import default_weight_loader

_LAYER_RE = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class StageInfo:
    """Which part of the model a worker owns: decoder layers ``[layer_start, layer_end)``, and its
    tensor-parallel slice of them (rank ``tp_rank`` of ``tp_size``; 0 of 1 without TP)."""

    pp_rank: int
    pp_size: int
    layer_start: int
    layer_end: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def produces_results(self) -> bool:
        """The one worker that computes logits, samples and reports to the engine: TP rank 0 of
        the last stage (the other TP ranks of the last stage run the forward for its all-reduces)."""
        return self.is_last and self.tp_rank == 0

    def owns_layer(self, i: int) -> bool:
        return self.layer_start <= i < self.layer_end


class MissingLayer(nn.Identity):
    """Placeholder for a decoder layer another stage owns, so layer indices stay global."""


def layer_index(name: str) -> Optional[int]:
    """Global decoder-layer index in a checkpoint tensor name, or None for non-layer tensors."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


class StageModel(nn.Module):
    """Base class of every model family.

    Subclasses set:
        ``num_acts``: tensors sent between stages (2 = hidden + residual, 1 = hidden only);
        ``packed_modules``: checkpoint sub-name -> (merged sub-name, shard index);
        ``tied_names``: checkpoint names to load into ``lm_head.weight`` when embeddings are tied;
        ``tie_word_embeddings_default``: HF's default when ``config.json`` omits the key;
    and implement ``forward(input_ids, positions, acts, kv_caches, meta)`` returning
    ``[num_acts, T, hidden]`` on non-last stages and the final hidden states ``[T, hidden]`` on
    the last one, and ``compute_logits(h [N, hidden], upcast=True)`` -> float32 ``[N, vocab]``
    (``upcast=False``: in the model's dtype, for argmax-only callers).
    """

    num_acts: int = 2
    supports_tensor_parallel: bool = False
    """True when the family splits its layers over ``StageInfo.tp_size`` ranks (Megatron-LM style)."""
    supports_cuda_graphs: bool = True
    """False when the forward reads device values on the host (e.g. MoE expert counts)."""
    packed_modules: dict[str, tuple[str, int]] = {}
    tied_names: tuple[str, ...] = ()
    tie_word_embeddings_default: bool = False

    def __init__(self, cfg: dict[str, Any], stage: StageInfo):
        super().__init__()
        self.cfg = cfg
        self.stage = stage

    # --- to be defined by each family -------------------------------------------------------
    hidden_size: int
    num_kv_heads: int
    """KV heads this worker holds (the model's count divided by ``stage.tp_size``); sizes the KV cache."""
    head_dim: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of ONE layer's KV cache on this worker for ``num_blocks`` blocks of ``block_size``
        tokens; dim 1 (dim 0 for a layout without the K/V axis) indexes blocks. The model runner
        allocates one such tensor per local layer, sizes the cache from it (bytes of a block = the
        shape at ``num_blocks=1``) and hands it to the layer's attention unchanged.

        Default: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V). A family with
        another layout overrides this together with its attention (DeepSeek's latent cache:
        ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_cache_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        """Bytes one KV block of ``block_size`` tokens takes across this stage's layers on this worker,
        elements of ``kv_dtype``: the per-layer layout of :meth:`kv_cache_shape` at one block, times the
        stage's layers. The one count the model runner sizes its cache with and ``zpp plan`` reports."""
        elem = torch.empty(0, dtype=kv_dtype, device="meta").element_size()
        return math.prod(self.kv_cache_shape(1, block_size)) * elem * self.num_local_layers

    @classmethod
    def normalize_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` as the rest of zpp reads it (``vocab_size``, ``num_attention_heads``,
        ``max_position_embeddings``, ...): a family whose configs nest the text model or omit keys
        with class defaults returns a flat dict with them filled in. Default: unchanged."""
        return cfg

    @classmethod
    def check_config(cls, cfg: dict[str, Any]) -> None:
        """Raise ConfigError for options this implementation does not support."""

    @classmethod
    def rope_switch_length(cls, cfg: dict[str, Any]) -> Optional[int]:
        """The sequence length past which the model encodes positions differently for the whole
        sequence (LongRoPE's ``original_max_position_embeddings``): a sequence computed at or below
        it must be recomputed once it grows past it (the scheduler does). None for most families."""
        return None

    @classmethod
    def check_tensor_parallel(cls, cfg: dict[str, Any], tp_size: int) -> None:
        """Raise ConfigError (one line, naming ``--tensor-parallel-size``) if this config cannot be
        split ``tp_size`` ways. Called only for ``tp_size > 1`` on families with
        ``supports_tensor_parallel``."""

    @staticmethod
    def num_layers_of(cfg: dict[str, Any]) -> int:
        return int(cfg["num_hidden_layers"])

    @classmethod
    def layer_kinds(cls, cfg: dict[str, Any]) -> list[str]:
        """The kind of every decoder layer, by global index (``--pp-layer-partition auto`` times one
        layer of each kind). Layers of one kind cost the same; families whose layers differ
        (dense vs mixture-of-experts MLPs) override this. Default: one kind, ``"decoder"``."""
        return ["decoder"] * cls.num_layers_of(cfg)

    def stage_owns(self, name: str) -> bool:
        """Does this stage hold checkpoint tensor ``name``? Default (HF's ``model.embed_tokens`` /
        ``model.layers.N`` / ``model.norm`` / ``lm_head`` naming): layers by index, the embedding
        on the first stage, everything else (final norm, LM head) on the last."""
        i = layer_index(name)
        if i is not None:
            return self.stage.owns_layer(i)
        if name.startswith("model.embed_tokens."):
            return self.stage.is_first
        return self.stage.is_last

    def build_decoder(self, vocab_size: int, hidden_size: int, num_layers: int,
                      make_layer: Callable[[int], nn.Module], make_norm: Callable[[], nn.Module]) -> None:
        """The stage's share of an HF decoder under HF's names: ``model.embed_tokens`` (first stage
        only), ``model.layers`` (``make_layer(i)`` for the owned global indices, a
        :class:`MissingLayer` elsewhere, so checkpoint names index straight in), ``model.norm`` and
        ``lm_head`` (last stage only)."""
        from zpp.models.layers.linear import LMHead, VocabEmbedding
        self.hidden_size = hidden_size
        self.model = nn.Module()
        if self.stage.is_first:
            self.model.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
        self.model.layers = nn.ModuleList(
            make_layer(i) if self.stage.owns_layer(i) else MissingLayer() for i in range(num_layers))
        if self.stage.is_last:
            self.model.norm = make_norm()
            self.lm_head = LMHead(vocab_size, hidden_size)

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """``h [N, hidden]`` -> logits ``[N, vocab]``, float32 unless ``upcast=False``. Default:
        the LM head alone (families with a logit soft-cap or scale override this)."""
        return self.lm_head(h, upcast)

    @staticmethod
    def check_divisible(sizes: dict[str, int], tp_size: int) -> None:
        """Raise ConfigError naming the first of ``sizes`` (config key -> value) that
        ``tp_size`` does not divide."""
        for key, n in sizes.items():
            if int(n) % tp_size:
                raise ConfigError(f"--tensor-parallel-size {tp_size} does not divide the model's {key} ({n})")

    @property
    def num_local_layers(self) -> int:
        return self.stage.layer_end - self.stage.layer_start

    # --- loading ------------------------------------------------------------------------------
    def check_weight_names(self, names: Iterable[str]) -> None:
        """The name checks of :meth:`load_weights` on the checkpoint's tensor names alone, so that a
        checkpoint with a tensor missing or misnamed is refused before any tensor is read or copied
        (the loader runs it on the safetensors headers first).

        Raises:
            ValueError: one line naming the tensors this stage owns that match no parameter -- or a
                shard the parameter does not have -- (unexpected) and the parameters (or shards of
                merged ones) no tensor fills (missing).
        """
        params = dict(self.named_parameters())
        filled: set[str] = set()
        unexpected: list[str] = []
        for name in names:
            for pname, shard in self.map_weight_name(name) or ():
                if self._target_ok(pname, shard, params):
                    filled.add(f"{pname}#{shard}")
                else:
                    unexpected.append(name)
        self._raise_mismatch(params, filled, unexpected)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into this stage's parameters.

        Tensors other stages own are skipped. Raises ValueError naming any tensor this stage owns
        that matches no parameter -- or a shard the parameter does not have, e.g. expert 8 of a
        layer of 8 experts -- (unexpected), or any parameter that received nothing (missing), or a
        tensor whose shape does not fit its parameter. The loader checks the names first
        (:meth:`check_weight_names`), before any copy. Linear layers packed for oneDNN
        (:mod:`zpp.models.layers.cpu_linear`) are given their dense weights back first.
        """
        from zpp.models.layers.cpu_linear import unpack_all
        unpack_all(self)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            targets = self.map_weight_name(name)
            if targets is None:
                continue
            for pname, shard in targets:
                if not self._target_ok(pname, shard, params):
                    unexpected.append(name)
                    continue
                param = params[pname]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    if shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
                loaded.add(f"{pname}#{shard}")
        self._raise_mismatch(params, loaded, unexpected)

    def _target_ok(self, pname: str, shard: Optional[int], params: dict[str, nn.Parameter]) -> bool:
        """Whether parameter ``pname`` exists and has shard ``shard`` (None: loaded whole)."""
        param = params.get(pname)
        return param is not None and (shard is None or 0 <= shard < (self._num_shards(pname, param) or 0))

    def _raise_mismatch(self, params: dict[str, nn.Parameter], filled: set[str], unexpected: list[str]) -> None:
        """One ValueError line naming unexpected tensors and missing parameters, if any (10 of each)."""
        missing = sorted(m for pname, p in params.items() if (m := self._missing(pname, p, filled)))
        parts = []
        if unexpected:
            parts.append(f"unexpected checkpoint tensors for this model: {', '.join(sorted(unexpected)[:10])}"
                         + (" ..." if len(unexpected) > 10 else ""))
        if missing:
            parts.append(f"checkpoint is missing tensors: {', '.join(missing[:10])}"
                         + (" ..." if len(missing) > 10 else ""))
        if parts:
            raise ValueError("; ".join(parts))

    def _num_shards(self, pname: str, param: nn.Parameter) -> Optional[int]:
        """How many shards ``pname`` loads in: ``param.num_shards`` if set (MoE experts:
        :class:`zpp.models.layers.moe.FusedExperts`), else ``len(owner.output_sizes)`` (merged
        linear layers); None for a parameter that loads whole only."""
        n = getattr(param, "num_shards", None)
        if n is None:
            owner = self.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else self
            sizes = getattr(owner, "output_sizes", None)
            n = len(sizes) if sizes is not None else None
        return n

    def _missing(self, pname: str, param: nn.Parameter, loaded: set[str]) -> Optional[str]:
        """None if ``pname`` was loaded whole (shard None) or in every shard (:meth:`_num_shards`),
        else its description."""
        if f"{pname}#None" in loaded:
            return None
        n = self._num_shards(pname, param)
        if n is None:
            return pname
        absent = [i for i in range(n) if f"{pname}#{i}" not in loaded]
        if not absent:
            return None
        return pname if len(absent) == n else f"{pname} (shards {','.join(map(str, absent))} of {n})"

    def map_weight_name(self, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
        """Checkpoint name -> [(parameter name, shard index or None)], or None to skip it."""
        if self.tie_embeddings and name in self.tied_names:
            targets: list[tuple[str, Optional[int]]] = []
            if self.stage.is_last:
                targets.append(("lm_head.weight", None))
            if self.stage.is_first:
                targets.append((name, None))
            return targets or None
        if self.tie_embeddings and name.startswith("lm_head."):
            return None
        if not self.stage_owns(name):
            return None
        for ckpt, (merged, shard) in self.packed_modules.items():
            part = f".{ckpt}."
            if part in name:
                return [(name.replace(part, f".{merged}."), shard)]
        return [(name, None)]

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.cfg.get("tie_word_embeddings", self.tie_word_embeddings_default))


class PreNormDecoder(StageModel):
    """A stage of a pre-norm residual decoder (LLaMA and the families built like it): the hidden
    state and the residual stream travel between stages.

    forward(input_ids [T] int64 | None, positions [T] int64 (or the family's rotary rows),
    acts [2, T, H] | None, kv_caches, meta) -> ``[2, T, H]`` (hidden, residual) on non-last stages,
    the final normed hidden ``[T, H]`` on the last. Each layer is called as
    ``layer(positions, h, residual, kv_cache, meta) -> (h, residual)`` and the final norm as
    ``norm(h, residual) -> (h, residual)`` (fused add + RMSNorm)."""

    num_acts = 2

    def forward(self, input_ids, positions, acts, kv_caches, meta):
        if self.stage.is_first:
            h, residual = self.model.embed_tokens(input_ids), None     # [T, H]
        else:
            h, residual = acts[0], acts[1]
        for j, i in enumerate(range(self.stage.layer_start, self.stage.layer_end)):
            h, residual = self.model.layers[i](positions, h, residual, kv_caches[j], meta)
        if not self.stage.is_last:
            return torch.stack([h, residual])                          # [2, T, H]
        h, _ = self.model.norm(h, residual)
        return h
