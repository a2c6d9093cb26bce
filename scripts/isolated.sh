#!/usr/bin/env bash
# Runs a command in a private network namespace (unshare --net, as root) that has only the
# loopback interface and a veth pair whose two ends are both inside it (kvplug0 10.254.0.1,
# kvplug1 10.254.0.2): nothing outside can reach a port bound there, whatever address it binds.
# Mooncake's master and clients bind all interfaces, and its HTTP-metadata mode needs an
# address that is not loopback; scripts/test.sh runs the Mooncake tests this way.
#   scripts/isolated.sh .venv/bin/python -m pytest plugins/mooncake/tests
set -euo pipefail
if [ "${KVPLUG_IN_ISOLATED_NETWORK:-}" != 1 ]; then
  exec unshare --net env KVPLUG_IN_ISOLATED_NETWORK=1 bash "$0" "$@"
fi
ip link set lo up
ip link add kvplug0 type veth peer name kvplug1
ip addr add 10.254.0.1/30 dev kvplug0
ip addr add 10.254.0.2/30 dev kvplug1
ip link set kvplug0 up
ip link set kvplug1 up
exec "$@"
