#!/usr/bin/env bash
# kwok's simulated pods and nodes get addresses that belong to no host here (KWOK_POD_CIDR,
# KWOK_NODE_CIDR below: the one home of both ranges). A connection to one would leave this machine
# by its default route, which the network rule forbids. This makes them unreachable by
# construction while the local cluster is up: any connection from this machine (OUTPUT) or from a
# real node's pod (FORWARD) to either range is rejected on the spot (TCP: "connection refused";
# anything else: ICMP port unreachable), whatever template, spec or command asked for it.
#   hack/kwok-guard.sh up       add the rules (idempotent; cluster-up calls it)
#   hack/kwok-guard.sh down     remove them (cluster-down calls it)
#   hack/kwok-guard.sh ranges   print the two ranges, one per line
#   hack/kwok-guard.sh count    packets rejected so far (one number; tests read it)
# The rules live in one chain of their own (CHAIN), jumped to first from OUTPUT and FORWARD, so
# removing them never touches anyone else's rules; the chain's counters say whether anything tried.
set -euo pipefail

KWOK_POD_CIDR=10.244.0.0/16    # kwok --cidr: simulated pods' status.podIP
KWOK_NODE_CIDR=10.240.0.0/24   # simulated nodes' InternalIP (hack/cluster-up.sh gives 10.240.0.N+1)
CHAIN=DDPJOB-KWOK-GUARD

ipt() { iptables -w 10 "$@"; }

ensure_iptables() {
  command -v iptables >/dev/null 2>&1 && return 0
  # shellcheck source=apt-lib.sh
  source "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"
  apt_install kwok-guard iptables
}

up() {
  ensure_iptables
  ipt -N "$CHAIN" 2>/dev/null || true
  local cidr rules
  rules="$(ipt -S "$CHAIN")"
  for cidr in "$KWOK_POD_CIDR" "$KWOK_NODE_CIDR"; do
    grep -qF -- "-d $cidr -p tcp" <<<"$rules" \
      || ipt -A "$CHAIN" -d "$cidr" -p tcp -j REJECT --reject-with tcp-reset
    grep -qF -- "-d $cidr -j REJECT" <<<"$rules" \
      || ipt -A "$CHAIN" -d "$cidr" -j REJECT --reject-with icmp-port-unreachable
  done
  local parent
  for parent in OUTPUT FORWARD; do
    ipt -C "$parent" -j "$CHAIN" 2>/dev/null || ipt -I "$parent" 1 -j "$CHAIN"
  done
}

down() {
  command -v iptables >/dev/null 2>&1 || return 0
  local parent
  for parent in OUTPUT FORWARD; do
    while ipt -D "$parent" -j "$CHAIN" 2>/dev/null; do :; done
  done
  ipt -F "$CHAIN" 2>/dev/null || true
  ipt -X "$CHAIN" 2>/dev/null || true
}

count() {
  ipt -L "$CHAIN" -n -v -x | awk 'NR > 2 { n += $1 } END { print n + 0 }'
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  ranges) printf '%s\n%s\n' "$KWOK_POD_CIDR" "$KWOK_NODE_CIDR" ;;
  count) count ;;
  *) echo "usage: $0 up|down|ranges|count" >&2; exit 2 ;;
esac
