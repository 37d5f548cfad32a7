#!/usr/bin/env bash
# 4-bit releases (issue 48) on one GPU, bf16 and MXFP4 in the same call (a GPU figure is only real as
# a ratio measured in one call):
#   bash scripts/gpu_w4_bench.sh OUTDIR [RUN...]
# Runs (default: all, in this order):
#   o20-lat-bf16 o20-lat-mxfp4    gpt-oss-20b shape at batch 1, 128 in / 128 out: scripts/configs/gpt-oss-20b-bf16
#                                 and scripts/configs/gpt-oss-20b (MXFP4 experts as released)
#                                 (acceptance: mxfp4 TPOT <= 0.6x bf16)
#   o20-tput-bf16 o20-tput-mxfp4  the same shapes, 1000 x 256/256 (acceptance: mxfp4 out tok/s >= 1.0x bf16)
#   o120-mxfp4                    gpt-oss-120b shape MXFP4 (scripts/configs/gpt-oss-120b) at batch 1,
#                                 --max-model-len 32768 (acceptance: weights <= 66 GB on one 80 GB card with
#                                 >= 32k tokens of KV cache). On a card larger than an H100 80GB (81559 MiB)
#                                 --gpu-memory-utilization is scaled so that 0.9 of 81559 MiB is used: the KV
#                                 tokens an 80 GB card would get.
#   l70-lat-w4                    Llama-3-70B shape in compressed-tensors W4A16 (int4, group 128, lm_head bf16:
#                                 scripts/configs/llama3-70b-w4a16) at batch 1, then scripts/w4_tpot_floor.py:
#                                 the TPOT over the packed-weight read floor (acceptance: <= 1.3x)
# Weights are random (--load-format dummy), quantized at load like the release. Each start-up's "stage ...:
# weights <dtype GiB>; KV cache N tokens" line is kept in OUTDIR/weights.txt; JSON per run in OUTDIR; a table
# at the end.
set -u
OUT="${1:?OUTDIR}"; shift
RUNS="${*:-o20-lat-bf16 o20-lat-mxfp4 o20-tput-bf16 o20-tput-mxfp4 o120-mxfp4 l70-lat-w4}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
D="--load-format dummy --device cuda"
O20="scripts/configs/gpt-oss-20b"
TPUT="--num-prompts 1000 --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192"
LAT="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3"
TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
UTIL=$(python -c "t = ${TOTAL_MIB:-81559}; print(0.9 if t <= 81559 else round(0.9 * 81559 / t, 4))")
source "$(dirname "$0")/gpu_bench_lib.sh"
for r in $RUNS; do
  case $r in
    o20-lat-bf16) run $r python -m zpp.cli bench latency --model $O20-bf16 $D $LAT --output-json "$OUT/lat_gpt-oss-20b_bf16.json" ;;
    o20-lat-mxfp4) run $r python -m zpp.cli bench latency --model $O20 $D $LAT --output-json "$OUT/lat_gpt-oss-20b_mxfp4.json" ;;
    o20-tput-bf16) run $r python -m zpp.cli bench throughput --model $O20-bf16 $D $TPUT \
        --output-json "$OUT/tput_gpt-oss-20b_bf16.json" ;;
    o20-tput-mxfp4) run $r python -m zpp.cli bench throughput --model $O20 $D $TPUT \
        --output-json "$OUT/tput_gpt-oss-20b_mxfp4.json" ;;
    o120-mxfp4) echo "gpu memory ${TOTAL_MIB} MiB: --gpu-memory-utilization $UTIL" | tee -a "$OUT/weights.txt"
      run $r python -m zpp.cli bench latency --model scripts/configs/gpt-oss-120b $D --batch-size 1 --input-len 128 \
        --output-len 128 --num-iters-warmup 1 --num-iters 1 --max-model-len 32768 --gpu-memory-utilization "$UTIL" \
        --output-json "$OUT/lat_gpt-oss-120b_mxfp4.json" ;;
    l70-lat-w4) run $r python -m zpp.cli bench latency --model scripts/configs/llama3-70b-w4a16 $D $LAT \
        --max-model-len 4096 --output-json "$OUT/lat_llama3-70b_w4a16.json"
      python scripts/w4_tpot_floor.py scripts/configs/llama3-70b-w4a16 --latency-json "$OUT/lat_llama3-70b_w4a16.json" \
        | tee "$OUT/floor_llama3-70b_w4a16.txt" ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
done
summarize "$OUT"
