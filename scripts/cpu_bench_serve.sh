#!/usr/bin/env bash
# zpp serve against the offline engine on the CPU, same call, default flags on both (issue 28):
#   bash scripts/cpu_bench_serve.sh [OUTDIR] [ROUNDS] [PP] [PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
# SmolLM2-135M (the demo model, real weights), PP=2 and 32 prompts x 64 in / 32 out unless told.
# One server stays up; each round runs the offline engine (`zpp bench throughput`) and then
# `zpp bench serve` against the server, so that both figures of a round see the same machine (a
# shared 2-core VM drifts by 10-20% from minute to minute). Prints each round's ratio and the
# medians (acceptance: serve >= 0.9 x offline). Before issue 28 the rounds used
# --max-num-batched-tokens 2048 on both paths and a last run the server's CPU defaults (32 tokens).
set -u
OUT="${1:-benchmarks/results}"
ROUNDS="${2:-3}"
PP="${3:-2}"
N="${4:-32}"; IN="${5:-64}"; OUTLEN="${6:-32}"
TAG="cpu_pp${PP}_${N}x${IN}_${OUTLEN}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=$(python -c "from zpp.demo import prepare_demo_model as p; print(p(progress=False))")
ENG="--device cpu -pp $PP --kv-cache-memory 256MiB"
PORT=18787
python -m zpp.cli serve "$M" $ENG --port $PORT --disable-log-requests > /tmp/zpp_cpu_bench_serve.log 2>&1 &
SRV=$!
trap 'kill -INT $SRV 2>/dev/null; wait $SRV 2>/dev/null' EXIT
for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
curl -sf localhost:$PORT/health >/dev/null || { echo "server did not start: /tmp/zpp_cpu_bench_serve.log"; exit 1; }
for R in $(seq 1 "$ROUNDS"); do
  echo "### round $R: offline (zpp bench throughput), then zpp bench serve; load $(cut -d' ' -f1-3 /proc/loadavg)"
  python -m zpp.cli bench throughput --model "$M" $ENG --num-prompts $N --input-len $IN --output-len $OUTLEN \
    --output-json "$OUT/${TAG}_offline_r$R.json" 2>&1 | grep "Output tokens/s"
  python -m zpp.cli bench serve --base-url http://127.0.0.1:$PORT --num-prompts $N --random-input-len $IN \
    --random-output-len $OUTLEN --request-rate inf --num-client-processes 1 --no-progress \
    --output-json "$OUT/${TAG}_serve_r$R.json" 2>&1 | grep -E "Output token throughput"
done
python - "$OUT" "$ROUNDS" "$TAG" "bash scripts/cpu_bench_serve.sh $*" <<'PY'
import json, statistics, sys
out, rounds, tag, cmd = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
off = [json.load(open(f"{out}/{tag}_offline_r{r}.json"))["output_tokens_per_s"] for r in range(1, rounds + 1)]
srv = [json.load(open(f"{out}/{tag}_serve_r{r}.json"))["output_throughput"] for r in range(1, rounds + 1)]
for r, (o, s) in enumerate(zip(off, srv), 1):
    print(f"round {r}: serve / offline = {s:.1f} / {o:.1f} = {s / o:.2f}")
mo, ms = statistics.median(off), statistics.median(srv)
print(f"median: serve / offline = {ms:.1f} / {mo:.1f} = {ms / mo:.2f}")
json.dump({"offline_output_tok_s": off, "serve_output_tok_s": srv, "ratios": [s / o for o, s in zip(off, srv)],
           "median_ratio": ms / mo, "command": cmd},
          open(f"{out}/{tag}_serve_vs_offline.json", "w"), indent=1)
PY
