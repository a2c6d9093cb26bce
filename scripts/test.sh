#!/usr/bin/env bash
# Every check, from set-up to the last test: what CI runs (.ci/run). In order: the README's main
# command verbatim (scripts/setup.sh, then `kvplug bench` at its defaults), every other kvplug
# command at its documented default invocation, the engine venvs (scripts/setup-engines.sh),
# lint, types, the whole test suite, the Mooncake tests in a network namespace, each engine
# integration in its venv, a short fuzz run and the contract suite through the CLI. Exits
# non-zero when anything fails or when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment scripts/setup.sh builds (KVPLUG_VENV names another than .venv).
VENV=${KVPLUG_VENV:-.venv}
PY=$VENV/bin/python
failed() {
  echo "test: FAIL: $1 exited $2 (above: its output)." >&2
  exit 1
}

echo "== the README's main command, verbatim: the main job's set-up, then kvplug bench"
# A failure on the left of `&&` does not stop a `set -e` script: each command checks itself.
if [ "$VENV" = .venv ]; then
  bash scripts/setup.sh && .venv/bin/kvplug bench || failed "the README's main command" $?
else
  bash scripts/setup.sh && "$VENV/bin/kvplug" bench || failed "the main command in $VENV" $?
fi

echo "== every other kvplug command at its documented default invocation"
default_invocation() {
  echo "-- kvplug $*"
  "$VENV/bin/kvplug" "$@" </dev/null || failed "kvplug $*" $?
}
default_invocation plugins
default_invocation check
default_invocation config
default_invocation contract cpu://

echo "== the engine venvs (scripts/setup-engines.sh)"
bash scripts/setup-engines.sh

echo "== ruff"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
echo "== mypy"
"$VENV/bin/mypy"
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here too. The Mooncake tests run
# in the next step, in a network namespace of their own. --durations lists the slowest tests in
# CI's log.
"$PY" -m pytest -p no:cacheprovider --durations=30 --ignore=plugins/mooncake/tests "$@"

echo "== kvplug-mooncake against a real mooncake_master, in a network namespace of its own"
# Mooncake's master and clients bind all interfaces: scripts/isolated.sh gives them a network
# nothing outside can reach. KVPLUG_MOONCAKE_REQUIRE=1: a reason to skip them fails the step.
KVPLUG_MOONCAKE_REQUIRE=1 scripts/isolated.sh "$PY" -m pytest -p no:cacheprovider \
  plugins/mooncake/tests </dev/null

echo "== the engine integrations against the engines' own code, in each tested release's venv"
for engine in lmcache sglang vllm; do
  for version in $(grep -v '^#' "integrations/$engine/tested-versions.txt"); do
    echo "-- $engine==$version"
    # Each integration's conftest.py turns the engine's usage telemetry off.
    ".venv-$engine-$version/bin/python" -m pytest -p no:cacheprovider "integrations/$engine" </dev/null
  done
done

echo "== a short fuzz run of the lm:// frame parsers and server (scripts/fuzz_lm.py)"
# libFuzzer's progress goes to the log, shown only when a target crashed.
fuzz_log=$(mktemp)
"$PY" scripts/fuzz_lm.py --seconds 15 </dev/null 2>"$fuzz_log" || { tail -60 "$fuzz_log"; exit 1; }
rm -f "$fuzz_log"

echo "== kvplug-lm against LMCache 0.5.6's own lm:// client and lmcache_server, in its venv"
".venv-lmcache-0.5.6/bin/python" -m pytest -p no:cacheprovider -m lmcache plugins/lm/tests </dev/null

echo "== the contract suite through the CLI, against every built-in backend and the example"
acme_dir=$(mktemp -d)
redis_pid=
valkey_pid=
lm_pid=
trap 'rm -rf "$acme_dir"; kill -9 $redis_pid $valkey_pid $lm_pid 2>/dev/null || true' EXIT
# cpu:// ran above, as kvplug contract's documented default invocation.
"$VENV/bin/kvplug" contract audit::cpu://
"$VENV/bin/kvplug" contract blackhole:// --xfails-file plugins/blackhole/contract-xfails.txt
"$VENV/bin/kvplug" contract "acme://$acme_dir/contract.sqlite"
"$VENV/bin/kvplug" contract "file://$acme_dir/disk"
# A redis-server of our own on a free loopback port, killed on exit.
redis_port=$("$PY" -c 'from kvplug_testing import free_port; print(free_port())')
redis-server --bind 127.0.0.1 --port "$redis_port" --save '' --appendonly no \
  --dir "$acme_dir" >"$acme_dir/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 100); do
  grep -q "Ready to accept connections" "$acme_dir/redis.log" && break
  sleep 0.1
done
# --proxy: clause 10 (deadlines, recovery) through the suite's fault proxy.
"$VENV/bin/kvplug" contract --proxy "redis://127.0.0.1:$redis_port"
# Whole tiers configs as one Store: cpu in front of a disk, cpu in front of that redis-server.
printf 'tiers:\n  - cpu://?max_size=256MiB\n  - file://%s/store-disk\n' "$acme_dir" \
  >"$acme_dir/cpu-file.yaml"
"$VENV/bin/kvplug" contract --config "$acme_dir/cpu-file.yaml"
printf 'tiers:\n  - cpu://?max_size=256MiB\n  - redis://127.0.0.1:%s\n' "$redis_port" \
  >"$acme_dir/cpu-redis.yaml"
"$VENV/bin/kvplug" contract --config "$acme_dir/cpu-redis.yaml"
# And a valkey-server (Debian's, from scripts/setup.sh) the same way.
valkey_port=$("$PY" -c 'from kvplug_testing import free_port; print(free_port())')
valkey_server=$("$PY" -c 'from kvplug_testing import valkey_server_binary as b; print(b())')
"$valkey_server" --bind 127.0.0.1 --port "$valkey_port" --save '' --appendonly no \
  --dir "$acme_dir" >"$acme_dir/valkey.log" 2>&1 &
valkey_pid=$!
for _ in $(seq 100); do
  grep -q "Ready to accept connections" "$acme_dir/valkey.log" && break
  sleep 0.1
done
"$VENV/bin/kvplug" contract --proxy "valkey://127.0.0.1:$valkey_port"
# And kvplug's own lm:// server (plugins/lm), the same way.
lm_port=$("$PY" -c 'from kvplug_testing import free_port; print(free_port())')
"$VENV/bin/kvplug" lm-server --port "$lm_port" --max-memory 1GiB >"$acme_dir/lm.log" 2>&1 &
lm_pid=$!
for _ in $(seq 100); do
  "$PY" -c "import sys; from kvplug_testing.lm import health; sys.exit(not health($lm_port))" && break
  sleep 0.1
done
"$VENV/bin/kvplug" contract --proxy "lm://127.0.0.1:$lm_port"
