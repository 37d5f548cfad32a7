#!/usr/bin/env bash
# CPU throughput with and without one busy process on the machine (issue #28, item 2):
#   bash scripts/cpu_contention_bench.sh [OUTDIR] [TAG]
# For PP = 1 and PP = 2: `zpp bench throughput` on the demo model (real SmolLM2-135M), 32 prompts x
# 64 in / 32 out, one call quiet, then one call with `python -c "while True: pass"` running beside it
# (started just before, killed just after). Before every call it waits (up to 10 min) until the
# 1-minute load average is below 0.5, so that neither figure is taken under someone else's load
# (ZPP_BENCH_NO_WAIT=1 skips the wait). Extra arguments for every call: $ZPP_BENCH_ARGS. Environment
# variables such as OMP_WAIT_POLICY / GOMP_SPINCOUNT / ZPP_CPU_ADAPTIVE_THREADS pass through to zpp.
# Prints "pp quiet loaded ratio" per PP and writes OUTDIR/cpu_contention_TAG.json (TAG default: default)
# plus the raw JSON of each call.
set -u
OUT="${1:-benchmarks/results}"
TAG="${2:-default}"
mkdir -p "$OUT"
M=$(python -c "from zpp.demo import prepare_demo_model as p; print(p(progress=False))")
SHAPE="--num-prompts 32 --input-len 64 --output-len 32"

wait_quiet() {
  [ "${ZPP_BENCH_NO_WAIT:-0}" = 1 ] && return 0
  for _ in $(seq 1 120); do
    awk '{exit !($1 < 0.5)}' /proc/loadavg && return 0
    sleep 5
  done
  echo "warning: load average still $(cut -d' ' -f1 /proc/loadavg) after 10 min; measuring anyway" >&2
}

run() {  # $1 pp, $2 quiet|loaded -> prints output tok/s
  local json="$OUT/cpu_contention_${TAG}_pp$1_$2.json" busy=""
  wait_quiet
  if [ "$2" = loaded ]; then
    python -c "while True: pass" &
    busy=$!
  fi
  # shellcheck disable=SC2086
  python -m zpp.cli bench throughput --model "$M" --device cpu -pp "$1" $SHAPE ${ZPP_BENCH_ARGS:-} \
    --output-json "$json" > "$OUT/.cpu_contention_$$.log" 2>&1
  local rc=$?
  [ -n "$busy" ] && kill "$busy" && wait "$busy" 2>/dev/null
  if [ $rc -ne 0 ]; then
    echo "zpp bench throughput failed (pp $1, $2):" >&2; tail -20 "$OUT/.cpu_contention_$$.log" >&2
    rm -f "$OUT/.cpu_contention_$$.log"; exit 1
  fi
  rm -f "$OUT/.cpu_contention_$$.log"
  python -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" "$json"
}

SUMMARY="{"
for PP in 1 2; do
  Q=$(run "$PP" quiet) || exit 1
  L=$(run "$PP" loaded) || exit 1
  R=$(python -c "print(round($L / $Q, 3))")
  echo "pp $PP  quiet $Q  loaded $L  ratio $R  (output tok/s)"
  SUMMARY="$SUMMARY\"pp$PP\": {\"quiet_output_tokens_per_s\": $Q, \"loaded_output_tokens_per_s\": $L, \"ratio\": $R},"
done
python - "$OUT/cpu_contention_${TAG}.json" "$SUMMARY" <<'EOF'
import datetime, json, os, sys
data = json.loads(sys.argv[2].rstrip(",") + "}")
data.update(tag=os.path.basename(sys.argv[1])[len("cpu_contention_"):-len(".json")], cores=len(os.sched_getaffinity(0)),
            env={k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "ZPP_"))},
            extra_args=os.environ.get("ZPP_BENCH_ARGS", ""), shape="32 prompts x 64 in / 32 out",
            load="python -c 'while True: pass'", date=datetime.date.today().isoformat())
json.dump(data, open(sys.argv[1], "w"), indent=2)
print("wrote", sys.argv[1])
EOF
