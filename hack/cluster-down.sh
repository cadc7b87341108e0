#!/usr/bin/env bash
# Stop the local control plane started by hack/cluster-up.sh and remove its state (.cache/cluster;
# with DDPJOB_CLUSTER=oldest the second control plane's, .cache/cluster-oldest).
# Only processes recorded in .cache/cluster/pids/ whose command line names that state directory are
# signalled (never anything matched by name). Idempotent. --keep-logs keeps .cache/cluster/logs/.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=state-lib.sh
source "$HERE/state-lib.sh"
PIDS="$STATE/pids"
KEEP_LOGS=0
[ "${1:-}" = "--keep-logs" ] && KEEP_LOGS=1

log() { printf '[hack/cluster-down %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

ours() {  # ours PID: alive and started by cluster-up for this state dir
  [ -r "/proc/$1/cmdline" ] && tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" | grep -qF "$STATE"
}

# Serialize with hack/cluster-up.sh (which holds the lock already when it calls us).
if [ -z "${DDPJOB_CLUSTER_LOCKED:-}" ] && [ -d "$ROOT/.cache" ]; then
  exec 9>"$STATE.lock"
  flock -w 300 9 || { log "FAILED: hack/cluster-up.sh is still running (lock $STATE.lock)"; exit 1; }
fi

if [ ! -d "$STATE" ]; then
  log "nothing to stop ($STATE does not exist)"
  exit 0
fi

# Real nodes first (their pods, kubelets, containerds, CoreDNS, mounts, bridges): they need nothing
# from the control plane to stop. Only the main cluster has them.
if [ -z "${DDPJOB_CLUSTER:-}" ]; then
  "$HERE/nodes-down.sh" || log "stopping the real nodes reported an error (see above)"
fi

# Stop one at a time in reverse start order, clients first and etcd last (an API server whose
# etcd is gone hangs in shutdown): SIGTERM, up to 10 s, then SIGKILL.
stopped=()
for name in registry kueue kwok scheduler-plugins-controller scheduler-plugins kube-scheduler kube-controller-manager kube-apiserver etcd; do
  f="$PIDS/$name.pid"
  [ -f "$f" ] || continue
  pid="$(cat "$f")"
  ours "$pid" || continue
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do ours "$pid" || break; sleep 0.2; done
  if ours "$pid"; then
    log "$name (pid $pid) did not stop on SIGTERM within 10 s: killing it"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 25); do ours "$pid" || break; sleep 0.2; done
  fi
  ours "$pid" && { log "FAILED: $name (pid $pid) is still running"; exit 1; }
  stopped+=("$name:$pid")
done
[ "${#stopped[@]}" -gt 0 ] && log "stopped ${stopped[*]}"

# kwok's addresses are unreachable only while a cluster is up (hack/kwok-guard.sh): the guard
# stays while another cluster's kwok runs (the oldest beside the main one, or another clone's).
if pgrep -x kwok >/dev/null 2>&1; then
  log "another cluster's kwok is running: the kwok address guard stays"
else
  "$HERE/kwok-guard.sh" down || log "removing the kwok address guard reported an error"
fi

if [ "$KEEP_LOGS" = 1 ]; then
  find "$STATE" -mindepth 1 -maxdepth 1 ! -name logs ! -name "logs.try*" -exec rm -rf {} +
  log "removed $STATE (kept logs/)"
else
  rm -rf "$STATE"
  log "removed $STATE"
fi
