#!/usr/bin/env bash
# CPU throughput with and without one busy process on the machine (issue #28, item 2):
#   bash scripts/cpu_contention_bench.sh [OUTDIR] [TAG]
# For PP = 1 and PP = 2: `zpp bench throughput` on the demo model (real SmolLM2-135M), 32 prompts x
# 64 in / 32 out, one call quiet, then one call with `python -c "while True: pass"` running beside it
# (started just before, killed just after). Before every call it waits until the 1-minute load
# average is below 0.5, so that no figure is taken under someone else's load; after
# $ZPP_BENCH_WAIT_S seconds (default 600) it gives up with status 1 (ZPP_BENCH_NO_WAIT=1: no wait).
# Extra arguments for every call: $ZPP_BENCH_ARGS; only some PP sizes: ZPP_BENCH_PP="1". Variables
# such as OMP_WAIT_POLICY, GOMP_SPINCOUNT, ZPP_CPU_ADAPTIVE_THREADS pass through to zpp.
# Prints "pp quiet loaded ratio" per PP (and the stages' thread lines on stderr), writes
# OUTDIR/cpu_contention_TAG.json (TAG default: default) and the raw JSON of each call.
set -u
OUT="${1:-benchmarks/results}"
TAG="${2:-default}"
mkdir -p "$OUT"
M=$(python -c "from zpp.demo import prepare_demo_model as p; print(p(progress=False))")
SHAPE="--num-prompts 32 --input-len 64 --output-len 32"

wait_quiet() {  # a figure taken under someone else's load is worthless: wait, or stop
  [ "${ZPP_BENCH_NO_WAIT:-0}" = 1 ] && return 0
  local waited=0
  until awk '{exit !($1 < 0.5)}' /proc/loadavg; do
    if [ "$waited" -ge "${ZPP_BENCH_WAIT_S:-600}" ]; then
      echo "load average still $(cut -d' ' -f1 /proc/loadavg) after ${waited}s: not measuring" >&2; return 1
    fi
    sleep 5; waited=$((waited + 5))
  done
}

run() {  # $1 pp, $2 quiet|loaded -> prints output tok/s
  local json="$OUT/cpu_contention_${TAG}_pp$1_$2.json" busy=""
  wait_quiet || return 1
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
  grep -hoE "CPU (stages|threads) .*" "$OUT/.cpu_contention_$$.log" | sed "s/^/  pp $1 $2: /" >&2
  rm -f "$OUT/.cpu_contention_$$.log"
  python -c "import json,sys; print(round(json.load(open(sys.argv[1]))['output_tokens_per_s'], 1))" "$json"
}

SUMMARY="{"
for PP in ${ZPP_BENCH_PP:-1 2}; do
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
