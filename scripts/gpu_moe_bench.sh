#!/usr/bin/env bash
# FP8 experts (issue 47) on one Hopper GPU, bf16 and FP8 in the same call (a GPU figure is only real
# as a ratio measured in one call):
#   bash scripts/gpu_moe_bench.sh OUTDIR [RUN...]
# Runs (default: all, in this order):
#   q-tput-bf16 q-tput-fp8   Qwen3-30B-A3B shape (scripts/configs/qwen3-30b-a3b), 1000 x 256/256
#                            (acceptance: fp8 >= 1.3x bf16 out tok/s), --quantization fp8
#   q-lat-bf16 q-lat-fp8     the same shape at batch 1, 128 in / 128 out (acceptance: fp8 TPOT <= 0.75x bf16)
#   d-bf16 d-fp8             DeepSeek-V3 shape cut to 5 layers (3 dense + 2 MoE, 256 experts):
#                            scripts/configs/deepseek-v3-5l (bf16) and -fp8 (its block 128x128
#                            quantization_config), batch 1 (acceptance: fp8 weight GiB <= 0.55x bf16)
# Weights are random (--load-format dummy). Each start-up's "stage ...: weights <dtype GiB>; KV cache
# N tokens" line is kept in OUTDIR/weights.txt; JSON per run in OUTDIR; a table at the end.
set -u
OUT="${1:?OUTDIR}"; shift
RUNS="${*:-q-tput-bf16 q-tput-fp8 q-lat-bf16 q-lat-fp8 d-bf16 d-fp8}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
Q="--model scripts/configs/qwen3-30b-a3b --load-format dummy --device cuda"
D="--load-format dummy --device cuda"
FP8="--quantization fp8"
TPUT="--num-prompts 1000 --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192"
LAT="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3"
source "$(dirname "$0")/gpu_bench_lib.sh"
for r in $RUNS; do
  case $r in
    q-tput-bf16) run $r python -m zpp.cli bench throughput $Q $TPUT --output-json "$OUT/tput_qwen3-30b-a3b_bf16.json" ;;
    q-tput-fp8) run $r python -m zpp.cli bench throughput $Q $TPUT $FP8 --output-json "$OUT/tput_qwen3-30b-a3b_fp8.json" ;;
    q-lat-bf16) run $r python -m zpp.cli bench latency $Q $LAT --output-json "$OUT/lat_qwen3-30b-a3b_bf16.json" ;;
    q-lat-fp8) run $r python -m zpp.cli bench latency $Q $LAT $FP8 --output-json "$OUT/lat_qwen3-30b-a3b_fp8.json" ;;
    d-bf16) run $r python -m zpp.cli bench latency --model scripts/configs/deepseek-v3-5l $D $LAT \
        --output-json "$OUT/lat_deepseek-v3-5l_bf16.json" ;;
    d-fp8) run $r python -m zpp.cli bench latency --model scripts/configs/deepseek-v3-5l-fp8 $D $LAT \
        --output-json "$OUT/lat_deepseek-v3-5l_fp8.json" ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
done
summarize "$OUT"
