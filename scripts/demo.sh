#!/usr/bin/env bash
# One command: set up, convert the packaged SmolLM2 model (once) and serve it with 2 pipeline stages
# (on the GPU when there are 2 or more, else on the CPU). Extra arguments go to `zpp serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
MODEL_DIR="$(zpp prepare-demo-model --log-level warning | tail -n 1)"
DEVICE=cpu
if python -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then DEVICE=cuda; fi
PORT="${PORT:-8000}"
cat <<MSG
Serving $MODEL_DIR with --pipeline-parallel-size 2 on $DEVICE, port $PORT. Try:
  curl -s localhost:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0}'
Stop with Ctrl-C.
MSG
exec zpp serve "$MODEL_DIR" --pipeline-parallel-size 2 --device "$DEVICE" --port "$PORT" "$@"
