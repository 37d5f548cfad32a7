#!/usr/bin/env bash
# Issue 48 end to end, GPU call 1 (one H100 or H200): gpt-oss-20b batch-1 bf16 vs MXFP4, the
# gpt-oss-120b MXFP4 start-up at 80 GB worth of memory, the 4-bit GPU tests, then (if time is left)
# the 20b 1000 x 256/256 pair. Usage: bash call1.sh OUTDIR
set -u
O=${1:?OUTDIR}; mkdir -p "$O/bench"; L="$O/call.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"
for r in o20-lat-bf16 o20-lat-mxfp4; do
  timeout 75 bash scripts/gpu_w4_bench.sh "$O/bench" $r 2>&1 | tee -a "$L" | grep -E "TPOT|LATE|###|rror|weights" | cut -c1-250
done
echo "### o120 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 110 bash scripts/gpu_w4_bench.sh "$O/bench" o120-mxfp4 2>&1 | tee -a "$L" | grep -E "TPOT|LATE|###|rror|weights|memory" | cut -c1-250
echo "### pytest tests/gpu/test_w4_gpu.py (SECONDS=$SECONDS)" | tee -a "$L"
ZPP_W4_FIT_STEPS=120 timeout 150 python -m pytest tests/gpu/test_w4_gpu.py -q -rA -p no:cacheprovider 2>&1 \
  | grep -v -E "it/s\]|s/it\]" > "$O/pytest.txt"; tail -25 "$O/pytest.txt" | cut -c1-400
if [ "$SECONDS" -lt 250 ]; then  # both or neither (a ratio of one call)
  for r in o20-tput-bf16 o20-tput-mxfp4; do
    echo "### $r (SECONDS=$SECONDS)" | tee -a "$L"
    timeout 95 bash scripts/gpu_w4_bench.sh "$O/bench" $r 2>&1 | tee -a "$L" | grep -E "tok/s|LATE|###|rror|weights" | cut -c1-250
  done
fi
echo "done SECONDS=$SECONDS" | tee -a "$L"
cd "$O" && tar czf bench_runs.tgz bench/runs.log bench/weights.txt && rm -f bench/runs.log bench/weights.txt
