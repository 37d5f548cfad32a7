set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
ZPP_PDL=1 ZPP_PDL_TRIGGER=late ZPP_ATTN_FUSED_MERGE=1 timeout 150 python -m pytest tests/gpu/test_decode_launches.py tests/models/layers/test_triton_ops.py -x -q -p no:cacheprovider -k "launch or pdl or test_paged_attention" 2>&1 | tee $OUT/tests.txt | tail -3
fi
for tag in "$@"; do
  case $tag in
    nopdl*) e="ZPP_PDL=0"; r="lat-fp8 lat-bf16";;
    pdlentry) e="ZPP_PDL=1 ZPP_PDL_TRIGGER=entry"; r="lat-fp8 lat-bf16";;
    pdllate) e="ZPP_PDL=1 ZPP_PDL_TRIGGER=late"; r="lat-fp8 lat-bf16";;
    pdlexit) e="ZPP_PDL=1 ZPP_PDL_TRIGGER=exit"; r="lat-fp8 lat-bf16";;
    pdlnopf) e="ZPP_PDL=1 ZPP_GEMV_PREFETCH=0"; r="lat-fp8 lat-bf16";;
    pdllatenopf) e="ZPP_PDL=1 ZPP_PDL_TRIGGER=late ZPP_GEMV_PREFETCH=0"; r="lat-fp8";;
    swiglu) e="ZPP_PDL=0 ZPP_FP8_SWIGLU_GEMV=1"; r="lat-fp8";;
    normgemv) e="ZPP_PDL=0 ZPP_FUSED_NORM_GEMV=1"; r="lat-fp8";;
    merge) e="ZPP_PDL=0 ZPP_ATTN_FUSED_MERGE=1"; r="lat-fp8 lat-bf16";;
  esac
  echo "=== $tag $(date +%T)"
  env $e bash scripts/gpu_fp8_bench.sh $OUT/$tag $r 2>&1 | grep -E "TPOT ms|LATE|Error|error" | head -8
done
echo "end $(date +%T)"
