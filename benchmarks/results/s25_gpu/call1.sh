#!/usr/bin/env bash
# Session 25, first GPU call (one H100 or H200): issue 47 item 7 (Llama-3-8B batch-1 TPOT, bf16 and
# FP8), Qwen3-30B-A3B batch-1 at today's defaults, the dummy-quantized GPU test, issue 50's verify
# cost and MTP draft cost. Usage: bash benchmarks/results/s25_gpu/call1.sh OUTDIR
set -u
R=${1:?OUTDIR}; L="$R/call.txt"; mkdir -p "$R/l" "$R/q"
F="it/s\]|s/it\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"; git log --oneline -1 2>/dev/null | tee -a "$L"
echo "### Llama-3-8B batch 1 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 140 bash scripts/gpu_fp8_bench.sh "$R/l" lat-bf16 lat-fp8 2>&1 | grep -v -E "$F" > "$R/l/out.txt"; grep -E "TPOT|LATE|###|Error" "$R/l/out.txt" | cut -c1-200 | tee -a "$L"
echo "### Qwen3-30B-A3B batch 1 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 150 bash scripts/gpu_moe_bench.sh "$R/q" q-lat-bf16 q-lat-fp8 2>&1 | grep -v -E "$F" > "$R/q/out.txt"; grep -E "TPOT|LATE|###|Error" "$R/q/out.txt" | cut -c1-200 | tee -a "$L"
echo "### verify cost (SECONDS=$SECONDS)" | tee -a "$L"
timeout 100 python scripts/gpu_verify_cost.py scripts/configs/llama3-8b --steps 30 --out "$R/verify_cost.json" 2>&1 | grep -v -E "$F" | tail -25 | tee -a "$L"
echo "### MTP draft cost (SECONDS=$SECONDS)" | tee -a "$L"
timeout 80 python scripts/gpu_mtp_draft_cost.py 2>&1 | grep -v -E "$F" | tail -15 | tee -a "$L"
echo "### dummy quantized GPU test (SECONDS=$SECONDS)" | tee -a "$L"
[ "$SECONDS" -lt 480 ] && timeout 90 python -m pytest tests/gpu/test_dummy_quantized_gpu.py -q -rA -p no:cacheprovider 2>&1 | grep -v -E "$F" | tail -15 | tee -a "$L"
echo "done SECONDS=$SECONDS" | tee -a "$L"
tar -czf "$R/logs.tgz" -C "$R" l q 2>/dev/null
