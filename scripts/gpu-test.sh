#!/usr/bin/env bash
# Runs the GPU tests (or the tests named) on a machine with a CUDA GPU and its own torch, where
# the CUDA-only tests run instead of being skipped. Installs this repository's distributions
# (editable) into the current Python environment; with no network there, pass a folder of
# wheels for the missing dependencies as WHEELS_DIR (it is installed first, offline). Then runs
# the CUDA copy kernel under compute-sanitizer's memcheck (scripts/sanitize_kernel.py); fails
# if either fails.
#   WHEELS_DIR=.whl bash scripts/gpu-test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --no-deps)

if [ -n "${WHEELS_DIR:-}" ]; then
  "${PIP[@]}" --no-index "$WHEELS_DIR"/*.whl
fi
editable=()
for dist in core plugins/*/ contracts testing examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist")
done
"${PIP[@]}" --no-index --no-build-isolation "${editable[@]}"

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "scripts/gpu-test.sh needs a CUDA GPU"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYEOF
# By default the tests that use the GPU: the CUDA memory tests, the copy kernel against the torch
# implementation, the GPU ops, and the GDS tier (its CUDA tests need cufile-python and
# libcufile.so, see docs/gds.md). Name other tests, or `tests` for the whole suite, which also
# needs redis-server, valkey-server and the Redis client wheels there.
if [ $# -eq 0 ]; then
  set -- tests/test_memory_cuda.py tests/test_gpu_kernel_cuda.py tests/test_gpu_ops.py \
    tests/test_gpu_pipeline.py tests/test_gpu_pipeline_cuda.py \
    core/src/kvplug/runtime/gpu plugins/disk/tests/test_gds_cuda.py \
    plugins/disk/tests/test_gds_backend.py plugins/disk/tests/test_gds_contract.py \
    plugins/disk/tests/test_disk_schemes.py plugins/disk/tests/test_disk_failures.py
fi
status=0
"$PY" -m pytest -p no:cacheprovider -q -rs "$@" || status=$?

# The copy kernel under compute-sanitizer's memcheck, with torch's caching allocator off so that
# every tensor is its own CUDA allocation and an access past its end is reported.
sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ]; then
  torch_cuda_home=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")')
  for home in "${CUDA_HOME:-}" "$torch_cuda_home" /usr/local/cuda; do
    if [ -n "$home" ] && [ -x "$home/bin/compute-sanitizer" ]; then
      sanitizer=$home/bin/compute-sanitizer
      break
    fi
  done
fi
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found (PATH, CUDA_HOME, torch's CUDA_HOME, /usr/local/cuda):" \
    "install the CUDA toolkit's compute-sanitizer to check the copy kernel" >&2
  exit 1
fi
echo "memcheck of the copy kernel with $sanitizer"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck --error-exitcode 1 \
  "$PY" scripts/sanitize_kernel.py || status=$?
exit "$status"
