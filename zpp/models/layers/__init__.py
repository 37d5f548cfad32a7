"""Building blocks shared by every model family: norms, rotary, attention over the paged KV cache,
linear layers with per-parameter weight loaders, MLPs."""
