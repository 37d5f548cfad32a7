#!/usr/bin/env bash
# One command: set up, convert the packaged SmolLM2 model (once) and serve it with 2 pipeline stages
# (on the GPU when there are 2 or more, else on the CPU). Extra arguments go to `zpp serve`.
# The "Try: curl ..." hint is printed once the server answers /health.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-8000}"
# The port must be free before anything starts (set-up included): the hint below would otherwise be
# printed on the /health answer of whatever server already holds it.
if ! "${PYTHON:-python3}" -c "import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if not sys.argv[1].isdigit() or not 0 < int(sys.argv[1]) < 65536:
    sys.exit(f'demo.sh: PORT={sys.argv[1]!r} is not a port number (1-65535)')
try:
    s.bind(('', int(sys.argv[1])))
except OSError as e:
    sys.exit(f'demo.sh: port {sys.argv[1]} is in use ({e.strerror}; another server?): stop it or set PORT=N')" "$PORT"; then
  exit 1
fi
if [ -z "${ZPP_DEMO_SKIP_SETUP:-}" ]; then  # set by tests: use the python and zpp on PATH as they are
  bash scripts/setup.sh
  . .venv/bin/activate
fi
MODEL_DIR="$(zpp prepare-demo-model --log-level warning | tail -n 1)"
DEVICE=cpu  # (torch is imported to count GPUs only where there is a driver: the import takes seconds)
if command -v nvidia-smi >/dev/null 2>&1 \
   && python -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then DEVICE=cuda; fi
echo "Starting zpp serve on $MODEL_DIR with --pipeline-parallel-size 2 on $DEVICE, port $PORT (loading the model)..."
# After the exec below this shell's pid ($$) is the server's: the watcher prints the "Ready. Try:
# curl ..." hint (zpp.demo.demo_hint: with --api-key among the arguments, the curl line sends the
# Authorization header, the key read from $ZPP_API_KEY) once that server answers /health, and gives
# up quietly if it exits first. (Started from a subshell so that it is not the server's child.)
( python -m zpp.demo --when-healthy "http://127.0.0.1:$PORT/health" --pid $$ --port "$PORT" -- "$@" & )
exec zpp serve "$MODEL_DIR" --pipeline-parallel-size 2 --device "$DEVICE" --port "$PORT" "$@"
