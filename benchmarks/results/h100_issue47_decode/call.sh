#!/usr/bin/env bash
# Issue 47, GPU part (one H100 or H200): in order of importance, each step under its own timeout, all
# logs under OUTDIR (at most 8 files come back):
#  1. Qwen3-30B-A3B batch-1 TPOT, bf16 then FP8, this branch (fused router + fused FP8 down GEMV)
#  2. the GPU tests (FP8 experts per layer, top-5 end to end on fitted models, graphs = eager) and the
#     new kernels' tests on the GPU
#  3. Llama-3-8B shape batch-1 TPOT bf16 / FP8 and the KV-cache blocks lines
#  5. FP8 (and bf16) TPOT with both fusions off (ZPP_MOE_FUSED_ROUTER=0 ZPP_FP8_MOE_FUSED_DOWN=0)
#  4. the MoE decode kernels in CUDA graphs (router, fused down sweep)
# (steps after 3 only while the call's time allows: SECONDS guards)
#  6. where the FP8 Qwen step goes, kernel by kernel; the Llama FP8 step likewise
# Usage: bash benchmarks/results/h100_issue47_decode/call.sh OUTDIR
# OUTDIR gets call.txt (the summary, as it goes) and all.tgz (every log and JSON, re-packed after each
# step: a lent machine returns at most 8 files).
set -u
R=${1:?OUTDIR}; O=$(mktemp -d); mkdir -p "$O/q" "$O/l" "$O/off"; L="$R/call.txt"
pack() { tar -czf "$R/all.tgz" -C "$O" . ; }
F="it/s\]|s/it\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"; cat COMMIT47 2>/dev/null | tee -a "$L"
echo "### 1 Qwen3-30B-A3B batch 1 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 150 bash scripts/gpu_moe_bench.sh "$O/q" q-lat-bf16 q-lat-fp8 2>&1 | tee -a "$O/q/out.txt" | grep -E "TPOT|LATE|###|Error|error" | cut -c1-200 | tee -a "$L"; pack
echo "### 2 GPU tests (SECONDS=$SECONDS)" | tee -a "$L"
timeout 170 python -m pytest tests/gpu/test_fp8_moe_gpu.py tests/models/layers/test_moe_decode_kernels.py -q -rA \
  -p no:cacheprovider --durations=12 -k "not deepseek_v3_fp8_block" 2>&1 | grep -v -E "$F" | tee "$O/pytest.txt" | tail -30 | tee -a "$L"; pack
echo "### 3 Llama-3-8B batch 1 (SECONDS=$SECONDS)" | tee -a "$L"
timeout 120 bash scripts/gpu_fp8_bench.sh "$O/l" lat-bf16 lat-fp8 blocks 2>&1 | tee -a "$O/l/out.txt" | grep -E "TPOT|LATE|###|KV cache blocks|Error" | cut -c1-200 | tee -a "$L"; pack
echo "### 5 fusions off (SECONDS=$SECONDS)" | tee -a "$L"
[ "$SECONDS" -lt 300 ] && ZPP_MOE_FUSED_ROUTER=0 ZPP_FP8_MOE_FUSED_DOWN=0 timeout 60 bash scripts/gpu_moe_bench.sh "$O/off" q-lat-fp8 2>&1 | tee -a "$O/off/out.txt" | grep -E "TPOT|LATE" | cut -c1-200 | tee -a "$L"; pack
if [ "$SECONDS" -lt 380 ]; then
  ZPP_MOE_FUSED_ROUTER=0 timeout 50 bash scripts/gpu_moe_bench.sh "$O/off" q-lat-bf16 2>&1 | tee -a "$O/off/out.txt" | grep -E "TPOT|LATE" | cut -c1-200 | tee -a "$L"; pack
fi
echo "### 4 MoE decode kernels (SECONDS=$SECONDS)" | tee -a "$L"
[ "$SECONDS" -lt 330 ] && timeout 70 python scripts/moe_decode_bench.py --json "$O/moe_decode_bench.json" 2>&1 | tee "$O/moe_decode_bench.txt" | grep -v "sweep:" | tee -a "$L"; pack
echo "### 6 profiles (SECONDS=$SECONDS)" | tee -a "$L"
if [ "$SECONDS" -lt 420 ]; then
  timeout 55 python scripts/gpu_decode_profile.py scripts/configs/qwen3-30b-a3b --fp8 --rows 30 2>&1 | grep -v -E "$F" | tee "$O/profile.txt" | grep "replay" | tee -a "$L"; pack
fi
if [ "$SECONDS" -lt 460 ]; then
  timeout 40 python scripts/gpu_decode_profile.py scripts/configs/llama3-8b --fp8 --rows 20 2>&1 | grep -v -E "$F" | tee -a "$O/profile.txt" | grep "replay" | tee -a "$L"; pack
fi
echo "done SECONDS=$SECONDS" | tee -a "$L"; pack
