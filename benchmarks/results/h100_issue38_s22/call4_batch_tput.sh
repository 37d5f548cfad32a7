set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
L3="--model scripts/configs/llama3-8b --load-format dummy --device cuda --quantization fp8 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5"
for b in 8 64; do for p in 0 1 0 1; do echo "b$b ZPP_PDL=$p $(ZPP_PDL=$p python -m zpp.cli bench latency $L3 --batch-size $b 2>&1 | grep -E "TPOT|rror" | head -3)"; done; done
for p in 0 1; do echo "=== tput ZPP_PDL=$p $(date +%T)"; ZPP_PDL=$p bash scripts/gpu_fp8_bench.sh $OUT/tput$p tput-fp8 2>&1 | grep -E "out tok/s|LATE|Error|error" | head -4; done
echo "end $(date +%T)"
