#!/usr/bin/env bash
# zpp serve against the offline engine on the CPU, same call (issue #12's CPU figure):
#   bash scripts/cpu_bench_serve.sh [OUTDIR] [ROUNDS]
# SmolLM2-135M (the demo model, real weights), PP=2, 32 prompts x 64 in / 32 out, the same engine
# flags on both paths (2048 tokens per micro-batch). One server stays up; each round runs the offline
# engine (`zpp bench throughput`) and then `zpp bench serve` against the server, so that both figures
# of a round see the same machine (a shared 2-core VM drifts by 10-20% from minute to minute).
# Prints each round's ratio and the medians. A last run measures the server at its CPU default flags
# (streams first: small prefill chunks), which trade throughput for inter-token latency.
set -u
OUT="${1:-benchmarks/results}"
ROUNDS="${2:-3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=$(python -c "from zpp.demo import prepare_demo_model as p; print(p(progress=False))")
ENG="--device cpu -pp 2 --kv-cache-memory 256MiB"
SHAPE="--num-prompts 32"
PORT=18787
start_server() {  # $@: extra flags
  python -m zpp.cli serve "$M" $ENG "$@" --port $PORT --disable-log-requests > /tmp/zpp_cpu_bench_serve.log 2>&1 &
  SRV=$!
  for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && return 0; sleep 1; done
  echo "server did not start: /tmp/zpp_cpu_bench_serve.log"; exit 1
}
serve_run() {  # $1: output json
  python -m zpp.cli bench serve --base-url http://127.0.0.1:$PORT $SHAPE --random-input-len 64 \
    --random-output-len 32 --request-rate inf --num-client-processes 1 --no-progress \
    --output-json "$1" 2>&1 | grep -E "Output token throughput"
}
start_server --max-num-batched-tokens 2048
for R in $(seq 1 "$ROUNDS"); do
  echo "### round $R: offline (zpp bench throughput), then zpp bench serve"
  python -m zpp.cli bench throughput --model "$M" $ENG --max-num-batched-tokens 2048 $SHAPE \
    --input-len 64 --output-len 32 --output-json "$OUT/cpu_pp2_offline_throughput_r$R.json" 2>&1 | grep "Output tokens/s"
  serve_run "$OUT/cpu_pp2_serve_budget_2048_r$R.json"
done
kill -INT $SRV; wait $SRV
start_server
echo "### zpp serve at its CPU default flags"
serve_run "$OUT/cpu_pp2_serve_budget_default.json"
kill -INT $SRV; wait $SRV
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
off = [json.load(open(f"{out}/cpu_pp2_offline_throughput_r{r}.json"))["output_tokens_per_s"] for r in range(1, rounds + 1)]
srv = [json.load(open(f"{out}/cpu_pp2_serve_budget_2048_r{r}.json"))["output_throughput"] for r in range(1, rounds + 1)]
for r, (o, s) in enumerate(zip(off, srv), 1):
    print(f"round {r}: serve / offline = {s:.1f} / {o:.1f} = {s / o:.2f}")
mo, ms = statistics.median(off), statistics.median(srv)
print(f"median: serve / offline = {ms:.1f} / {mo:.1f} = {ms / mo:.2f}")
d = json.load(open(f"{out}/cpu_pp2_serve_budget_default.json"))["output_throughput"]
print(f"serve at CPU default flags: {d:.1f} out tok/s = {d / mo:.2f} of the offline median")
json.dump({"offline_output_tok_s": off, "serve_output_tok_s": srv, "ratios": [s / o for o, s in zip(off, srv)],
           "median_ratio": ms / mo, "serve_default_flags_output_tok_s": d,
           "command": f"bash scripts/cpu_bench_serve.sh {out} {rounds}"},
          open(f"{out}/cpu_pp2_serve_vs_offline.json", "w"), indent=1)
PY
