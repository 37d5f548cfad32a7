#!/usr/bin/env bash
# The new families' GPU figures (issue 24) on one H200, zpp against HF transformers `generate` in
# the same call (a GPU figure is only real as a ratio measured in one call):
#   bash scripts/gpu_models_bench.sh OUTDIR [RUN...]
# Runs (default: all, in this order): lat-q8 lat-q8-hf tput-q8 tput-q8-hf lat-moe lat-moe-hf tput-moe tput-moe-hf
#   q8 = Qwen3-8B shape, moe = Qwen3-30B-A3B shape (scripts/configs), random bf16 weights;
#   lat = batch 1, 128 in / 128 out (TPOT); tput = 1000 x 256/256 (HF: batches of 256; for the MoE
#   shape HF gets 256 prompts, one batch, as its expert loop is slow: tok/s is what is compared).
# JSON per run in OUTDIR; a table at the end.
set -u
OUT="${1:?OUTDIR}"; shift
RUNS="${*:-lat-q8 lat-q8-hf tput-q8 tput-q8-hf lat-moe lat-moe-hf tput-moe tput-moe-hf}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
Q8=scripts/configs/qwen3-8b
MOE=scripts/configs/qwen3-30b-a3b
COMMON="--load-format dummy --device cuda"
LAT="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3"
TPUT="--input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192"
run() { echo "### $*"; "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -12; }
for r in $RUNS; do
  case $r in
    lat-q8) run python -m zpp.cli bench latency --model $Q8 $COMMON $LAT --output-json "$OUT/lat_qwen3-8b_zpp.json" ;;
    lat-q8-hf) run python -m zpp.cli bench latency --model $Q8 $COMMON $LAT --backend hf --output-json "$OUT/lat_qwen3-8b_hf.json" ;;
    tput-q8) run python -m zpp.cli bench throughput --model $Q8 $COMMON $TPUT --num-prompts 1000 --output-json "$OUT/tput_qwen3-8b_zpp.json" ;;
    tput-q8-hf) run python -m zpp.cli bench throughput --model $Q8 $COMMON $TPUT --num-prompts 1000 --backend hf --hf-max-batch-size 256 --output-json "$OUT/tput_qwen3-8b_hf.json" ;;
    lat-moe) run python -m zpp.cli bench latency --model $MOE $COMMON $LAT --output-json "$OUT/lat_qwen3-30b-a3b_zpp.json" ;;
    lat-moe-hf) run python -m zpp.cli bench latency --model $MOE $COMMON $LAT --num-iters 1 --backend hf --output-json "$OUT/lat_qwen3-30b-a3b_hf.json" ;;
    tput-moe) run python -m zpp.cli bench throughput --model $MOE $COMMON $TPUT --num-prompts 1000 --output-json "$OUT/tput_qwen3-30b-a3b_zpp.json" ;;
    tput-moe-hf) run python -m zpp.cli bench throughput --model $MOE $COMMON $TPUT --num-prompts 256 --backend hf --hf-max-batch-size 256 --output-json "$OUT/tput_qwen3-30b-a3b_hf.json" ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
done
python - "$OUT" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    v = d.get("tpot_ms") or d.get("output_tokens_per_s") or d.get("output_throughput")
    print(f"{os.path.basename(f):40s} {'TPOT ms' if 'tpot_ms' in d else 'out tok/s'} {v}")
EOF
