#!/usr/bin/env bash
# Stop the real nodes started by hack/nodes-up.sh and leave nothing behind: kubelets, every pod's
# containers (via their containerd, or their shims if containerd is gone), containerds, CoreDNS,
# mounts and network namespaces under our runtime dirs, the bridges and our iptables rules.
# The containerd roots (imported images) are kept: they are the machine-wide image cache.
# Called by hack/cluster-down.sh (which holds the cluster lock); idempotent.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/nodes-lib.sh"

log() { printf '[hack/nodes-down %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
cmdline() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" || true; }
# stop_pid PID: SIGTERM, up to 10 s, then SIGKILL.
stop_pid() {
  local pid="$1" _
  [ -d "/proc/$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do [ -d "/proc/$pid" ] || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
  for _ in $(seq 25); do [ -d "/proc/$pid" ] || return 0; sleep 0.2; done
}
recorded() {  # recorded NAME: the pid in pids/NAME.pid when that process is still ours
  local f="$PIDS/$1.pid" pid
  [ -f "$f" ] || return 1
  pid="$(cat "$f")"
  cmdline "$pid" | grep -qF -e "$NODES_RUN" -e "$NODES_VAR" -e "$STATE" || return 1
  echo "$pid"
}
# kill_tree PID: the process and all its descendants, children first, at once (SIGKILL).
kill_tree() {
  local c
  for c in $(pgrep -P "$1" 2>/dev/null || true); do kill_tree "$c"; done
  kill -KILL "$1" 2>/dev/null || true
}

# 1. kubelets first, so nothing restarts the containers we are about to remove.
for f in "$PIDS"/kubelet-*.pid; do
  [ -e "$f" ] || continue
  n="$(basename "$f" .pid)"
  pid="$(recorded "$n")" && stop_pid "$pid"
done
# 2. every container of every node: through containerd while it runs (this also tears down each
#    sandbox's network namespace), then whatever shim is left (containerd gone) with its children.
for f in "$PIDS"/containerd-*.pid; do
  [ -e "$f" ] || continue
  i="${f##*/containerd-}"; i="${i%.pid}"
  sock="$NODES_RUN/ddpjob-node-$i/containerd.sock"
  if pid="$(recorded "containerd-$i")" && ctr -a "$sock" version >/dev/null 2>&1; then
    for t in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
      ctr -a "$sock" -n k8s.io tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
    for t in $(ctr -a "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        ctr -a "$sock" -n k8s.io tasks delete "$t" >/dev/null 2>&1 && break; sleep 0.3
      done
    done
    for c in $(ctr -a "$sock" -n k8s.io containers ls -q 2>/dev/null); do
      ctr -a "$sock" -n k8s.io containers rm "$c" >/dev/null 2>&1 || true
    done
  fi
  pid="$(recorded "containerd-$i")" && stop_pid "$pid"
done
for pid in $(pgrep -f containerd-shim 2>/dev/null || true); do
  cmdline "$pid" | grep -qF "$NODES_RUN/" && kill_tree "$pid"
done
# 3. CoreDNS
pid="$(recorded coredns)" && stop_pid "$pid"
# 4. mounts (network namespaces, volumes, rootfs) under our runtime dirs, deepest first.
for dir in "$NODES_RUN" "$NODES_VAR" "$CONTAINERD_CACHE"; do unmount_under "$dir"; done
# 5. bridges (their veths went with the namespaces), our iptables rules (filter and nat), the
#    runtime dirs.
for br in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | grep -E '^ddpbr[0-9]+$' || true); do
  if ip -o addr show dev "$br" | grep -q ' 10\.248\.'; then ip link del "$br" 2>/dev/null || true; fi
done
delete_ipt_rules "$IPT_TAG"
rm -rf "$NODES_RUN" "$NODES_VAR"
for f in "$CONTAINERD_CACHE"/node-*.owner; do
  if [ -e "$f" ] && [ "$(cat "$f")" = "$STATE" ]; then rm -f "$f"; fi
done
log "real nodes stopped; nothing left under $NODES_RUN or $NODES_VAR"
