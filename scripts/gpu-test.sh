#!/usr/bin/env bash
# Runs the whole test suite on a machine with a CUDA GPU and its own torch, where the CUDA-only
# tests run instead of being skipped. Installs this repository's distributions (editable) into
# the current Python environment; with no network there, pass a folder of wheels for the
# missing dependencies as WHEELS_DIR (it is installed first, offline).
#   WHEELS_DIR=.whl bash scripts/gpu-test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --no-deps)

if [ -n "${WHEELS_DIR:-}" ]; then
  "${PIP[@]}" --no-index "$WHEELS_DIR"/*.whl
fi
editable=()
for dist in core plugins/*/ contracts examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist")
done
"${PIP[@]}" --no-index --no-build-isolation "${editable[@]}"

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "scripts/gpu-test.sh needs a CUDA GPU"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYEOF
"$PY" -m pytest -p no:cacheprovider -q -rs "$@"
