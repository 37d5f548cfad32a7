#!/usr/bin/env bash
# zpp serve against the offline engine, same machine, same call (issue #12's acceptance):
#   bash scripts/gpu_bench_serve.sh OUTDIR [PP]     (ZPP_API_SERVER_COUNTS="1 4": the server settings to run)
# Llama-3-8B shape, random bf16 weights. Runs, in order:
#   1. zpp bench throughput            1000 x 256/256 (offline engine, in-process core)
#   2. zpp serve + one zpp bench serve  1000 x 256/256, --request-rate inf
#   3. the same server, two zpp bench serve processes with 500 prompts each, started together
#   4. zpp bench latency (batch 1, 128/128) and zpp bench serve at concurrency 1 (HTTP TPOT)
set -u
OUT="${1:-benchmarks/results}"
PP="${2:-1}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The Llama-3-8B shape with the demo (SmolLM2) tokenizer, vocabulary 49,152, so that the server
# tokenizes and detokenizes as in real use: ZPP_BENCH_MODEL=DIR (config.json + tokenizer files).
M="${ZPP_BENCH_MODEL:-scripts/configs/llama3-8b}"
ENG="--load-format dummy --device cuda -pp $PP --max-num-seqs 1024 --max-num-batched-tokens 8192"
TAG="h200_pp${PP}"
[ "$PP" -gt 1 ] && TAG="h200x${PP}_pp${PP}"
echo "### offline: zpp bench throughput"
python -m zpp.cli bench throughput --model $M $ENG --num-prompts 1000 --input-len 256 --output-len 256 \
  --output-json "$OUT/${TAG}_offline_throughput.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -8
echo "### offline: zpp bench latency"
python -m zpp.cli bench latency --model $M $ENG --batch-size 1 --input-len 128 --output-len 128 \
  --output-json "$OUT/${TAG}_offline_latency.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -6
for API in ${ZPP_API_SERVER_COUNTS:-1 4}; do
echo "##### zpp serve --api-server-count $API"
PORT=18777
python -m zpp.cli serve $M $ENG --port $PORT --disable-log-requests --api-server-count $API \
  > "$OUT/${TAG}_api${API}_serve.log" 2>&1 &
SRV=$!
for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
URL=http://127.0.0.1:$PORT
echo "### serve: one client, 1000 prompts"
python -m zpp.cli bench serve --base-url $URL --num-prompts 1000 --random-input-len 256 --random-output-len 256 \
  --request-rate inf --output-json "$OUT/${TAG}_api${API}_serve_1client.json" 2>&1 | grep -E "throughput|TPOT|TTFT"
NCL=${ZPP_CLIENTS:-4}
echo "### serve: $NCL client processes, 1000/$NCL prompts each"
T0=$(python -c "import time; print(time.time() + 3)")
CL=""
for c in $(seq 0 $((NCL - 1))); do
  python -m zpp.cli bench serve --base-url $URL --num-prompts $((1000 / NCL)) --random-input-len 256 --random-output-len 256 \
    --request-rate inf --seed $((c + 1)) --start-at $T0 --output-json "$OUT/${TAG}_api${API}_serve_2clients_$c.json" \
    > "$OUT/${TAG}_api${API}_serve_2clients_$c.log" 2>&1 &
  CL="$CL $!"
done
wait $CL
grep -h "Output token throughput\|Mean TPOT" "$OUT/${TAG}_api${API}"_serve_2clients_*.log
echo "### serve: concurrency 1 (HTTP TPOT)"
python -m zpp.cli bench serve --base-url $URL --num-prompts 16 --random-input-len 128 --random-output-len 128 \
  --max-concurrency 1 --output-json "$OUT/${TAG}_api${API}_serve_concurrency1.json" 2>&1 | grep -E "TPOT"
kill -INT $SRV; wait $SRV
done
for API in ${ZPP_API_SERVER_COUNTS:-1 4}; do
python - "$OUT" "$TAG" "$API" <<'PY'
import json, sys
out, tag, api = sys.argv[1:]
ld = lambda n: json.load(open(f"{out}/{tag}_{n}.json"))
off, lat = ld("offline_throughput"), ld("offline_latency")
one, c1 = ld(f"api{api}_serve_1client"), ld(f"api{api}_serve_concurrency1")
import glob
c = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{tag}_api{api}_serve_2clients_*.json"))]
t_two = sum(x["total_output_tokens"] for x in c) / (max(x["end_time"] for x in c) - min(x["start_time"] for x in c))
print(json.dumps({"api_server_count": int(api), "offline_out_tok_s": off["output_tokens_per_s"],
                  "serve_1client_out_tok_s": one["output_throughput"], "num_clients": len(c), "serve_nclients_out_tok_s": t_two,
                  "serve_vs_offline": one["output_throughput"] / off["output_tokens_per_s"],
                  "serve_nclients_vs_offline": t_two / off["output_tokens_per_s"],
                  "offline_tpot_ms": lat["tpot_ms"], "serve_concurrency1_tpot_ms": c1["median_tpot_ms"]}))
PY
done
