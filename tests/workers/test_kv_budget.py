"""The KV cache budget of a CUDA stage (zpp.workers.kv_budget.cuda_kv_budget), alone on its GPU or
sharing it with the other stages (ZPP_SHARE_GPU): pure arithmetic, run on the CPU."""
from zpp.workers.kv_budget import CUDA_CONTEXT_MARGIN, cuda_kv_budget

GIB = 1 << 30
H200 = 139 * GIB


def test_alone_on_the_gpu_takes_what_utilization_leaves_after_others():
    # 2 GiB held by another process, 1 GiB reserved by this one, 20 GiB peak
    free = H200 - 2 * GIB - 1 * GIB
    got = cuda_kv_budget(H200, free, 1 * GIB, 20 * GIB, 0.9, 512 << 20)
    assert got == int(H200 * 0.9 - 20 * GIB - 2 * GIB - (512 << 20))


def test_shared_gpu_splits_it_and_the_stages_budgets_fit_together():
    # Two stages of a Llama-3-8B shape on one H200: each 8 GiB of weights and a 4 GiB profile peak.
    # Stage 1 measures while stage 0 already holds 60 GiB: what it sees of the GPU must not matter.
    peak = 12 * GIB
    b0 = cuda_kv_budget(H200, H200 - 13 * GIB, 12 * GIB, peak, 0.9, 512 << 20, stages_on_gpu=2)
    b1 = cuda_kv_budget(H200, H200 - 73 * GIB, 12 * GIB, peak, 0.9, 512 << 20, stages_on_gpu=2)
    assert b0 == b1 > 0
    held = 2 * (peak + b0 + (512 << 20) + CUDA_CONTEXT_MARGIN)
    assert held <= H200 * 0.9
    # the unshared rule would have given each stage nearly the whole GPU (the OOM at start-up)
    assert cuda_kv_budget(H200, H200 - 13 * GIB, 12 * GIB, peak, 0.9, 512 << 20) > H200 * 0.9 / 2


def test_a_restarted_stage_measures_the_same_share():
    # after a restart the surviving stage's memory is already taken: the share does not shrink
    first = cuda_kv_budget(H200, H200 - 10 * GIB, 9 * GIB, 9 * GIB, 0.9, 0, stages_on_gpu=3)
    again = cuda_kv_budget(H200, H200 - 100 * GIB, 9 * GIB, 9 * GIB, 0.9, 0, stages_on_gpu=3)
    assert first == again


def test_nothing_fits_is_negative():
    assert cuda_kv_budget(16 * GIB, 15 * GIB, GIB, 15 * GIB, 0.9, 0, stages_on_gpu=2) < 0


def test_decode_graph_buckets_reach_max_num_seqs_up_to_4096():
    from zpp.workers.cuda_graphs import MAX_GRAPH_BATCH, capture_sizes
    assert capture_sizes(256)[-1] == 256 and capture_sizes(1)[-1] == 1
    # a 30k-prompt run at --max-num-seqs 2048 decodes 2048 sequences per step: graphed, not eager
    sizes = capture_sizes(2048)
    assert sizes[-1] == 2048 and 1024 in sizes and sizes == sorted(set(sizes))
    assert capture_sizes(1500)[-1] == 1500 and 1280 in capture_sizes(1500)
    assert capture_sizes(10_000)[-1] == MAX_GRAPH_BATCH == 4096
    # every batch size up to max_num_seqs has a bucket
    for n in (3, 1000, 1025, 1999, 2048):
        assert any(s >= n for s in capture_sizes(2048))


def test_graph_margin_grows_with_buckets_above_1024_only():
    from zpp.workers.cuda_graphs import graph_pool_margin
    row = 128256 * 2  # Llama-3 logits row, bf16
    assert graph_pool_margin(256, row) == graph_pool_margin(1024, row) == 512 << 20
    assert graph_pool_margin(2048, row) == (512 << 20) + row * (1280 + 1536 + 1792 + 2048)
