set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python -m pytest tests/gpu/test_decode_launches.py -x -q -p no:cacheprovider 2>&1 | tee $OUT/tests.txt | tail -3
L3="--model scripts/configs/llama3-8b --load-format dummy --device cuda --quantization fp8 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5"
for b in 1 64; do for p in 0 1; do echo "b$b ZPP_PDL=$p $(ZPP_PDL=$p python -m zpp.cli bench latency $L3 --batch-size $b 2>&1 | grep -E "TPOT|rror" | head -3)"; done; done
echo "=== bf16 $(date +%T)"; bash scripts/gpu_fp8_bench.sh $OUT/bf lat-bf16 lat-fp8-kv 2>&1 | grep -E "TPOT ms|LATE|Error|error" | head -4
echo "end $(date +%T)"
