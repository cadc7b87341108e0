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

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "ensure-prometheus: need root (or sudo) to apt-get install prometheus" >&2; exit 1; }
  SUDO="sudo"
fi

# Keep the package's init script from starting a system Prometheus on :9090 during install.
POLICY=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$POLICY" ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
  $SUDO chmod +x "$POLICY"
  created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then $SUDO rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2
# --no-install-recommends: the web UI assets and node-exporter are not needed for the API.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >&2

# If a service got started anyway (no policy-rc.d honoured), stop it: it would hold :9090.
if command -v service >/dev/null && service prometheus status >/dev/null 2>&1; then
  $SUDO service prometheus stop >&2 || true
fi

p="$(find_bin prometheus)"
[ -n "$p" ] && [ -n "$(find_bin promtool)" ] || { echo "ensure-prometheus: prometheus/promtool still missing" >&2; exit 1; }
echo "$p"
