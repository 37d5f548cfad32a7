#!/usr/bin/env bash
# The two-GPU measurements of the README (run on a machine with 2 H200s):
#   bash scripts/gpu_bench_x2.sh OUTDIR [RUN...]
# RUN: tput-pp1 tput-pp2 tput-pp2-d3 tput-pp2-d4 tput-tp2 lat-pp1 lat-pp2 lat-tp2 (default: these),
#      tput-pp2-sock / lat-pp2-sock (NCCL forced onto TCP sockets over loopback: what a cross-host
#      link without RDMA costs),
#      and on a Llama-3-70B shape (does not fit one GPU): tput70-pp2 tput70-tp2 lat70-pp2 lat70-tp2.
# Throughput runs are traced (ZPP_TRACE) and followed by scripts/trace_report.py's summary;
# the traces go into OUTDIR/traces.tgz. NVLink multicast stays off in every process.
set -u
OUT="${1:-benchmarks/results}"
shift || true
RUNS="${*:-tput-pp1 tput-pp2 tput-pp2-d3 tput-pp2-d4 tput-tp2 lat-pp1 lat-pp2 lat-tp2}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L3=scripts/configs/llama3-8b
L70=scripts/configs/llama3-70b
TR=$(mktemp -d)
TPUT="--num-prompts 1000 --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192"
LAT="--batch-size 1 --input-len 128 --output-len 128"
TPUT70="--num-prompts 512 --input-len 256 --output-len 128 --max-num-seqs 512 --max-num-batched-tokens 8192"
tput() {  # name, model, extra args
  local name=$1 model=$2; shift 2
  echo "### throughput $name: $*"
  ZPP_TRACE=$TR/$name python -m zpp.cli bench throughput --model $model --load-format dummy --device cuda "$@" \
    --output-json "$OUT/h200x2_throughput_$(basename $model)_$name.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -14
  python scripts/trace_report.py "$TR/$name"
}
lat() {
  local name=$1 model=$2; shift 2
  echo "### latency $name: $*"
  python -m zpp.cli bench latency --model $model --load-format dummy --device cuda $LAT "$@" \
    --output-json "$OUT/h200x2_latency_$(basename $model)_${name}_bs1.json" 2>&1 | grep -v -E "it/s\]|s/it\]" | tail -12
}
for r in $RUNS; do
  case $r in
    tput-pp1) tput pp1 $L3 $TPUT ;;
    tput-pp2) tput pp2 $L3 $TPUT -pp 2 ;;
    tput-pp2-d3) tput pp2_depth3 $L3 $TPUT -pp 2 --pipeline-depth 3 ;;
    tput-pp2-d4) tput pp2_depth4 $L3 $TPUT -pp 2 --pipeline-depth 4 ;;
    tput-tp2) tput tp2 $L3 $TPUT -tp 2 ;;
    tput-pp2-sock) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
                     tput pp2_nccl_sockets $L3 $TPUT -pp 2 ;;
    lat-pp2-sock) NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo \
                    lat pp2_nccl_sockets $L3 -pp 2 ;;
    lat-pp1) lat pp1 $L3 ;;
    lat-pp2) lat pp2 $L3 -pp 2 ;;
    lat-tp2) lat tp2 $L3 -tp 2 ;;
    tput70-pp2) tput pp2 $L70 $TPUT70 -pp 2 ;;
    tput70-tp2) tput tp2 $L70 $TPUT70 -tp 2 ;;
    lat70-pp2) lat pp2 $L70 -pp 2 ;;
    lat70-tp2) lat tp2 $L70 -tp 2 ;;
    *) echo "unknown run $r" ;;
  esac
done
tar czf "$OUT/traces.tgz" -C "$TR" . 2>/dev/null
