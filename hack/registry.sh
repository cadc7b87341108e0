#!/usr/bin/env bash
# The local OCI registry: Debian's docker-registry (CNCF distribution 2.8) on a free loopback port.
# The real nodes' containerd pull every image of ours from it (hack/images.sh pushes them there), as
# a cluster pulls from a registry, and `make release` publishes images and the chart to it in the
# tests. hack/cluster-up.sh starts it before the real nodes (their containerd are told where it is)
# and hack/cluster-down.sh stops it. Its storage is machine-level ($DDPJOB_CACHE/registry): a new
# cluster-up pushes only what changed.
#   hack/registry.sh up     start it (idempotent); $STATE/registry.env says where (REGISTRY=127.0.0.1:PORT)
#   hack/registry.sh down   stop it
#   hack/registry.sh addr   print 127.0.0.1:PORT of the running one
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
# shellcheck source=state-lib.sh
source "$HERE/state-lib.sh"
STATE="$(cluster_state_dir)"   # the main cluster: the registry is its
STORE="$CACHE/registry"
CONFIG="$STATE/registry.yml"
PIDFILE="$STATE/pids/registry.pid"
ENVFILE="$STATE/registry.env"
LOG="$STATE/logs/registry.log"

log() { printf '[hack/registry %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

running() {  # the recorded process is alive and is ours (its command line names our config)
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null)" || return 1
  [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF "$CONFIG"
}

addr() { sed -n 's/^REGISTRY=//p' "$ENVFILE" 2>/dev/null; }

write_config() {  # write_config ADDR
  cat >"$CONFIG" <<EOF
version: 0.1
log:
  level: warn
  accesslog: {disabled: true}
storage:
  filesystem: {rootdirectory: $STORE}
  # Old :dev builds are dropped by the garbage collection at each start (below).
  delete: {enabled: true}
  redirect: {disable: true}
http:
  addr: $1
EOF
}

up() {
  if running && curl -fsS --max-time 3 "http://$(addr)/v2/" >/dev/null 2>&1; then
    log "running on $(addr)"; return
  fi
  "$HERE/ensure-node-packages.sh"
  [ -x /usr/bin/docker-registry ] || die "docker-registry is not installed (hack/ensure-node-packages.sh)"
  mkdir -p "$STORE" "$STATE/pids" "$STATE/logs"
  local port
  # This storage's last port where it is free: buildah remembers where it pushed each layer by
  # registry host:port (its blob-info cache), so at the same address a layer the storage already
  # holds is found with one HEAD. At a new port every push compressed and uploaded the trainer
  # image's torch layer again (6.4 minutes of rehearsal 41).
  port="$(python3 - "$STORE/.port" <<'PY'
import socket, sys

def bind(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the registry's own listen does
    s.bind(("127.0.0.1", port))
    return s.getsockname()[1]

try:
    print(bind(int(open(sys.argv[1]).read())))
except (OSError, ValueError, OverflowError):  # taken, or not a port number
    print(bind(0))
PY
)"
  echo "$port" >"$STORE/.port"
  write_config "127.0.0.1:$port"
  # Blobs no tag refers to any more (each rebuilt trainer image leaves a few hundred MB): collected
  # only while no registry serves this storage (another clone's may), as distribution requires.
  if ! pgrep -f "docker-registry serve" >/dev/null 2>&1; then
    /usr/bin/docker-registry garbage-collect --delete-untagged "$CONFIG" >"$STATE/logs/registry-gc.log" 2>&1 \
      || log "garbage collection reported an error (see $STATE/logs/registry-gc.log); starting anyway"
  fi
  setsid /usr/bin/docker-registry serve "$CONFIG" </dev/null >"$LOG" 2>&1 9>&- 8>&- 7>&- &
  echo $! >"$PIDFILE"
  echo "REGISTRY=127.0.0.1:$port" >"$ENVFILE"
  local end=$((SECONDS + 30))
  until curl -fsS --max-time 2 "http://127.0.0.1:$port/v2/" >/dev/null 2>&1; do
    running || die "docker-registry exited (see $LOG): $(tail -3 "$LOG")"
    [ "$SECONDS" -lt "$end" ] || die "docker-registry not serving /v2/ on 127.0.0.1:$port after 30s (see $LOG)"
    sleep 0.2
  done
  log "serving on 127.0.0.1:$port (storage $STORE)"
}

down() {
  running || { rm -f "$ENVFILE"; return 0; }
  local pid
  pid="$(cat "$PIDFILE")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do running || break; sleep 0.2; done
  running && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$ENVFILE"
  log "stopped"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  addr) running || die "not running (hack/registry.sh up)"; addr ;;
  *) die "unknown command '$1' (up | down | addr)" ;;
esac
