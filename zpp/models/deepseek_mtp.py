"""DeepSeek-V3's multi-token-prediction (MTP) layer, built on the last pipeline stage for speculative
decoding (``--speculative-config '{"method": "mtp", ...}'``, :mod:`zpp.workers.mtp` runs it).

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), section 2.2: module ``k``
combines the previous depth's representation ``h_i`` of position ``i`` with the embedding of the
token at ``i + 1``:

    h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)]        (``eh_proj``, ``enorm``, ``hnorm``)
    h''  = TRM(h'_{1..i})                                  (one decoder layer: MLA + MoE, causal)
    P_{i+2} = OutHead(h''_i)                              (``shared_head.norm``, ``shared_head.head``)

The concatenation puts the embedding first, as the released weights are laid out (vLLM's and
SGLang's ``deepseek_mtp``; the paper writes the two the other way round). ``h_i`` is the main
model's output after its final norm: that is what the checkpoint's own ``modeling_deepseek.py``
hands the MTP module (``hnorm`` was trained on it) and what vLLM and SGLang feed it; chained draft
steps feed the MTP layer's own output after ``shared_head.norm`` (ROCm ATOM #1764 measured the
pre-norm variant's acceptance lower). The embedding is the main model's (the paper's shared
embedding; the checkpoint's ``model.layers.{N}.embed_tokens`` copy is not loaded).

Checkpoint names (``N`` = ``num_hidden_layers``): ``model.layers.{N}.enorm / hnorm / eh_proj /
shared_head.norm / shared_head.head`` and the decoder layer's own (``self_attn.*``, ``mlp.*``,
``input_layernorm``, ``post_attention_layernorm``), so the layer sits at ``model.layers[N]`` and
the family's loader maps its tensors as any layer's. Its KV cache is one more latent cache tensor
of the last stage (``StageModel.num_local_layers`` counts it), indexed by the request's block table.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zpp.models.layers.attention import AttentionMetadata
from zpp.models.layers.linear import Linear, LMHead, VocabEmbedding
from zpp.models.layers.norm import RMSNorm
from zpp.spec_config import MTP_LAYERS_KEY


class DeepseekMTPLayer(nn.Module):
    """One MTP module around a DeepSeek decoder layer (``block``, whose parameters keep the
    checkpoint's names: it is registered under this module's own names).

    :meth:`forward` ``(positions [T] int64, input_ids [T] int64 (the token AFTER each position),
    prev_hidden [T, H], kv_cache, meta)`` -> ``[T, H]``, the output after ``shared_head.norm``
    (logits: :meth:`logits`; the next chained step's ``prev_hidden``)."""

    def __init__(self, block: nn.Module, hidden_size: int, vocab_size: int, eps: float,
                 shared_embed: Optional[nn.Module] = None):
        super().__init__()
        self.self_attn, self.mlp = block.self_attn, block.mlp
        self.input_layernorm, self.post_attention_layernorm = block.input_layernorm, block.post_attention_layernorm
        self._block_forward = type(block).forward
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden_size, eps)
        self.shared_head.head = LMHead(vocab_size, hidden_size)
        if shared_embed is None:  # a last stage that is not the first: its own copy of the embedding
            self.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
            self._embed = [self.embed_tokens]
        else:
            self._embed = [shared_embed]  # the first stage's, not registered twice

    def forward(self, positions: torch.Tensor, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                kv_cache: Optional[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        e = self.enorm(self._embed[0](input_ids))                       # [T, H]
        h = self.hnorm(prev_hidden)                                     # [T, H]
        x = self.eh_proj(torch.cat([e, h], dim=-1))                     # [T, H]
        x, residual = self._block_forward(self, positions, x, None, kv_cache, meta)
        x, _ = self.shared_head.norm(x, residual)                       # fused add + norm
        return x

    def logits(self, h: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        """``h [N, H]`` (from :meth:`forward`) -> ``[N, vocab]`` logits (model dtype unless ``upcast``)."""
        return self.shared_head.head(h, upcast)


def build_mtp_layers(model, cfg: dict[str, Any], make_layer) -> int:
    """On the last stage of a model built with :data:`~zpp.spec_config.MTP_LAYERS_KEY` in its
    config: append the MTP layer(s) to ``model.model.layers`` (global indices ``N ..``, so their
    checkpoint names index straight in); ``make_layer(i)`` builds decoder layer ``i``. Returns how
    many were built (0 elsewhere)."""
    n = int(cfg.get(MTP_LAYERS_KEY) or 0)
    if not n or not model.stage.is_last:
        return 0
    shared = model.model.embed_tokens if model.stage.is_first else None
    eps = cfg.get("rms_norm_eps", 1e-6)
    for i in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + n):
        model.model.layers.append(DeepseekMTPLayer(make_layer(i), cfg["hidden_size"], cfg["vocab_size"], eps, shared))
    return n


def mtp_weight_targets(model, name: str) -> Optional[list[tuple[str, Optional[int]]]]:
    """The MTP layers' embedding (the main model's, see the module docstring): ``model.embed_tokens``
    goes to each layer's copy on a last stage that is not the first, and the checkpoint's per-layer
    copies are skipped. ``None`` for every other name (the caller maps it)."""
    N = int(model.cfg["num_hidden_layers"])
    if name == "model.embed_tokens.weight" and not model.stage.is_first:
        return [(f"model.layers.{i}.embed_tokens.weight", None) for i in range(N, N + model.num_mtp_layers)]
    if name.endswith(".embed_tokens.weight") and name.startswith("model.layers."):
        return []
    return None
