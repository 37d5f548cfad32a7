#!/usr/bin/env bash
# The GPU measurements of the README, in one go (run on a machine with one H200):
#   bash scripts/gpu_bench.sh OUTDIR
# Writes JSON per benchmark into OUTDIR and prints the tables.
set -u
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L3=scripts/configs/llama3-8b
SMOL=scripts/configs/smollm2-135m
run() { echo "### $*"; "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -25; }
run python -m zpp.cli bench latency --model $L3 --load-format dummy --device cuda --batch-size 1 \
    --input-len 128 --output-len 128 --output-json "$OUT/latency_llama3-8b_bs1.json"
run python -m zpp.cli bench latency --model $SMOL --load-format dummy --device cuda --batch-size 1 \
    --input-len 128 --output-len 128 --output-json "$OUT/latency_smollm2_bs1.json"
run python -m zpp.cli bench throughput --model $L3 --load-format dummy --device cuda --num-prompts 1000 \
    --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192 \
    --output-json "$OUT/throughput_llama3-8b_zpp.json"
run python -m zpp.cli bench throughput --model $L3 --load-format dummy --device cuda --num-prompts 1000 \
    --input-len 256 --output-len 256 --backend hf --hf-max-batch-size 256 \
    --output-json "$OUT/throughput_llama3-8b_hf.json"
