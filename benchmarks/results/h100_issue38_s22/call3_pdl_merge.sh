set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ZPP_ATTN_FUSED_MERGE=1 timeout 120 python -m pytest tests/gpu/test_decode_launches.py -x -q -p no:cacheprovider 2>&1 | tee $OUT/tests.txt | tail -3
L3="--model scripts/configs/llama3-8b --load-format dummy --device cuda --quantization fp8 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3"
for tag in "$@"; do
  case $tag in
    nopdl*) e="ZPP_PDL=0"; r="lat-fp8 lat-bf16";;
    pdl|pdl2) e="ZPP_PDL=1"; r="lat-fp8 lat-bf16";;
    pdlmerge) e="ZPP_ATTN_FUSED_MERGE=1"; r="lat-fp8 lat-bf16";;
    pdlall) e="ZPP_ATTN_FUSED_MERGE=1 ZPP_FP8_SWIGLU_GEMV=1"; r="lat-fp8";;
    b64) for p in 0 1; do echo "b64 ZPP_PDL=$p"; ZPP_PDL=$p python -m zpp.cli bench latency $L3 --batch-size 64 2>&1 | grep -E "TPOT|rror" | head -3; done; continue;;
  esac
  echo "=== $tag $(date +%T)"
  env $e bash scripts/gpu_fp8_bench.sh $OUT/$tag $r 2>&1 | grep -E "TPOT ms|LATE|Error|error" | head -8
done
echo "end $(date +%T)"
