#!/usr/bin/env bash
# zpp serve against the offline engine on the CPU, same call (issue #12's CPU figure):
#   bash scripts/cpu_bench_serve.sh [OUTDIR]
# SmolLM2-135M (the demo model, real weights), PP=2, 32 prompts x 64 in / 32 out. The server runs
# twice: with the offline engine's token budget (2048 per micro-batch: the serving path's own
# cost) and with zpp serve's CPU default (32 per micro-batch: streams first, see README).
set -u
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=$(python -c "from zpp.demo import prepare_demo_model as p; print(p(progress=False))")
ENG="--device cpu -pp 2 --kv-cache-memory 256MiB"
echo "### offline: zpp bench throughput"
python -m zpp.cli bench throughput --model "$M" $ENG --max-num-batched-tokens 2048 --num-prompts 32 \
  --input-len 64 --output-len 32 --output-json "$OUT/cpu_pp2_offline_throughput.json" 2>&1 | grep "tokens/s"
PORT=18787
for BUDGET in 2048 default; do
  FLAG=""; [ "$BUDGET" != default ] && FLAG="--max-num-batched-tokens $BUDGET"
  python -m zpp.cli serve "$M" $ENG $FLAG --port $PORT --disable-log-requests > /tmp/zpp_cpu_bench_serve.log 2>&1 &
  SRV=$!
  for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
  echo "### serve, budget $BUDGET: zpp bench serve"
  python -m zpp.cli bench serve --base-url http://127.0.0.1:$PORT --num-prompts 32 --random-input-len 64 \
    --random-output-len 32 --request-rate inf --num-client-processes 1 \
    --output-json "$OUT/cpu_pp2_serve_budget_$BUDGET.json" 2>&1 | grep -E "Output token throughput|Mean TPOT"
  kill -INT $SRV; wait $SRV
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
off = json.load(open(f"{out}/cpu_pp2_offline_throughput.json"))["output_tokens_per_s"]
for b in ("2048", "default"):
    s = json.load(open(f"{out}/cpu_pp2_serve_budget_{b}.json"))["output_throughput"]
    print(f"serve (budget {b}) / offline: {s:.1f} / {off:.1f} = {s / off:.2f}")
PY
