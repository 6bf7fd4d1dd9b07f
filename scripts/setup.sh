#!/usr/bin/env bash
# Sets up ./.venv for this checkout: finds a Python 3.12, creates the venv if it is absent, and installs
# the project editable with its test extras. Safe to re-run. Used by README's first command and .ci/run.
#   bash scripts/setup.sh            (override the interpreter with PYTHON=/path/to/python3.12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

want="3.12"
is_312() { [ -n "${1:-}" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    is_312 "$PYTHON" && { echo "$PYTHON"; return; }
    echo "setup: PYTHON=$PYTHON is not a working Python $want" >&2; return 1
  fi
  # 1. python3.12 on PATH (a pyenv shim for an inactive version fails the check and is skipped)
  if cand="$(command -v python3.12 2>/dev/null)" && is_312 "$cand"; then echo "$cand"; return; fi
  # 2. pyenv's installed 3.12.x, newest first, with or without the pyenv command on PATH
  local root="${PYENV_ROOT:-}"
  if [ -z "$root" ] && command -v pyenv >/dev/null 2>&1; then root="$(pyenv root)"; fi
  root="${root:-$HOME/.pyenv}"
  for cand in $(ls -d "$root"/versions/3.12*/bin/python3 2>/dev/null | sort -rV); do
    if is_312 "$cand"; then echo "$cand"; return; fi
  done
  # 3. ask pyenv to run its 3.12.1
  if command -v pyenv >/dev/null 2>&1; then
    cand="$(PYENV_VERSION=3.12.1 pyenv exec python -c 'import sys; print(sys.executable)' 2>/dev/null || true)"
    if is_312 "$cand"; then echo "$cand"; return; fi
  fi
  echo "setup: no Python $want found (tried python3.12, \$(pyenv root)/versions/3.12*, pyenv exec); set PYTHON=" >&2
  return 1
}

if [ -x .venv/bin/python ] && ! is_312 .venv/bin/python; then
  echo "setup: .venv is not Python $want; recreating it" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  py="$(find_python)"
  echo "setup: creating .venv with $py ($("$py" --version 2>&1))" >&2
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[test]"
echo "setup: ready: $(.venv/bin/python --version 2>&1), $(.venv/bin/python -c 'import jax; print("jax", jax.__version__)')" >&2

# --with-test-extras: also build the optional environments that some tests use and skip without
# (scripts/extras/*.sh, each one environment, each safe to re-run and never fatal): the torch reference
# environment for tests/parity, and others. CI passes it (.ci/run).
if [ "${1:-}" = "--with-test-extras" ]; then
  for extra in scripts/extras/*.sh; do
    bash "$extra" || echo "setup: $extra failed; the tests that need it will skip" >&2
  done
fi
