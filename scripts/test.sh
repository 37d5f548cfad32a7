#!/usr/bin/env bash
# One command: set up, then run the whole test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
zpp prepare-demo-model --log-level warning >/dev/null
# Multi-host tests run a real sshd in a network namespace (tests/two_hosts.py). A failed install
# does not stop the run: those tests then skip or error with the reason.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/sshd ]; then
  # ensure_openssh: apt-get update -qq && apt-get install -y -qq openssh-server, with a step message,
  # keeping the package's own sshd from being started (policy-rc.d).
  python -c "import sys; sys.path.insert(0, 'tests'); from two_hosts import ensure_openssh; ensure_openssh()" \
    || echo "test.sh: openssh-server install failed; the two-hosts tests will report it" >&2
fi
# The per-node launch test under a real Slurm (tests/slurm_cluster.py) needs slurmctld, slurmd and
# munge (Debian's packages, ~10 MB); the test installs them itself when missing, this does it first.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/slurmd ]; then
  python -c "import sys; sys.path.insert(0, 'tests'); from slurm_cluster import ensure_slurm; ensure_slurm()" \
    || echo "test.sh: Slurm install failed; the Slurm test will report it" >&2
fi
# -v: one line per test as it finishes (name, outcome, % done); the 40 slowest at the end.
exec python -m pytest -v --durations=40 "$@"
