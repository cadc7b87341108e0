#!/usr/bin/env bash
# Make sure Debian's `prometheus` and `promtool` are installed; print the prometheus path.
# Idempotent: does nothing when both are on PATH (or in /usr/bin). The package's own service is
# kept from starting (policy-rc.d) — tests start their own Prometheus on a free loopback port.
set -euo pipefail

find_bin() { command -v "$1" 2>/dev/null || { [ -x "/usr/bin/$1" ] && echo "/usr/bin/$1"; } || true; }

if [ -n "$(find_bin prometheus)" ] && [ -n "$(find_bin promtool)" ]; then
  find_bin prometheus
  exit 0
fi

# shellcheck source=apt-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"
# --no-install-recommends: the web UI assets and node-exporter are not needed for the API.
apt_install ensure-prometheus prometheus
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

# If a service got started anyway (no policy-rc.d honoured), stop it: it would hold :9090.
if command -v service >/dev/null && service prometheus status >/dev/null 2>&1; then
  $SUDO service prometheus stop >&2 || true
fi

p="$(find_bin prometheus)"
[ -n "$p" ] && [ -n "$(find_bin promtool)" ] || { echo "ensure-prometheus: prometheus/promtool still missing" >&2; exit 1; }
echo "$p"
