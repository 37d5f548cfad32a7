#!/usr/bin/env bash
# The 1000 x 256/256 throughput run of the README on one H200, A/B in one call (a GPU figure is only
# real as a ratio measured in the same call):
#   bash scripts/gpu_tput_ab.sh OUTDIR BASEDIR "ARM ARM ..."
# BASEDIR holds an older zpp/ package (e.g. `git archive <commit> zpp | tar -x -C .base`). Arms, run in
# the order given (repeat one to see the spread; the first run of a tree also compiles its Triton
# kernel variants, so compare later rounds): base (BASEDIR's zpp), new (this tree), nosplit (this tree,
# ZPP_SPLIT_MIXED_ATTENTION=0), expseg (this tree, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),
# hf (HF transformers `generate`, batch 256). ARM:t traces that run (ZPP_TRACE, summarised by
# scripts/trace_report.py). JSON and traces land in OUTDIR; the table is printed last.
set -u
OUT="${1:?OUTDIR}"; BASE="${2:?BASEDIR}"; ARMS="${3:-base new base new:t hf}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L3=$PWD/scripts/configs/llama3-8b
OUT=$(cd "$OUT" && pwd); BASE=$(cd "$BASE" && pwd)
ARGS="--model $L3 --load-format dummy --device cuda --num-prompts 1000 --input-len 256 --output-len 256"
ZARGS="$ARGS --max-num-seqs 1024 --max-num-batched-tokens 8192"
declare -A seen
for spec in $ARMS; do
  arm=${spec%%:*}; seen[$arm]=$(( ${seen[$arm]:-0} + 1 )); name="${arm}_${seen[$arm]}"
  envs=(); dir=.; args=$ZARGS
  [ "$spec" != "$arm" ] && envs+=("ZPP_TRACE=$OUT/trace_$name")
  case $arm in
    base) dir=$BASE ;;
    nosplit) envs+=(ZPP_SPLIT_MIXED_ATTENTION=0) ;;
    expseg) envs+=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) ;;
    hf) args="$ARGS --backend hf --hf-max-batch-size 256" ;;
  esac
  echo "### $name ${envs[*]}"
  (cd "$dir" && env "${envs[@]}" python -m zpp.cli bench throughput $args --output-json "$OUT/tput_$name.json" 2>&1) \
    | grep -v -E "it/s\]|s/it\]" | grep -E "tokens/s|busy|Elapsed|rror"
done
for d in "$OUT"/trace_*; do
  [ -d "$d" ] && { echo "### $(basename "$d")"; python scripts/trace_report.py "$d" | head -8; }
done
python - "$OUT" <<'PY'
import glob, json, os, sys
rows = {os.path.basename(p)[5:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/tput_*.json"))}
hf = next((v["output_tokens_per_s"] for k, v in rows.items() if k.startswith("hf")), None)
print(f"{'run':14} {'out tok/s':>10} {'elapsed s':>9} {'busy':>5} {'x HF':>5}")
for k, v in rows.items():
    busy = v.get("stage_busy_fraction") or [0]
    print(f"{k:14} {v['output_tokens_per_s']:10.0f} {v['elapsed_s']:9.2f} {busy[0]:5.2f} "
          f"{v['output_tokens_per_s'] / hf if hf else 0:5.2f}")
PY
