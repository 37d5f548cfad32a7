# Shared by the GPU bench scripts (gpu_moe_bench.sh, gpu_w4_bench.sh): source it after setting OUT.

run() {  # NAME CMD...: the whole log appended to $OUT/runs.log; the weights line and the figures printed
  local name=$1; shift
  echo "### $name: $*" | tee -a "$OUT/runs.log"
  local log; log=$(mktemp)
  "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" > "$log"
  cat "$log" >> "$OUT/runs.log"
  grep -E "weights .* GiB; KV cache|memory profile|layers quantized" "$log" | sed "s/^/$name: /" | cut -c1-300 \
    | tee -a "$OUT/weights.txt"
  grep -E "while serving" "$log" | sed 's/^/LATE COMPILE: /' | cut -c1-200
  grep -E "Error|error:" "$log" | head -5 | cut -c1-300
  tail -6 "$log"
  rm -f "$log"
}

summarize() {  # OUTDIR: one line per JSON result (TPOT or output tokens per second)
  python - "$1" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    v = d.get("tpot_ms") or d.get("output_tokens_per_s") or d.get("output_throughput")
    print(f"{os.path.basename(f):40s} {'TPOT ms' if 'tpot_ms' in d else 'out tok/s'} {v}")
PY
}
