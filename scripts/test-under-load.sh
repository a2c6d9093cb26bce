#!/usr/bin/env bash
# The whole test command (scripts/test.sh) with a CPU hog beside it: one busy-looping process
# per core (or KVPLUG_HOG_PROCESSES of them), killed when the run ends. The suite must pass this
# way too: deadlines, failovers and bursts of connections are tested on a machine that is busy.
set -euo pipefail
cd "$(dirname "$0")/.."
hogs=${KVPLUG_HOG_PROCESSES:-$(nproc)}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for _ in $(seq "$hogs"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
echo "test-under-load: ${#pids[@]} busy-looping processes beside the tests"
bash scripts/test.sh "$@"
