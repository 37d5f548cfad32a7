#!/usr/bin/env bash
# Async scheduling on vs off on one H200, in one call (a GPU figure is only real as a ratio
# measured in the same call):  bash scripts/gpu_async_bench.sh OUTDIR [lat|tput|tests|gemv]...
# gemv: batch-1 TPOT with zpp's Triton GEMV (default) vs cuBLAS (ZPP_TRITON_GEMV=0), each twice.
# lat: batch-1 TPOT, Llama-3-8B and SmolLM2 shapes; tput: 1000 x 256/256; tests: tests/gpu/test_gpu.py
# with async scheduling forced on, then off (ZPP_ASYNC_SCHEDULING). JSON per run in OUTDIR.
set -u
OUT="${1:-benchmarks/results}"; shift
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L3=scripts/configs/llama3-8b
SMOL=scripts/configs/smollm2-135m
run() { echo "### $*"; "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" | grep -E "TPOT|tokens/s|busy|async|Elapsed|passed|failed|Error|error" ; }
for what in "${@:-lat tput}"; do
  case $what in
    lat)
      for m in llama3-8b smollm2-135m; do
        for i in 1 2; do
          for a in async-scheduling no-async-scheduling; do
            run python -m zpp.cli bench latency --model scripts/configs/$m --load-format dummy --device cuda \
              --batch-size 1 --input-len 128 --output-len 128 --$a --output-json "$OUT/lat_${m}_${a}_$i.json"
          done
        done
      done ;;
    tput)
      for a in async-scheduling no-async-scheduling; do
        run python -m zpp.cli bench throughput --model $L3 --load-format dummy --device cuda --num-prompts 1000 \
          --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192 --$a \
          --output-json "$OUT/tput_llama3-8b_${a}.json"
      done ;;
    gemv)
      for i in 1 2; do
        for m in llama3-8b smollm2-135m; do
          for g in 1 0; do
            echo "### $m ZPP_TRITON_GEMV=$g"
            ZPP_TRITON_GEMV=$g run python -m zpp.cli bench latency --model scripts/configs/$m --load-format dummy \
              --device cuda --batch-size 1 --input-len 128 --output-len 128 --output-json "$OUT/lat_${m}_gemv${g}_$i.json"
          done
        done
      done ;;
    tests)
      for a in 1 0; do
        echo "### ZPP_ASYNC_SCHEDULING=$a pytest tests/gpu/test_gpu.py"
        ZPP_ASYNC_SCHEDULING=$a python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu.py 2>&1 | tail -15
      done ;;
  esac
done
