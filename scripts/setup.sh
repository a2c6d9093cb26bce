#!/usr/bin/env bash
# The main job's set-up, the README's first command (`bash scripts/setup.sh && .venv/bin/kvplug
# bench`): a virtual environment in .venv (or $KVPLUG_VENV) with the CPU build of torch, every
# distribution of this repository installed editable (core with the kvplug command, contracts,
# built-in plugins, the test helpers, the example plugin) and the development tools. The main
# job itself needs nothing from Debian; the tests of .venv do, and their packages are small, so
# they are installed here when missing (about 20 MiB; a re-run skips them): Debian's
# redis-server, redis-sentinel, valkey-server, valkey-sentinel and memcached (tests start their
# own), libibverbs1 (Mooncake's and InfiniStore's clients) and iproute2 (scripts/isolated.sh).
# The engine integrations' venvs and the C++ toolchain they need (several GB, minutes) are
# scripts/setup-engines.sh's, which scripts/test.sh runs. A fresh 2-core machine takes about 2
# to 3 minutes (.venv is 1.5 GB); a re-run reuses a .venv whose stamp matches and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() { echo "setup: $* ($((SECONDS - started)) s)"; }

# Real servers for the Redis and Valkey tests, installed only when missing so that a re-run is
# fast: Debian's redis-server and redis-sentinel (7.0), and valkey-server and valkey-sentinel
# (8.0, built with TLS), which bookworm has only in bookworm-backports.
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v redis-sentinel >/dev/null || missing+=(redis-sentinel)
command -v valkey-server >/dev/null || missing+=(valkey-server)
command -v valkey-sentinel >/dev/null || missing+=(valkey-sentinel)
# The memcached walk-through of docs/writing-a-backend.md is tested against a real memcached.
command -v memcached >/dev/null || missing+=(memcached)
# Mooncake's and InfiniStore's clients link the RDMA verbs library (also for TCP), and the
# Mooncake tests run in a network namespace of their own (scripts/isolated.sh: ip, unshare).
dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
command -v ip >/dev/null || missing+=(iproute2)
command -v unshare >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: ${missing[*]} not on PATH and apt-get is not available: install Redis 7" \
      "(redis-server, redis-sentinel) and Valkey 8 built with TLS (valkey-server," \
      "valkey-sentinel), memcached, libibverbs and iproute2 with your package manager," \
      "then run this again." >&2
    exit 1
  fi
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive)
  if [ "$(. /etc/os-release && echo "${VERSION_CODENAME:-}")" = bookworm ] &&
    ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "setup: adding Debian's bookworm-backports apt source (for valkey-server)"
    printf '%s\n' "Types: deb" "URIs: http://deb.debian.org/debian" \
      "Suites: bookworm-backports" "Components: main" \
      "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" |
      "${sudo[@]}" tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null
  fi
  step "installing ${missing[*]} from Debian"
  "${apt[@]}" apt-get update -qq
  release=() valkey=()
  for package in "${missing[@]}"; do
    case $package in valkey-*) valkey+=("$package") ;; *) release+=("$package") ;; esac
  done
  install=("${apt[@]}" apt-get install -y -qq --no-install-recommends)
  [ ${#release[@]} -eq 0 ] || "${install[@]}" "${release[@]}" >/dev/null
  if [ ${#valkey[@]} -gt 0 ]; then
    # Backports are pinned below the release: they are installed only when asked for by name.
    apt-cache policy valkey-server | grep -q bookworm-backports && install+=(-t bookworm-backports)
    "${install[@]}" "${valkey[@]}" >/dev/null
  fi
fi

PYTHON=${PYTHON:-python3.11}
VENV=${KVPLUG_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# --no-compile: pip would byte-compile every module of torch and the tools (over half its time
# here); Python compiles what is imported, once, on first use.
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
# kvplug with its tools (the kvplug command, Prometheus metrics), then every other distribution.
editable=(-e "core[cli,metrics]")
# With their extras where a distribution's features need them (every serde of kvplug-serdes).
declare -A extras=([plugins/serdes/]="[all]")
for dist in contracts plugins/*/ testing examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist${extras[$dist]:-}")
done
# What the venv is built from: a venv whose stamp matches is reused, so a re-run takes seconds
# (the distributions are editable: a change to their code needs no reinstall).
inputs=(scripts/constraints.txt requirements-dev.txt VERSION scripts/hatch_kvplug.py)
for dist in "${editable[@]}"; do
  [ "$dist" = -e ] || inputs+=("${dist%%\[*}/pyproject.toml")
done
stamp="$(cat "${inputs[@]}" | cksum) $(printf '%s\n' "${editable[@]}" | cksum)"
if [ "$(cat "$VENV/.kvplug-stamp" 2>/dev/null)" = "$stamp" ] &&
  "$VENV/bin/python" -c 'import kvplug.runtime.cli' 2>/dev/null; then
  step "$VENV is reused: its stamp matches what it was built from"
else
  step "installing torch (the CPU build) and the development tools into $VENV"
  "${PIP[@]}" --upgrade pip
  # The CPU build (scripts/constraints.txt): plain `torch` would pull a multi-GB CUDA build.
  # GPU users keep their own torch; the distributions only declare a range.
  "${PIP[@]}" -c scripts/constraints.txt torch
  "${PIP[@]}" -r requirements-dev.txt
  # kvplug-gds was folded into kvplug-disk (its gds extra): a venv from before keeps a copy.
  "$VENV/bin/python" -m pip uninstall --quiet --yes kvplug-gds 2>/dev/null || true
  step "installing this repository's distributions into $VENV, editable"
  # Built with the venv's own hatchling (requirements-dev.txt) and editables: an isolated build
  # environment for each of them took most of this step.
  "${PIP[@]}" editables
  "${PIP[@]}" --no-build-isolation "${editable[@]}"
  echo "$stamp" >"$VENV/.kvplug-stamp"
fi

version=$("$VENV/bin/python" -c 'import kvplug; print(kvplug.__version__)')
step "kvplug $version is set up in $VENV; the engine venvs: bash scripts/setup-engines.sh"
