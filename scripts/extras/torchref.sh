#!/usr/bin/env bash
# Builds .venv-torchref, the Python 3.11 environment in which tests/parity run the public torch references
# (transformers' Kimi-Linear, fla-core's naive KDA/AttnRes). torch comes only from a local CPU wheel
# (version 2.13.0+cpu): without one, the parity tests skip instead of pulling CUDA torch. Safe to re-run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ -x .venv-torchref/bin/python ] && exit 0
wheel_dir="${K3JAX_TORCH_WHEELS:-/opt/wheels}"
py311="$(command -v python3.11 2>/dev/null || true)"
if [ -z "$py311" ] && command -v pyenv >/dev/null 2>&1; then
  py311="$(ls -d "$(pyenv root)"/versions/3.11*/bin/python3 2>/dev/null | sort -rV | head -n 1)"
fi
if [ -z "$py311" ] || ! ls "$wheel_dir"/torch-2.13.0+cpu-cp311-*.whl >/dev/null 2>&1; then
  echo "setup: no Python 3.11 + local CPU torch wheel; tests/parity will skip" >&2
  exit 0
fi
"$py311" -m venv .venv-torchref
# "+cpu" is a local version PyPI does not carry: torch can only come from the wheel folder
if .venv-torchref/bin/python -m pip install --disable-pip-version-check -q --find-links "$wheel_dir" \
     "torch==2.13.0+cpu" transformers==5.24.0 einops==0.8.2 fla-core==0.6.0; then
  echo "setup: torch reference environment ready (.venv-torchref)" >&2
else
  echo "setup: could not build .venv-torchref; tests/parity will skip" >&2
  rm -rf .venv-torchref
fi
