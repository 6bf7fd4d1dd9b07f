#!/usr/bin/env bash
# Installs Mooncake Store for tests/cache (MooncakeStore against a real mooncake_master over TCP loopback):
#   - pip `mooncake-transfer-engine-non-cuda==0.3.13.post1` into .venv (the CUDA wheel's store.so needs
#     libcuda/libcudart/libmlx5; the -non-cuda one runs on a CPU-only box);
#   - libibverbs1, which the binaries link even for TCP: apt-get when we are root, otherwise (or if apt
#     fails) its .deb and those of its libnl deps unpacked into .venv/mooncake-libs/, found through
#     LD_LIBRARY_PATH (serving/cache/mooncake_store.py adds that folder itself).
# Safe to re-run and never fatal: without it the Mooncake tests skip with the reason.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
py=.venv/bin/python
[ -x "$py" ] || { echo "setup: no .venv; mooncake not installed (its tests will skip)" >&2; exit 0; }

if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mooncake') is None)" 2>/dev/null; then
  "$py" -m pip install --disable-pip-version-check -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
    || { echo "setup: pip could not install mooncake-transfer-engine-non-cuda; mooncake tests will skip" >&2; exit 0; }
fi

# (grep without -q: with pipefail, grep -q closing the pipe early makes ldconfig's SIGPIPE fail the check)
have_ibverbs() { ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null || ls .venv/mooncake-libs/{usr/,}lib/*/libibverbs.so.1 >/dev/null 2>&1; }
if ! have_ibverbs; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } >/dev/null 2>&1 \
      || echo "setup: apt-get install libibverbs1 failed; trying the unpacked .deb" >&2
  fi
fi
if ! have_ibverbs && command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1); then
    mkdir -p .venv/mooncake-libs
    for deb in "$tmp"/*.deb; do dpkg -x "$deb" .venv/mooncake-libs; done
  fi
  rm -rf "$tmp"
fi
if have_ibverbs; then
  echo "setup: mooncake ready" >&2
else
  echo "setup: libibverbs1 unavailable; mooncake tests will skip" >&2
fi
exit 0
