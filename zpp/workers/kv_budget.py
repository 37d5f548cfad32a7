"""How much KV cache a stage takes: a CPU stage's ``--kv-cache-memory`` checked against the host,
a CUDA stage's share of ``total x --gpu-memory-utilization`` after profiling its peak, and the
memory a stage reports before loading (``--pp-layer-partition auto``)."""
from __future__ import annotations

import logging
import socket

logger = logging.getLogger("zpp.worker")


def stages_sharing_gpu(config) -> int:
    """How many stages (and TP ranks) share this stage's GPU: all of them under ``ZPP_SHARE_GPU``, else 1."""
    par = config.parallel
    return par.pipeline_parallel_size * par.tensor_parallel_size if par.share_gpu else 1


def usable_gpu_memory(config, device) -> int:
    """Bytes this stage may use on its GPU before loading: ``total x --gpu-memory-utilization`` less
    what other processes and the CUDA context hold (:func:`cuda_kv_budget`'s terms with no peak yet);
    ``1 / stages`` of it where stages share the GPU. 0 on the CPU."""
    if device.type != "cuda":
        return 0
    import torch
    free, total = torch.cuda.mem_get_info(device)
    return max(0, cuda_kv_budget(total, free, torch.cuda.memory_reserved(device), 0,
                                 config.cache.gpu_memory_utilization, 0, stages_sharing_gpu(config)))


def cpu_kv_blocks(kv_cache_memory, per_block: int) -> tuple[int, str]:
    """KV blocks of a CPU stage, ``--kv-cache-memory`` (default 1 GiB) over ``per_block`` bytes, and
    an error for the engine (else empty) when this host does not have that much memory available:
    checked here because the cache's pages are taken only as blocks fill (``zpp.utils.host_memory``)."""
    from zpp.utils.host_memory import available_bytes
    mem = kv_cache_memory if kv_cache_memory is not None else 1 << 30
    free = available_bytes()
    if free is not None and mem > free:
        return 0, (f"--kv-cache-memory: {mem / 2**30:.2f} GiB per stage, but {socket.gethostname()} has only "
                   f"{free / 2**30:.2f} GiB of memory available: lower it")
    return int(mem // per_block), ""


# Memory a CUDA process holds outside PyTorch's allocator (its context, cuBLAS and Triton modules),
# counted per stage where stages share one GPU and so cannot tell the others' memory from their own.
CUDA_CONTEXT_MARGIN = 1 << 30


def cuda_kv_budget(total: int, free: int, reserved: int, peak: int, utilization: float, graphs_margin: int,
                   stages_on_gpu: int = 1) -> int:
    """Bytes of KV cache one stage may take on its GPU (may be negative: nothing fits).

    * ``total``, ``free``: the GPU's memory in bytes (``torch.cuda.mem_get_info``); ``reserved``:
      what this process's allocator holds (``torch.cuda.memory_reserved``); ``peak``: this stage's
      profiled peak (weights, activations, logits, sampler buffers); ``graphs_margin``: bytes kept
      for CUDA graphs.
    * One stage on the GPU (``stages_on_gpu == 1``): ``total x utilization`` less the peak, the
      margin and whatever other processes hold (``total - free - reserved``, the CUDA context too).
    * ``stages_on_gpu`` stages on one GPU (``ZPP_SHARE_GPU``): each gets ``total x utilization /
      stages_on_gpu`` less its own peak, margin and :data:`CUDA_CONTEXT_MARGIN`. Another stage's
      memory is not subtracted (the stages load at the same time, so what the GPU holds at this
      moment depends on who came first); the split depends on nothing but this stage, so a
      restarted stage measures the same budget.
    """
    if stages_on_gpu > 1:
        return int(total * utilization / stages_on_gpu - peak - graphs_margin - CUDA_CONTEXT_MARGIN)
    others = total - free - reserved  # other processes / CUDA context
    return int(total * utilization - peak - others - graphs_margin)


def cuda_kv_blocks(init, runner, device, per_block: int) -> int:
    """KV blocks that fit on this GPU: ``--kv-cache-memory`` if given, else this stage's share of
    ``total x --gpu-memory-utilization`` after a profiling pass of the largest micro-batch
    (:func:`cuda_kv_budget`)."""
    import torch
    cfg_all = init.config
    if cfg_all.cache.kv_cache_memory is not None:
        return cfg_all.cache.kv_cache_memory // per_block
    sharing = stages_sharing_gpu(cfg_all)
    tokens = cfg_all.max_num_batched_tokens
    peak = runner.profile_peak_memory(tokens, min(cfg_all.scheduler.max_num_seqs, tokens))
    free, total = torch.cuda.mem_get_info(device)
    graphs_margin = 0
    if not cfg_all.enforce_eager:
        from zpp.workers.cuda_graphs import graph_pool_margin
        model = runner.model
        row_bytes = (model.lm_head.weight.shape[0] if model.stage.produces_results and hasattr(model, "lm_head")
                     else model.num_acts * model.hidden_size) * runner.dtype.itemsize
        graphs_margin = graph_pool_margin(cfg_all.scheduler.max_num_seqs, row_bytes)
    budget = cuda_kv_budget(total, free, torch.cuda.memory_reserved(device), peak,
                            cfg_all.cache.gpu_memory_utilization, graphs_margin, sharing)
    logger.info("memory profile: peak %.2f GiB, KV budget %.2f GiB%s", peak / 2**30, budget / 2**30,
                f" (1/{sharing} of the GPU: {sharing} stages share it)" if sharing > 1 else "")
    return int(max(0, budget) // per_block)
