#!/usr/bin/env bash
# The FP8 figures of issue 25 on one H200, bf16 and FP8 in the same call (a GPU figure is only real
# as a ratio measured in one call):
#   bash scripts/gpu_fp8_bench.sh OUTDIR [RUN...]
# Runs (default: all, in this order):
#   kernels               scripts/kernel_bench.py fp8 (GEMV / GEMM / block GEMM / FP8-KV attention vs bf16)
#   tput-bf16 tput-fp8 tput-fp8-kv        Llama-3-8B shape, 1000 x 256/256 (acceptance: fp8 >= 1.4x bf16)
#   lat-bf16 lat-fp8 lat-fp8-kv           batch 1, 128 in / 128 out (acceptance: fp8 TPOT <= 2.7 ms)
#   trt-fp8 trt-fp8-kv                    30,000 prompts x 128/128 (next to TensorRT-LLM's 27,911 out tok/s on
#                                         the H200, 28,312 on the H100)
#   trt-fp8-kv-trace                      trt-fp8-kv with a ZPP_TRACE timeline (trace_report.txt, trace_30k.tar.gz)
#   blocks                                each start-up's "stage ...: weights ... GiB; KV cache N tokens (M blocks
#                                         ...)" line, FP8 weights with the bf16 vs --kv-cache-dtype fp8 KV cache
# Weights are random (--load-format dummy), quantized at load with --quantization fp8.
# JSON per run in OUTDIR (and kernels.txt, blocks.txt); a table at the end.
set -u
OUT="${1:?OUTDIR}"; shift
RUNS="${*:-kernels tput-bf16 tput-fp8 tput-fp8-kv lat-bf16 lat-fp8 lat-fp8-kv trt-fp8 trt-fp8-kv blocks}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
L3=scripts/configs/llama3-8b
COMMON="--model $L3 --load-format dummy --device cuda"
FP8="--quantization fp8"
KV="--kv-cache-dtype fp8"
TPUT="--num-prompts 1000 --input-len 256 --output-len 256 --max-num-seqs 1024 --max-num-batched-tokens 8192"
LAT="--batch-size 1 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 5"
TRT="--num-prompts 30000 --input-len 128 --output-len 128 --max-num-seqs 2048 --max-num-batched-tokens 16384"
# Each run's whole log is appended to OUTDIR/runs.log (one file: a lent GPU machine returns at most 8);
# the lines printed are its figures and any Triton kernel compiled while serving
# (zpp.utils.late_compiles: a batch waited for that compile inside the measurement).
run() {
  echo "### $*" | tee -a "$OUT/runs.log"
  local log; log=$(mktemp)
  "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" > "$log"
  cat "$log" >> "$OUT/runs.log"
  grep -E "while serving" "$log" | sed 's/^/LATE COMPILE: /' | cut -c1-200
  tail -15 "$log"
  rm -f "$log"
}
for r in $RUNS; do
  case $r in
    kernels) python scripts/kernel_bench.py fp8 2>&1 | tee "$OUT/kernels.txt" ;;
    tput-bf16) run python -m zpp.cli bench throughput $COMMON $TPUT --output-json "$OUT/tput_llama3-8b_bf16.json" ;;
    tput-fp8) run python -m zpp.cli bench throughput $COMMON $TPUT $FP8 --output-json "$OUT/tput_llama3-8b_fp8.json" ;;
    tput-fp8-kv) run python -m zpp.cli bench throughput $COMMON $TPUT $FP8 $KV --output-json "$OUT/tput_llama3-8b_fp8_kvfp8.json" ;;
    lat-bf16) run python -m zpp.cli bench latency $COMMON $LAT --output-json "$OUT/lat_llama3-8b_bf16.json" ;;
    lat-fp8) run python -m zpp.cli bench latency $COMMON $LAT $FP8 --output-json "$OUT/lat_llama3-8b_fp8.json" ;;
    lat-fp8-kv) run python -m zpp.cli bench latency $COMMON $LAT $FP8 $KV --output-json "$OUT/lat_llama3-8b_fp8_kvfp8.json" ;;
    trt-fp8) run python -m zpp.cli bench throughput $COMMON $TRT $FP8 --output-json "$OUT/tput30k_llama3-8b_fp8.json" ;;
    trt-fp8-kv) run python -m zpp.cli bench throughput $COMMON $TRT $FP8 $KV --output-json "$OUT/tput30k_llama3-8b_fp8_kvfp8.json" ;;
    trt-fp8-kv-trace)  # the same with a ZPP_TRACE timeline: its report printed, the files in one tar (few files come back)
      tr=$(mktemp -d)
      ZPP_TRACE=$tr run python -m zpp.cli bench throughput $COMMON $TRT $FP8 $KV \
          --output-json "$OUT/tput30k_llama3-8b_fp8_kvfp8_traced.json"
      python scripts/trace_report.py "$tr" | tee "$OUT/trace_report.txt"
      tar -czf "$OUT/trace_30k.tar.gz" -C "$tr" . && rm -rf "$tr" ;;
    blocks)  # the worker's start-up line (zpp.workers.worker): "stage 0/1: weights fp8 7.0, bf16 1.0 GiB; KV
      # cache 924160 tokens (57760 blocks of 16 tokens, ...)" (an older build logged "KV cache: N blocks")
      for kv in auto fp8; do
        echo "### KV cache blocks, --kv-cache-dtype $kv" | tee -a "$OUT/blocks.txt"
        python -m zpp.cli bench latency $COMMON $FP8 --kv-cache-dtype $kv --batch-size 1 --input-len 16 \
            --output-len 4 --num-iters-warmup 0 --num-iters 1 2>&1 \
          | grep -E "weights .* GiB; KV cache [0-9]+ tokens|memory profile" | cut -c1-300 | tee -a "$OUT/blocks.txt"
      done
      python - "$OUT/blocks.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
b = [int(m) for m in re.findall(r"KV cache \d+ tokens \((\d+) blocks", text)]
print(f"KV cache blocks: bf16 KV {b[0]}, fp8 KV {b[1]} ({b[1] / b[0]:.2f}x)" if len(b) == 2
      else f"KV cache blocks: expected 2 start-up lines, found {len(b)}")
PY
      ;;
    *) echo "unknown run $r"; exit 2 ;;
  esac
done
python - "$OUT" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    v = d.get("tpot_ms") or d.get("output_tokens_per_s") or d.get("output_throughput")
    print(f"{os.path.basename(f):40s} {'TPOT ms' if 'tpot_ms' in d else 'out tok/s'} {v}")
PY
