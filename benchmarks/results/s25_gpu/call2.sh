#!/usr/bin/env bash
# Session 25, issue 47 item 7: the batch-1 GEMV launches swept on the card at hand (written to a
# ZPP_FP8_GEMV_CONFIG_FILE), then Llama-3-8B batch-1 TPOT: bf16, FP8 default, FP8 with the swept
# launches and the in-kernel split merge. Usage: bash benchmarks/results/s25_gpu/call2.sh OUTDIR
set -u
R=${1:?OUTDIR}; L="$R/call.txt"; mkdir -p "$R/l"
F="it/s\]|s/it\]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$L"
timeout 220 python scripts/fp8_gemv_card_sweep.py --quick --json "$R/sweep.json" --write-config "$R/tuned.json" 2>&1 | grep -v -E "$F" > "$R/sweep.txt"
grep -v "^  " "$R/sweep.txt" | grep -v "^{" | tee -a "$L"; cat "$R/tuned.json" >> "$L"
C="python -m zpp.cli bench latency --model scripts/configs/llama3-8b --load-format dummy --device cuda --batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5"
for run in bf16 fp8 fp8-tuned-merge; do
  echo "### $run (SECONDS=$SECONDS)" | tee -a "$L"
  case $run in
    bf16) timeout 70 $C --output-json "$R/l/bf16.json" ;;
    fp8) timeout 70 $C --quantization fp8 --output-json "$R/l/fp8.json" ;;
    fp8-tuned-merge) ZPP_FP8_GEMV_CONFIG_FILE="$R/tuned.json" ZPP_ATTN_FUSED_MERGE=1 timeout 70 $C --quantization fp8 --output-json "$R/l/fp8_tuned_merge.json" ;;
  esac 2>&1 | grep -v -E "$F" >> "$R/l/out.txt"; grep -E "TPOT|Error" "$R/l/out.txt" | tail -1 | tee -a "$L"
done
echo "done SECONDS=$SECONDS" | tee -a "$L"
