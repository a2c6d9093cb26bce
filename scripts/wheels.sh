#!/usr/bin/env bash
# Builds a wheel of every distribution in this repository (core, contracts, the built-in
# plugins, the test servers, the engine integrations and the example plugin) into one folder,
# so that extras resolve from the checkout:
#   bash scripts/wheels.sh && pip install --find-links dist 'kvplug[redis,disk]'
# Usage: scripts/wheels.sh [OUT_DIR (default dist)] [more `pip wheel` arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
shift || true
PY=${PYTHON:-python3}
dists=()
for dist in core contracts plugins/*/ testing integrations/*/ examples/*/; do
  [ -f "$dist/pyproject.toml" ] && dists+=("./${dist%/}")
done
mkdir -p "$out"
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$out" "$@" \
  "${dists[@]}"
echo "wheels of ${#dists[@]} distributions in $out"
