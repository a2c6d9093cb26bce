#!/usr/bin/env bash
# Sets up a fresh Debian bookworm machine for kvplug: Debian's redis-server, redis-sentinel,
# valkey-server and valkey-sentinel (the Redis and Valkey tests start their own), g++ and
# libssl-dev (SGLang builds a C++ extension), libibverbs1 (Mooncake's and InfiniStore's
# clients) and iproute2 (scripts/isolated.sh), a virtual environment in .venv with the CPU
# build of torch, every distribution of this repository installed editable (core, contracts,
# built-in plugins, the example plugin) and the development tools, and one venv per tested
# engine release for the engine integrations' tests. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

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
# SGLang compiles its page hash (a C++ torch extension against OpenSSL) on first use.
command -v g++ >/dev/null || missing+=(g++)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
# Mooncake's and InfiniStore's clients link the RDMA verbs library (also for TCP), and the
# Mooncake tests run in a network namespace of their own (scripts/isolated.sh: ip, unshare).
dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
command -v ip >/dev/null || missing+=(iproute2)
command -v unshare >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup: ${missing[*]} not on PATH and apt-get is not available: install Redis 7" \
      "(redis-server, redis-sentinel) and Valkey 8 built with TLS (valkey-server," \
      "valkey-sentinel), g++, the OpenSSL headers, libibverbs and iproute2 with your" \
      "package manager, then run this again." >&2
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
  echo "setup: installing ${missing[*]} from Debian"
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
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

"${PIP[@]}" --upgrade pip
# The CPU build (scripts/constraints.txt): plain `torch` would pull a multi-GB CUDA build. GPU
# users keep their own torch; the distributions only declare a range.
"${PIP[@]}" -c scripts/constraints.txt torch

"${PIP[@]}" -r requirements-dev.txt

# kvplug-gds was folded into kvplug-disk (its gds extra): a venv from before keeps a stale copy.
"$VENV/bin/python" -m pip uninstall --quiet --yes kvplug-gds 2>/dev/null || true
# kvplug with its tools (the kvplug command, Prometheus metrics), then every other distribution.
editable=(-e "core[cli,metrics]")
for dist in contracts plugins/*/ testing examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist")
done
"${PIP[@]}" "${editable[@]}"

echo "kvplug is set up in $VENV ($("$VENV/bin/python" -c 'import kvplug; print(kvplug.__version__)'))"

# One venv per tested engine release (integrations/<engine>/tested-versions.txt), for that
# integration's tests: the engine pinned, torch held at the CPU build, kvplug installed
# editable. A venv whose stamp matches is reused, so a re-run is fast.
check_cpu_torch() {
  "$1/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' || {
    echo "setup: $1 has torch $("$1/bin/python" -c 'import torch; print(torch.__version__)')," \
      "not the CPU build 2.13.0" >&2
    exit 1
  }
}

# build_engine_venv ENGINE VERSION INSTALL_FUNCTION: INSTALL_FUNCTION VENV VERSION installs the
# engine into the fresh venv (pip through the torch constraint).
build_engine_venv() {
  local engine=$1 version=$2 install=$3
  local engine_venv=".venv-$engine-$version"
  local inputs=(scripts/constraints.txt "integrations/$engine/pyproject.toml")
  local requirements="integrations/$engine/requirements-cpu.txt"
  [ ! -f "$requirements" ] || inputs+=("$requirements")
  local stamp dists
  stamp="$engine==$version $(cat "${inputs[@]}" | cksum)"
  dists="$(printf '%s\n' "${editable[@]}" | cksum)"
  ENGINE_PIP=("$engine_venv/bin/python" -m pip install --quiet --disable-pip-version-check
    -c scripts/constraints.txt)
  if [ "$(cat "$engine_venv/.kvplug-stamp" 2>/dev/null)" = "$stamp" ]; then
    # The engine is in place; a distribution added since is installed beside it.
    if [ "$(cat "$engine_venv/.kvplug-dists" 2>/dev/null)" != "$dists" ]; then
      "$engine_venv/bin/python" -m pip uninstall --quiet --yes kvplug-gds 2>/dev/null || true
      "${ENGINE_PIP[@]}" "${editable[@]}"
      echo "$dists" >"$engine_venv/.kvplug-dists"
    fi
    return
  fi
  echo "setup: building $engine_venv ($engine==$version)"
  rm -rf "$engine_venv"
  "$PYTHON" -m venv "$engine_venv"
  "${ENGINE_PIP[@]}" --upgrade pip
  "$install" "$engine_venv" "$version"
  "${ENGINE_PIP[@]}" "${editable[@]}"
  # Its dependencies are kvplug and the engine, both in place (the engine's own pins, which
  # SGLang's conflict with the torch constraint, are not resolved again).
  "${ENGINE_PIP[@]}" --no-deps -e "integrations/$engine"
  check_cpu_torch "$engine_venv"
  echo "$stamp" >"$engine_venv/.kvplug-stamp"
  echo "$dists" >"$engine_venv/.kvplug-dists"
}

# LMCache installs with its own dependencies (about a minute and 2 GB).
install_lmcache() {
  "${ENGINE_PIP[@]}" torch "lmcache==$2" pytest hypothesis hiredis
}

# SGLang pins torch 2.14.1 and a CUDA stack: install it without its dependencies, then the
# small set its HiCache storage path imports (integrations/sglang/requirements-cpu.txt).
install_sglang() {
  "${ENGINE_PIP[@]}" torch pytest hypothesis
  "${ENGINE_PIP[@]}" --no-deps "sglang==$2"
  "${ENGINE_PIP[@]}" -r integrations/sglang/requirements-cpu.txt
}

# vLLM pins torch 2.14.0 and a CUDA stack: install it without its dependencies, then what its
# offloading tiering code imports (integrations/vllm/requirements-cpu.txt).
install_vllm() {
  "${ENGINE_PIP[@]}" torch pytest hypothesis
  "${ENGINE_PIP[@]}" --no-deps "vllm==$2"
  "${ENGINE_PIP[@]}" -r integrations/vllm/requirements-cpu.txt
}

for engine in lmcache sglang vllm; do
  while read -r version; do
    case $version in '' | '#'*) continue ;; esac
    build_engine_venv "$engine" "$version" "install_$engine"
  done <"integrations/$engine/tested-versions.txt"
done
echo "engine venvs: $(ls -d .venv-*-* | tr '\n' ' ')"
