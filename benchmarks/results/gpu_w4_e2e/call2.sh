#!/usr/bin/env bash
# Issue 48 end to end, GPU call 2 (one H100 or H200): the Llama-3-70B shape in W4A16 (int4 g128) at
# batch 1 and its packed-weight read floor (acceptance: TPOT <= 1.3x the floor), then the 20b
# throughput pair if call 1 had no time for it. Usage: bash call2.sh OUTDIR
set -u
O=${1:?OUTDIR}; mkdir -p "$O/bench"; L="$O/call.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"
echo "### l70 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 240 bash scripts/gpu_w4_bench.sh "$O/bench" l70-lat-w4 2>&1 | tee -a "$L" | grep -E "TPOT|LATE|###|rror|weights|floor" | cut -c1-300
if [ "${TPUT20:-0}" = 1 ]; then
  for r in o20-tput-bf16 o20-tput-mxfp4; do
    echo "### $r (SECONDS=$SECONDS)" | tee -a "$L"
    timeout 150 bash scripts/gpu_w4_bench.sh "$O/bench" $r 2>&1 | tee -a "$L" | grep -E "tok/s|LATE|###|rror|weights" | cut -c1-250
  done
fi
echo "done SECONDS=$SECONDS" | tee -a "$L"
cd "$O" && tar czf bench_runs.tgz bench/runs.log bench/weights.txt && rm -f bench/runs.log bench/weights.txt
