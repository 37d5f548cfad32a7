#!/usr/bin/env bash
# zpp serve against the offline engine, same machine, same call (issue #12's acceptance):
#   bash scripts/gpu_bench_serve.sh OUTDIR [PP]
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
PORT=18777
python -m zpp.cli serve $M $ENG --port $PORT --disable-log-requests > "$OUT/${TAG}_serve.log" 2>&1 &
SRV=$!
for i in $(seq 1 300); do curl -sf localhost:$PORT/health >/dev/null && break; sleep 1; done
URL=http://127.0.0.1:$PORT
echo "### serve: one client, 1000 prompts"
python -m zpp.cli bench serve --base-url $URL --num-prompts 1000 --random-input-len 256 --random-output-len 256 \
  --request-rate inf --output-json "$OUT/${TAG}_serve_1client.json" 2>&1 | tail -12
echo "### serve: two clients, 500 prompts each"
T0=$(python -c "import time; print(time.time() + 3)")
CL=""
for c in 0 1; do
  python -m zpp.cli bench serve --base-url $URL --num-prompts 500 --random-input-len 256 --random-output-len 256 \
    --request-rate inf --seed $((c + 1)) --start-at $T0 --output-json "$OUT/${TAG}_serve_2clients_$c.json" \
    > "$OUT/${TAG}_serve_2clients_$c.log" 2>&1 &
  CL="$CL $!"
done
wait $CL
tail -12 "$OUT/${TAG}_serve_2clients_0.log"; tail -12 "$OUT/${TAG}_serve_2clients_1.log"
echo "### serve: concurrency 1 (HTTP TPOT)"
python -m zpp.cli bench serve --base-url $URL --num-prompts 16 --random-input-len 128 --random-output-len 128 \
  --max-concurrency 1 --output-json "$OUT/${TAG}_serve_concurrency1.json" 2>&1 | tail -12
kill -INT $SRV; wait $SRV
python - "$OUT" "$TAG" <<'PY'
import json, sys
out, tag = sys.argv[1:]
ld = lambda n: json.load(open(f"{out}/{tag}_{n}.json"))
off = ld("offline_throughput"); one = ld("serve_1client"); c = [ld(f"serve_2clients_{i}") for i in (0, 1)]
lat = ld("offline_latency"); c1 = ld("serve_concurrency1")
def tok(d):
    for k in ("output_throughput", "output_tokens_per_s", "output_tok_s"):
        if k in d: return d[k]
    raise KeyError(list(d))
t_off, t_one = tok(off), tok(one)
t_two = sum(x["total_output_tokens"] for x in c) / (max(x["end_time"] for x in c) - min(x["start_time"] for x in c)) \
    if all("start_time" in x for x in c) else sum(tok(x) for x in c)
print(json.dumps({"offline_out_tok_s": t_off, "serve_1client_out_tok_s": t_one, "serve_2clients_out_tok_s": t_two,
                  "serve_vs_offline": t_one / t_off, "two_vs_one_client": t_two / t_one,
                  "offline_latency": {k: v for k, v in lat.items() if "tpot" in k.lower() or "latency" in k.lower()},
                  "serve_c1": {k: v for k, v in c1.items() if "tpot" in k.lower()}}, indent=1))
PY
