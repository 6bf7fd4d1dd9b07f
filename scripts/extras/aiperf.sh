#!/usr/bin/env bash
# Builds .venv-aiperf: AIPerf 0.13.0 (NVIDIA's benchmark client, the one that runs the InferenceX AgentX
# scenario) in its own environment, because its ~1.2 GB of dependencies (pandas, datasets, transformers,
# dash, ...) pin versions the project does not want in .venv. benchmarks/aiperf_agree.py and
# tests/workload/test_aiperf_agree.py use it and skip without it. Safe to re-run; never fatal.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -x .venv-aiperf/bin/aiperf ] && exit 0
# the interpreter .venv was made from (Python 3.12; AIPerf wants 3.11-3.13)
py="$(.venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null || command -v python3.12 || true)"
if [ -z "$py" ]; then
  echo "setup: no Python for .venv-aiperf; the AIPerf agreement test will skip" >&2
  exit 0
fi
rm -rf .venv-aiperf
"$py" -m venv .venv-aiperf
if .venv-aiperf/bin/python -m pip install --disable-pip-version-check -q "aiperf==0.13.0"; then
  echo "setup: AIPerf environment ready (.venv-aiperf, $(.venv-aiperf/bin/aiperf --version 2>/dev/null | tail -n 1))" >&2
else
  echo "setup: could not build .venv-aiperf; the AIPerf agreement test will skip" >&2
  rm -rf .venv-aiperf
fi
exit 0
