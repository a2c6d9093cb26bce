#!/usr/bin/env bash
# Sets up a fresh Debian bookworm machine for kvplug: Debian's redis-server and redis-sentinel
# (the Redis tests start their own), a virtual environment in .venv with the CPU build of torch,
# every distribution of this repository installed editable (core, contracts, built-in plugins,
# the example plugin) and the development tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real servers for the Redis tests, installed only when missing so that a re-run is fast.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-sentinel >/dev/null || missing+=(redis-sentinel)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: ${missing[*]} not on PATH and apt-get is not available: install Redis 7" \
      "(redis-server and redis-sentinel) with your package manager, then run this again." >&2
    exit 1
  fi
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  echo "setup: installing ${missing[*]} from Debian"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3.11}
VENV=${KVPLUG_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip
# The CPU build: plain `torch` would pull a multi-GB CUDA build. GPU users keep their own torch;
# the distributions only declare a range.
"${PIP[@]}" "torch==2.13.0"

"${PIP[@]}" -r requirements-dev.txt

editable=()
for dist in core plugins/*/ contracts examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist")
done
"${PIP[@]}" "${editable[@]}"

echo "kvplug is set up in $VENV ($("$VENV/bin/python" -c 'import kvplug; print(kvplug.__version__)'))"
