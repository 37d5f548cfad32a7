#!/usr/bin/env bash
# Session 26, issue 47 item 7 (LM head GEMV, H100 qkv launch): Llama-3-8B batch-1 TPOT, bf16 and FP8, twice each,
# interleaved. Usage: bash benchmarks/results/s26_gpu/call1.sh OUTDIR
set -u
R=${1:?OUTDIR}; L="$R/call.txt"; mkdir -p "$R/l"
F="it/s\]|s/it\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"
C="python -m zpp.cli bench latency --model scripts/configs/llama3-8b --load-format dummy --device cuda --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5"
for run in fp8-1 bf16-1 fp8-2 bf16-2; do
  echo "### $run (SECONDS=$SECONDS)" | tee -a "$L"
  case $run in
    bf16*) timeout 70 $C --output-json "$R/l/$run.json" ;;
    fp8*) timeout 70 $C --quantization fp8 --output-json "$R/l/$run.json" ;;
  esac 2>&1 | grep -v -E "$F" >> "$R/l/out.txt"; grep -E "TPOT|Error" "$R/l/out.txt" | tail -1 | tee -a "$L"
done
echo "done SECONDS=$SECONDS" | tee -a "$L"
