#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs every check: lint, types, and the whole test
# suite. Exits non-zero when anything fails or when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here too.
"$PY" -m pytest -p no:cacheprovider "$@"

echo "== the contract suite through the CLI, against every built-in backend and the example"
acme_dir=$(mktemp -d)
trap 'rm -rf "$acme_dir"' EXIT
.venv/bin/kvplug contract cpu://
.venv/bin/kvplug contract audit::cpu://
.venv/bin/kvplug contract blackhole:// --xfails-file plugins/blackhole/contract-xfails.txt
.venv/bin/kvplug contract "acme://$acme_dir/contract.sqlite"
.venv/bin/kvplug contract "file://$acme_dir/disk"
