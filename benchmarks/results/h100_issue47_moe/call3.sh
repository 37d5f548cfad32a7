#!/usr/bin/env bash
# Issue 47, GPU call 3 (one H100 or H200): the GPU tests, the Qwen3-30B-A3B batch-1 bf16 vs FP8 A/B
# with the "while serving" lines, the 5-layer DeepSeek-V3 at --max-num-seqs 1 --max-model-len 512,
# and (if time is left) the FP8 throughput run for late compiles. Usage: bash call3.sh OUTDIR
set -u
O=${1:?OUTDIR}; mkdir -p "$O/bench"; L="$O/call3.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"
echo "### pytest tests/gpu/test_fp8_moe_gpu.py tests/gpu/test_decode_launches.py" | tee -a "$L"
timeout 210 python -m pytest tests/gpu/test_fp8_moe_gpu.py tests/gpu/test_decode_launches.py -q -rA \
  -p no:cacheprovider 2>&1 | grep -v -E "it/s\]|s/it\]" | tee -a "$L" | tail -15
echo "### Qwen3-30B-A3B batch 1 (SECONDS=$SECONDS)" | tee -a "$L"
bash scripts/gpu_moe_bench.sh "$O/bench" q-lat-bf16 q-lat-fp8 2>&1 | tee -a "$L" | grep -E "TPOT|LATE|###|Error" 
D5="python -m zpp.cli bench latency --model scripts/configs/deepseek-v3-5l --load-format dummy --device cuda \
  --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3 --max-num-seqs 1 --max-model-len 512"
echo "### d512-bf16 (SECONDS=$SECONDS): $D5" | tee -a "$L"
timeout 90 $D5 2>&1 | grep -v -E "it/s\]|s/it\]" | tee -a "$L" | grep -E "TPOT|while serving|assert|Error|memory profile" | cut -c1-200
if [ "$SECONDS" -lt 250 ]; then
  echo "### q-tput-fp8 (SECONDS=$SECONDS)" | tee -a "$L"
  timeout 100 bash scripts/gpu_moe_bench.sh "$O/bench" q-tput-fp8 2>&1 | tee -a "$L" | grep -E "tok/s|LATE|###|warmed"
fi
echo "### late compiles in this call:" | tee -a "$L"
grep -c "while serving" "$L" "$O/bench/runs.log" | tee -a "$L"
echo "done SECONDS=$SECONDS" | tee -a "$L"
