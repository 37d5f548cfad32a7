#!/usr/bin/env bash
# One command: set up, then run the whole test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
zpp prepare-demo-model --log-level warning >/dev/null
exec python -m pytest -q "$@"
