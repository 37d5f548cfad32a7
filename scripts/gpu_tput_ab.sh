#!/usr/bin/env bash
# The 1000 x 256/256 throughput run of the README on one H200, A/B in one call (a GPU figure is only
# real as a ratio measured in the same call):
#   bash scripts/gpu_tput_ab.sh OUTDIR BASEDIR [ROUNDS]
# BASEDIR holds an older zpp/ package (e.g. `git archive <commit> zpp | tar -x -C .base`); each round
# runs it and this tree back to back (the first round traced: ZPP_TRACE, summarised by
# scripts/trace_report.py), then this tree with ZPP_SPLIT_MIXED_ATTENTION=0 and HF transformers
# `generate` (batch 256) once. JSON and traces land in OUTDIR; the table is printed last.
set -u
OUT="${1:?OUTDIR}"; BASE="${2:?BASEDIR}"; ROUNDS="${3:-2}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L3=$PWD/scripts/configs/llama3-8b
OUT=$(cd "$OUT" && pwd); BASE=$(cd "$BASE" && pwd)
ARGS="--model $L3 --load-format dummy --device cuda --num-prompts 1000 --input-len 256 --output-len 256"
ZARGS="$ARGS --max-num-seqs 1024 --max-num-batched-tokens 8192"
run() {  # run NAME DIR [ENV=VAL ...] CMD...: CMD in DIR (python -m imports zpp from the working directory)
  local name=$1 dir=$2; shift 2
  echo "### $name"
  (cd "$dir" && env "$@" --output-json "$OUT/tput_$name.json" 2>&1) | grep -v -E "it/s\]|s/it\]" \
    | grep -E "tokens/s|busy|Elapsed|rror"
}
for r in $(seq 1 "$ROUNDS"); do
  tr=""; [ "$r" = 1 ] && tr=1
  run "base_$r" "$BASE" ${tr:+ZPP_TRACE=$OUT/trace_base} python -m zpp.cli bench throughput $ZARGS
  run "new_$r" . ${tr:+ZPP_TRACE=$OUT/trace_new} python -m zpp.cli bench throughput $ZARGS
done
run "new_nosplit" . ZPP_SPLIT_MIXED_ATTENTION=0 python -m zpp.cli bench throughput $ZARGS
run "hf" . python -m zpp.cli bench throughput $ARGS --backend hf --hf-max-batch-size 256
for t in base new; do
  [ -d "$OUT/trace_$t" ] && { echo "### trace $t"; python scripts/trace_report.py "$OUT/trace_$t" | head -8; }
done
python - "$OUT" <<'PY'
import glob, json, os, sys
rows = {os.path.basename(p)[5:-5]: json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/tput_*.json"))}
hf = rows.get("hf", {}).get("output_tokens_per_s")
print(f"{'run':14} {'out tok/s':>10} {'elapsed s':>9} {'busy':>5} {'x HF':>5}")
for k, v in rows.items():
    busy = v.get("stage_busy_fraction") or [0]
    print(f"{k:14} {v['output_tokens_per_s']:10.0f} {v['elapsed_s']:9.2f} {busy[0]:5.2f} "
          f"{v['output_tokens_per_s'] / hf if hf else 0:5.2f}")
PY
