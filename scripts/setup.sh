#!/usr/bin/env bash
# Sets up a fresh Debian bookworm machine for kvplug: a virtual environment in .venv with the
# CPU build of torch, every distribution of this repository installed editable (core, contracts,
# built-in plugins, the example plugin) and the development tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

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
