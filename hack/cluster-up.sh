#!/usr/bin/env bash
# Start the local control plane on 127.0.0.1 (free ports): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, scheduler-plugins' scheduler (Coscheduling, for pods
# with schedulerName scheduler-plugins-scheduler) and controller (PodGroup status; the CRDs) and kwok
# with fake GPU nodes.
# Idempotent: exits at once when the cluster recorded in .cache/cluster/ is running and healthy;
# stale state (a crashed component) is torn down and started afresh.
# State: .cache/cluster/{kubeconfig,pki,pids,logs,etcd}; binaries linked into .cache/bin/.
# With DDPJOB_REAL_NODES > 0 (default 2) it then starts real nodes (hack/nodes-up.sh: containerd +
# kubelet per node, CoreDNS) whose pods really run; the API server then also listens on the pod
# bridge's gateway (10.248.0.1) so in-cluster clients reach it.
# Unless DDPJOB_KUEUE=0 it also runs Kueue (built from sigs.k8s.io/kueue, KUEUE_VERSION) with the pod
# integration, its webhooks served on 127.0.0.1; only pods in namespaces labelled
# ddpjob.dev/kueue=true are Kueue's (.cache/cluster/kueue.env says so for tests).
# Env: DDPJOB_CACHE (binary cache root), DDPJOB_FAKE_NODES (default 4), DDPJOB_REAL_NODES (default 2),
#      DDPJOB_KUEUE (default 1; 0: no Kueue), DDPJOB_CLUSTER_TIMEOUT (seconds per component, default 90),
#      DDPJOB_CLUSTER=oldest: a second control plane beside the first, at KUBE_OLDEST_VERSION (the
#      chart's floor; state in .cache/cluster-oldest/, kwok nodes only, no Kueue): the `versioned`
#      tests run against it (hack/test.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
KUBE_DIR="$CACHE/bin/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
# The control plane's own binaries (API server, controller-manager, scheduler) and the version its
# nodes report: the newest, or with DDPJOB_CLUSTER=oldest the floor's. etcd, kubectl and the rest
# are always the newest's.
CLUSTER_KIND="${DDPJOB_CLUSTER:-}"
case "$CLUSTER_KIND" in
  "") CP_DIR="$KUBE_DIR"; CP_VERSION="$KUBE_VERSION"; BUILD_TARGETS=(all) ;;
  oldest) CP_DIR="$CACHE/bin/kube-$KUBE_OLDEST_VERSION"; CP_VERSION="$KUBE_OLDEST_VERSION"; BUILD_TARGETS=(all oldest)
          export DDPJOB_REAL_NODES="${DDPJOB_REAL_NODES:-0}" DDPJOB_KUEUE="${DDPJOB_KUEUE:-0}" ;;
  *) echo "DDPJOB_CLUSTER=$CLUSTER_KIND: unknown (empty for the main cluster, or oldest)" >&2; exit 2 ;;
esac
KWOK_DIR="$CACHE/bin/kwok-$KWOK_VERSION"
HELM_DIR="$CACHE/bin/helm-$HELM_VERSION"
SP_DIR="$CACHE/bin/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION"
KUEUE_DIR="$CACHE/bin/kueue-$KUEUE_VERSION"
# shellcheck source=state-lib.sh
source "$HERE/state-lib.sh"
PIDS="$STATE/pids"
LOGS="$STATE/logs"
PKI="$STATE/pki"
BIN="$ROOT/.cache/bin"
KUBECONFIG_FILE="$STATE/kubeconfig"
NODES="${DDPJOB_FAKE_NODES:-4}"
REAL_NODES="${DDPJOB_REAL_NODES:-2}"
TIMEOUT="${DDPJOB_CLUSTER_TIMEOUT:-90}"
KUEUE="${DDPJOB_KUEUE:-1}"
KUEUE_NS_LABEL=ddpjob.dev/kueue
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler scheduler-plugins scheduler-plugins-controller kwok)
[ "$KUEUE" = 0 ] || COMPONENTS+=(kueue)
[ "$REAL_NODES" = 0 ] || COMPONENTS+=(registry)
T0=$SECONDS
# kwok's fictitious address ranges have one home: the guard that makes them unreachable.
{ read -r KWOK_POD_CIDR; read -r KWOK_NODE_CIDR; } < <("$HERE/kwok-guard.sh" ranges)

log() { printf '[hack/cluster-up %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# fail COMPONENT REASON: name the component, show its last log lines, stop what was started.
fail() {
  log "FAILED: $1: $2"
  if [ -f "$LOGS/$1.log" ]; then
    local errs
    errs="$(grep -E '^[EF][0-9]{4} |"level":"ERROR"|[Ee]rror:|[Ff]atal|panic:' "$LOGS/$1.log" | tail -n 8 || true)"
    [ -z "$errs" ] || { log "errors in $LOGS/$1.log:"; printf '%s\n' "$errs" | cut -c1-400 | sed 's/^/    /' >&2; }
    log "last lines of $LOGS/$1.log:"
    tail -n 12 "$LOGS/$1.log" | cut -c1-400 | sed 's/^/    /' >&2
  fi
  log "stopping the components started so far (logs kept in $LOGS)"
  "$HERE/cluster-down.sh" --keep-logs >&2 || true
  # Free ports are chosen before the components bind them, so another process can take one in
  # between; a fresh try with fresh ports fixes that. Genuine failures still fail on the last try.
  local try="${DDPJOB_CLUSTER_UP_TRY:-1}"
  if [ "$try" -lt 3 ]; then
    rm -rf "$LOGS.try$try" && mv "$LOGS" "$LOGS.try$try" 2>/dev/null || true
    log "retrying with fresh ports (try $((try + 1)) of 3; logs of this try in $LOGS.try$try)"
    DDPJOB_CLUSTER_UP_TRY=$((try + 1)) exec "$HERE/cluster-up.sh"
  fi
  exit 1
}

# pid_ok NAME: the recorded process is alive and is ours (its command line names this state dir).
pid_ok() {
  local f="$PIDS/$1.pid" pid
  [ -f "$f" ] || return 1
  pid="$(cat "$f")"
  [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF "$STATE"
}

# seen NAME: what became of the recorded process, for a failure's message.
seen() {
  local pid
  pid="$(cat "$PIDS/$1.pid" 2>/dev/null)" || { echo "no pid recorded"; return; }
  [ -r "/proc/$pid/cmdline" ] || { echo "pid $pid gone"; return; }
  echo "pid $pid is now: $(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-120)"
}

# alive NAME: the recorded process runs (pid_ok), or is inside the exec of its binary. setsid has
# exec'd it from this script's fork; between the kernel's swap to the new image and its laying out
# the arguments, the command line reads empty, and a loaded machine stretched that window past a
# health probe (the oldest plane's try 1 in rehearsal 38: "pid 24265 is now: ", its log written
# 11 s later). Empty, not a zombie, and this script's child: not exited.
alive() {
  pid_ok "$1" && return 0
  local pid stat
  pid="$(cat "$PIDS/$1.pid" 2>/dev/null)" || return 1
  stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
  [ -z "$(tr -d '\0' <"/proc/$pid/cmdline" 2>/dev/null)" ] || return 1
  set -- ${stat##*) }   # state, ppid, ...
  [ "$1" != Z ] && [ "$2" = "$$" ]
}

kc() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" --request-timeout=10s "$@"; }

all_alive() {
  local c
  for c in "${COMPONENTS[@]}"; do pid_ok "$c" || return 1; done
}

healthy() {
  all_alive || return 1
  [ -f "$KUBECONFIG_FILE" ] || return 1
  kc get --raw /readyz >/dev/null 2>&1 || return 1
  kc get nodes -l type=kwok -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}' 2>/dev/null \
    | grep -q True || return 1
  # Real nodes: as many Ready as asked for (a cluster started with another count is restarted).
  [ "$(kc get nodes -l ddpjob.dev/node-kind=real -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}' \
        2>/dev/null | tr ' ' '\n' | grep -c True)" -eq "$REAL_NODES" ]
}

# One cluster-up/cluster-down at a time per clone (parallel test sessions may all call this).
mkdir -p "$ROOT/.cache"
exec 9>"$STATE.lock"
flock -w 900 9 || { log "FAILED: another hack/cluster-up.sh holds $STATE.lock"; exit 1; }
export DDPJOB_CLUSTER_LOCKED=1

# link_binaries: .cache/bin/ -> the machine-level cache; kubectl is the one built with the
# control plane (same version as the API server), else the system's.
link_binaries() {
  local b kubectl_src
  mkdir -p "$BIN"
  # The main cluster's binaries only: a second cluster starts its own by their paths.
  for b in "$KUBE_DIR"/{kube-apiserver,kube-controller-manager,kube-scheduler,etcd} "$KWOK_DIR/kwok" "$HELM_DIR/helm" "$KUEUE_DIR/kueue"; do
    [ -x "$b" ] && ln -sfn "$b" "$BIN/$(basename "$b")"
  done
  [ -x "$SP_DIR/kube-scheduler" ] && ln -sfn "$SP_DIR/kube-scheduler" "$BIN/scheduler-plugins-scheduler"
  [ -x "$SP_DIR/controller" ] && ln -sfn "$SP_DIR/controller" "$BIN/scheduler-plugins-controller"
  if [ -x "$KUBE_DIR/kubectl" ]; then kubectl_src="$KUBE_DIR/kubectl"; else kubectl_src="$(command -v kubectl || true)"; fi
  [ -n "$kubectl_src" ] && ln -sfn "$kubectl_src" "$BIN/kubectl"
  KUBECTL="$BIN/kubectl"
}

# --- already running? -----------------------------------------------------------------------
link_binaries
# Every process alive but the API slow to answer (a loaded machine: tests beside it): give it a
# minute before calling the cluster stale, which would tear down one that works and every job in it.
if [ -x "$KUBECTL" ] && [ -f "$KUBECONFIG_FILE" ] && all_alive && ! healthy; then
  log "every component is running but the API server is slow to answer: waiting up to 60 s before restarting"
  for _ in $(seq 12); do healthy && break; sleep 5; done
fi
if [ -x "$KUBECTL" ] && healthy; then
  "$HERE/kwok-guard.sh" up || { log "FAILED: could not make kwok's address ranges unreachable (hack/kwok-guard.sh)"; exit 1; }
  log "already running and healthy ($(kc config view --minify -o jsonpath='{.clusters[0].cluster.server}')); export KUBECONFIG=$KUBECONFIG_FILE"
  exit 0
fi

# --- binaries (cached machine-wide; built from Go modules when missing) ----------------------
for target in "${BUILD_TARGETS[@]}"; do
  "$HERE/build.sh" "$target" >&2 || { log "FAILED: building the control plane (hack/build.sh $target)"; exit 1; }
done
# Said to hack/nodes-up.sh below: it then does not ask hack/build.sh again, whose lock another
# cluster-up may hold for minutes building what this one does not need (rehearsal 28: the real
# nodes waited 8 minutes for the oldest control plane's cold build).
export DDPJOB_BUILT=1
link_binaries
[ -x "$KUBECTL" ] || { log "FAILED: kubectl: neither built in $KUBE_DIR nor on PATH"; exit 1; }
command -v openssl >/dev/null || { log "FAILED: openssl is not installed (needed for the cluster's certificates)"; exit 1; }
command -v curl >/dev/null || { log "FAILED: curl is not installed (needed for health checks)"; exit 1; }

if [ -d "$STATE" ]; then
  log "found stale or unhealthy state in $STATE: stopping it and starting afresh"
  # On a retry (fail() above) the state holds the failed try's logs (logs.tryN): keep them.
  if [ "${DDPJOB_CLUSTER_UP_TRY:-1}" -gt 1 ]; then "$HERE/cluster-down.sh" --keep-logs >&2; else "$HERE/cluster-down.sh" >&2; fi
fi
mkdir -p "$PIDS" "$LOGS" "$PKI"

# --- ports ----------------------------------------------------------------------------------
# Bind all at once so they are distinct; a small race with other programs remains.
read -r P_ETCD P_PEER P_API P_KCM P_SCHED P_SP P_SPC P_KWOK P_KUEUE_WH P_KUEUE_HEALTH P_KUEUE_METRICS < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(11)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)
cat >"$STATE/ports.env" <<EOF
ETCD_PORT=$P_ETCD
APISERVER_PORT=$P_API
CONTROLLER_MANAGER_PORT=$P_KCM
SCHEDULER_PORT=$P_SCHED
SCHEDULER_PLUGINS_PORT=$P_SP
SCHEDULER_PLUGINS_CONTROLLER_PORT=$P_SPC
KWOK_PORT=$P_KWOK
APISERVER_URL=https://127.0.0.1:$P_API
EOF

# --- certificates ---------------------------------------------------------------------------
ossl() { openssl "$@" >>"$LOGS/openssl.log" 2>&1 || { log "FAILED: openssl $1 (see $LOGS/openssl.log)"; exit 1; }; }
ossl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 3650 \
  -subj "/CN=ddpjob-local-ca" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
# sign NAME SUBJECT EXTENSIONS
sign() {
  ossl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$1.key" -out "$PKI/$1.csr" -subj "$2"
  printf '%s\n' "$3" >"$PKI/$1.ext"
  ossl x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$PKI/$1.ext" -out "$PKI/$1.crt"
}
sign apiserver "/CN=kube-apiserver" "$(printf '%s\n' \
  'basicConstraints=CA:FALSE' 'keyUsage=critical,digitalSignature,keyEncipherment' \
  'extendedKeyUsage=serverAuth' \
  'subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1,IP:10.248.0.1')"
client_ext="$(printf '%s\n' 'basicConstraints=CA:FALSE' 'keyUsage=critical,digitalSignature,keyEncipherment' 'extendedKeyUsage=clientAuth')"
sign admin "/O=system:masters/CN=ddpjob-admin" "$client_ext"
sign controller-manager "/CN=system:kube-controller-manager" "$client_ext"
sign scheduler "/CN=system:kube-scheduler" "$client_ext"
sign scheduler-plugins-controller "/CN=ddpjob-local:scheduler-plugins-controller" "$client_ext"
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$PKI/sa.key"
ossl pkey -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"

APISERVER_PORT=$P_API
# shellcheck source=nodes-lib.sh
source "$HERE/nodes-lib.sh"   # write_kubeconfig FILE USER
write_kubeconfig "$KUBECONFIG_FILE.tmp" admin
write_kubeconfig "$STATE/controller-manager.kubeconfig" controller-manager
write_kubeconfig "$STATE/scheduler.kubeconfig" scheduler
write_kubeconfig "$STATE/scheduler-plugins-controller.kubeconfig" scheduler-plugins-controller

# --- processes ------------------------------------------------------------------------------
# start NAME BINARY ARGS...: own session (Ctrl-C in the calling terminal does not reach it),
# stdin and the lock's fd closed, output to its log; pid recorded for cluster-down.
start() {
  local name="$1" bin="$2"
  shift 2
  setsid "$bin" "$@" </dev/null >"$LOGS/$name.log" 2>&1 9>&- &
  local pid=$! n=0
  echo "$pid" >"$PIDS/$name.pid"
  # Until the forked shell has exec'd the binary, its command line is this script's, and pid_ok
  # (which wait_healthy asks) would call the process exited: on a loaded machine the child can go
  # unscheduled past the first health probe (kube-apiserver "exited" with an empty log, try 1 of
  # the oldest plane). Wait for the exec; one that exits at once is wait_healthy's to report.
  while ! pid_ok "$name" && [ -e "/proc/$pid" ] && [ "$n" -lt 200 ]; do sleep 0.05; n=$((n + 1)); done
}

# wait_healthy NAME DESCRIPTION CMD...: poll CMD until it succeeds, the process dies, or the deadline.
wait_healthy() {
  local name="$1" what="$2" end=$((SECONDS + TIMEOUT))
  shift 2
  until "$@" >/dev/null 2>&1; do
    alive "$name" || fail "$name" "the process exited while waiting for $what ($(seen "$name"))"
    [ "$SECONDS" -lt "$end" ] || fail "$name" "not healthy after ${TIMEOUT}s ($what)"
    sleep 0.2
  done
  log "$name: healthy ($what)"
}

curl_ok() { curl -fsS --max-time 3 "$@"; }

start etcd "$KUBE_DIR/etcd" --name ddpjob --data-dir "$STATE/etcd" \
  --listen-client-urls "http://127.0.0.1:$P_ETCD" --advertise-client-urls "http://127.0.0.1:$P_ETCD" \
  --listen-peer-urls "http://127.0.0.1:$P_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$P_PEER" \
  --initial-cluster "ddpjob=http://127.0.0.1:$P_PEER" --unsafe-no-fsync --log-level warn
etcd_ok() { curl_ok "http://127.0.0.1:$P_ETCD/health" | grep -q '"health":"true"'; }
wait_healthy etcd "GET /health on :$P_ETCD" etcd_ok

# /debug/pprof stays off, as on the clusters people have; bench/operator_scale.py --apiserver-profile
# asks for it (DDPJOB_API_PROFILING=true) to see where the API server's CPU goes beside our operator.
# Real nodes' pods reach the API server through the bridge gateway (10.248.0.1), which only exists
# once nodes-up has made the bridges: listen on every local address then. The kubelets
# authenticate as system:node:<name> (Node authorizer + NodeRestriction, as on a real cluster), and
# the API server reaches them (logs, exec) at their InternalIP, not by resolving node names.
API_BIND=127.0.0.1
[ "$REAL_NODES" -gt 0 ] && API_BIND=0.0.0.0
start kube-apiserver "$CP_DIR/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$P_ETCD" \
  --bind-address "$API_BIND" --advertise-address 127.0.0.1 --secure-port "$P_API" \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
  --client-ca-file "$PKI/ca.crt" \
  --authorization-mode Node,RBAC \
  --enable-admission-plugins RuntimeClass,NodeRestriction \
  --kubelet-preferred-address-types InternalIP,Hostname \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --endpoint-reconciler-type none \
  --allow-privileged=true --profiling="${DDPJOB_API_PROFILING:-false}"
api_ok() {
  curl_ok --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$P_API/readyz" | grep -qx ok
}
wait_healthy kube-apiserver "GET /readyz on :$P_API" api_ok
mv "$KUBECONFIG_FILE.tmp" "$KUBECONFIG_FILE"

# Gang scheduling: the CRDs; read access to PodGroups for the second scheduler, which
# authenticates as kube-scheduler does (system:kube-scheduler: the default RBAC covers the rest);
# upstream's rules for the controller (its own user). Before either starts: the scheduler's
# Coscheduling plugin looks PodGroups up through a cache that needs the kind to exist.

# grant NAME USER RULES: ClusterRole NAME with RULES (YAML list items), bound to USER.
grant() {
  cat <<EOF
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "$1"}
rules:
$3
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "$1"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "$1"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "$2"}
EOF
}
sp_rbac() {
  grant ddpjob-local:scheduler-plugins system:kube-scheduler \
    '- {apiGroups: [scheduling.x-k8s.io], resources: [podgroups], verbs: [get, list, watch]}'
  grant ddpjob-local:scheduler-plugins-controller ddpjob-local:scheduler-plugins-controller "$(printf '%s\n' \
    '- {apiGroups: [""], resources: [pods], verbs: [get, list, watch]}' \
    '- {apiGroups: ["", events.k8s.io], resources: [events], verbs: [create, patch, update]}' \
    '- {apiGroups: [scheduling.x-k8s.io], resources: [podgroups, elasticquotas, podgroups/status, elasticquotas/status], verbs: [get, list, watch, update, patch]}')"
}
sp_rbac | kc apply -f "$HERE/crds/scheduling.x-k8s.io_podgroups.yaml" -f "$HERE/crds/scheduling.x-k8s.io_elasticquotas.yaml" -f - \
    >>"$LOGS/kubectl.log" 2>&1 \
  || { log "FAILED: creating the PodGroup CRDs and their RBAC:"; tail -5 "$LOGS/kubectl.log" >&2; fail kube-apiserver "PodGroup CRDs not created"; }
sp_crds_ok() {
  [ "$(kc get crd podgroups.scheduling.x-k8s.io elasticquotas.scheduling.x-k8s.io \
        -o jsonpath='{.items[*].status.conditions[?(@.type=="Established")].status}')" = "True True" ]
}
wait_healthy kube-apiserver "CRDs podgroups, elasticquotas.scheduling.x-k8s.io Established" sp_crds_ok

# Only pods that name its profile are its: ordinary pods keep default-scheduler (kube-scheduler).
# permitWaitingTimeSeconds: how long the members of a gang that cannot all fit hold their
# reserved nodes before all are released (upstream's example value).
cat >"$STATE/scheduler-plugins.yaml" <<EOF
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: false
clientConnection:
  kubeconfig: $STATE/scheduler.kubeconfig
profiles:
- schedulerName: scheduler-plugins-scheduler
  plugins:
    multiPoint:
      enabled:
      - name: Coscheduling
    queueSort:
      enabled:
      - name: Coscheduling
      disabled:
      - name: "*"
  pluginConfig:
  - name: Coscheduling
    args:
      permitWaitingTimeSeconds: 10
EOF

start kube-controller-manager "$CP_DIR/kube-controller-manager" \
  --kubeconfig "$STATE/controller-manager.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$P_KCM" \
  --controllers '*' --use-service-account-credentials \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
  --cluster-name ddpjob-local --leader-elect=false
start kube-scheduler "$CP_DIR/kube-scheduler" \
  --kubeconfig "$STATE/scheduler.kubeconfig" \
  --bind-address 127.0.0.1 --secure-port "$P_SCHED" --leader-elect=false
# --pod-max-in-unschedulable-pods-duration: Coscheduling requeues a pod it turned away (a gang
# member released at its Permit timeout, or rejected because a sibling did not fit) only when a
# pod is added or a PodGroup changes, never when a bound pod is deleted. A gang that waited for
# another's GPUs can then sit unschedulable after they are free until the queue's leftover flush
# (every 30 s) takes pods older than this: 5 min by default, 10 s here (kube-scheduler's
# deprecated flag, "the only workaround", kubernetes/kubernetes#110175).
# Built on Kubernetes 1.34, where dynamic resource allocation is GA and its scheduler watches
# resource.k8s.io/v1, which 1.32 does not serve (beta there, off by default): the scheduler would
# wait for those caches forever and bind nothing. Off on the oldest control plane, as on 1.32's own.
SP_FLAGS=()
[ "$CLUSTER_KIND" = oldest ] && SP_FLAGS+=(--feature-gates=DynamicResourceAllocation=false)
start scheduler-plugins "$SP_DIR/kube-scheduler" \
  --config "$STATE/scheduler-plugins.yaml" --bind-address 127.0.0.1 --secure-port "$P_SP" \
  --pod-max-in-unschedulable-pods-duration 10s "${SP_FLAGS[@]}"
# It writes PodGroups' status (phase Pending, Scheduling, Running, Finished, Failed; counts of
# running/succeeded/failed pods), which the scheduler never does. Metrics off; probes on loopback
# (both listen on every address by default).
start scheduler-plugins-controller "$SP_DIR/controller" \
  --kubeconfig "$STATE/scheduler-plugins-controller.kubeconfig" \
  --metricsAddr 0 --probeAddr "127.0.0.1:$P_SPC"
# Before kwok hands out its first fictitious address, nothing here may reach those addresses.
"$HERE/kwok-guard.sh" up || fail kwok "could not make kwok's address ranges unreachable (hack/kwok-guard.sh)"
start kwok "$KWOK_DIR/kwok" \
  --kubeconfig "$KUBECONFIG_FILE" \
  --manage-all-nodes=false --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
  --node-lease-duration-seconds 40 --cidr "$KWOK_POD_CIDR" \
  --server-address "127.0.0.1:$P_KWOK" \
  -c "$HERE/kwok-config.yaml" -c "$HERE/kwok-stages.yaml"
wait_healthy kube-controller-manager "GET /healthz on :$P_KCM" curl_ok -k "https://127.0.0.1:$P_KCM/healthz"
wait_healthy kube-scheduler "GET /healthz on :$P_SCHED" curl_ok -k "https://127.0.0.1:$P_SCHED/healthz"
wait_healthy scheduler-plugins "GET /healthz on :$P_SP" curl_ok -k "https://127.0.0.1:$P_SP/healthz"
wait_healthy scheduler-plugins-controller "GET /readyz on :$P_SPC" curl_ok "http://127.0.0.1:$P_SPC/readyz"
wait_healthy kwok "GET /healthz on :$P_KWOK" curl_ok "http://127.0.0.1:$P_KWOK/healthz"

# --- objects: fake GPU nodes, the nvidia RuntimeClass ---------------------------------------
nodes_yaml() {
  local i
  for ((i = 0; i < NODES; i++)); do
    cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    type: kwok
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: kwok-gpu-$i
    node.kubernetes.io/instance-type: p5.48xlarge
    topology.kubernetes.io/zone: local-a
    nvidia.com/gpu.present: "true"
    nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3
    nvidia.com/gpu.count: "8"
    nvidia.com/gpu.memory: "81559"
spec: {}
status:
  addresses:
  - {type: InternalIP, address: ${KWOK_NODE_CIDR%.*/*}.$((i + 1))}
  - {type: Hostname, address: kwok-gpu-$i}
  capacity: {cpu: "64", memory: 512Gi, pods: "110", ephemeral-storage: 1Ti, nvidia.com/gpu: "8"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "110", ephemeral-storage: 1Ti, nvidia.com/gpu: "8"}
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: $CP_VERSION
EOF
  done
  cat <<EOF
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata:
  name: nvidia
handler: nvidia
---
# Volumes for examples/resnet-gpu.yaml's claims (no storage class), so the example can reach
# Running on this control plane; nothing provisions volumes here otherwise.
apiVersion: v1
kind: PersistentVolume
metadata: {name: ddpjob-demo-imagenet}
spec: {capacity: {storage: 1Ti}, accessModes: [ReadOnlyMany, ReadWriteMany], storageClassName: "", claimRef: {namespace: default, name: imagenet}, hostPath: {path: /tmp/ddpjob-demo-imagenet}}
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: ddpjob-demo-checkpoints}
spec: {capacity: {storage: 1Ti}, accessModes: [ReadWriteMany], storageClassName: "", claimRef: {namespace: default, name: resnet-checkpoints}, hostPath: {path: /tmp/ddpjob-demo-checkpoints}}
EOF
}
nodes_yaml >"$STATE/objects.yaml"
kc apply -f "$STATE/objects.yaml" >>"$LOGS/kubectl.log" 2>&1 \
  || { log "FAILED: creating fake nodes and the nvidia RuntimeClass:"; tail -5 "$LOGS/kubectl.log" >&2; fail kwok "objects not created"; }
nodes_ready() {
  [ "$(kc get nodes -l type=kwok -o jsonpath='{.items[*].status.conditions[?(@.type=="Ready")].status}' \
        | tr ' ' '\n' | grep -c True)" -ge "$NODES" ]
}
wait_healthy kwok "$NODES fake GPU nodes Ready" nodes_ready
wait_healthy kube-controller-manager "ServiceAccount default/default created" kc get serviceaccount default -n default

# --- Kueue (DDPJOB_KUEUE=1) -------------------------------------------------------------------
if [ "$KUEUE" != 0 ]; then
  t_kueue=$SECONDS
  KUEUE_SRC="$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION/config/components"
  [ -d "$KUEUE_SRC" ] || fail kube-apiserver "Kueue's manifests are not in $KUEUE_SRC (hack/build.sh kueue downloads them; DDPJOB_KUEUE=1 for hack/build.sh all)"
  KDIR="$STATE/kueue"
  mkdir -p "$KDIR/certs"
  sign kueue-webhook "/CN=kueue-webhook" "$(printf '%s\n' 'basicConstraints=CA:FALSE' \
    'keyUsage=critical,digitalSignature,keyEncipherment' 'extendedKeyUsage=serverAuth' 'subjectAltName=IP:127.0.0.1')"
  cp "$PKI/kueue-webhook.crt" "$KDIR/certs/tls.crt"
  cp "$PKI/kueue-webhook.key" "$KDIR/certs/tls.key"
  # Kueue's own ClusterRoles (kueue-objects.py binds them), not system:masters.
  sign kueue "/CN=ddpjob-kueue" "$client_ext"
  write_kubeconfig "$KDIR/kubeconfig" kueue
  # Without internal cert management Kueue reads its metrics serving certificate from this fixed
  # path, and exits if it is missing. Nothing here scrapes Kueue, so any certificate will do: one
  # is made once per machine and shared by every clone's cluster.
  if [ ! -s /etc/kueue/metrics/certs/tls.crt ]; then
    mkdir -p /etc/kueue/metrics/certs 2>/dev/null \
      || fail kube-apiserver "Kueue needs /etc/kueue/metrics/certs/tls.{crt,key} and this user cannot create them"
    ossl req -x509 -newkey rsa:2048 -nodes -keyout /etc/kueue/metrics/certs/tls.key \
      -out /etc/kueue/metrics/certs/tls.crt -days 3650 -subj "/CN=kueue-metrics" -addext "subjectAltName=IP:127.0.0.1"
  fi
  cat >"$KDIR/config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$P_KUEUE_HEALTH
metrics:
  bindAddress: 127.0.0.1:$P_KUEUE_METRICS
webhook:
  host: 127.0.0.1
  port: $P_KUEUE_WH
  certDir: $KDIR/certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
# Pods are Kueue's only in labelled namespaces (the pod webhooks' namespaceSelector is the same),
# and there only those with a kueue.x-k8s.io/queue-name label.
manageJobsWithoutQueueName: false
managedJobsNamespaceSelector:
  matchLabels:
    $KUEUE_NS_LABEL: "true"
integrations:
  frameworks: [pod]
featureGates:
  # The pending-workloads API is an aggregated API server of its own (port 8082 on every address).
  VisibilityOnDemand: false
EOF
  kc apply --server-side --force-conflicts -f "$KUEUE_SRC/crd/bases" >>"$LOGS/kubectl.log" 2>&1 \
    || fail kube-apiserver "applying Kueue's CRDs (see $LOGS/kubectl.log)"
  # Kueue serves v1beta1 <-> v1beta2 conversion for these (its kustomize patches crd/patches/webhook_in_*).
  conversion="{\"spec\":{\"conversion\":{\"strategy\":\"Webhook\",\"webhook\":{\"conversionReviewVersions\":[\"v1\"],
    \"clientConfig\":{\"url\":\"https://127.0.0.1:$P_KUEUE_WH/convert\",\"caBundle\":\"$(base64 -w0 <"$PKI/ca.crt")\"}}}}}"
  for crd in localqueues clusterqueues cohorts workloads multikueueclusters; do
    kc patch crd "$crd.kueue.x-k8s.io" --type=merge -p "$conversion" >>"$LOGS/kubectl.log" 2>&1 \
      || fail kube-apiserver "setting the conversion webhook of $crd.kueue.x-k8s.io (see $LOGS/kubectl.log)"
  done
  kc create --dry-run=client -o json -f "$KUEUE_SRC/webhook/manifests.yaml" \
      -f "$KUEUE_SRC/rbac/role.yaml" -f "$KUEUE_SRC/rbac/metrics_auth_role.yaml" \
      -f "$KUEUE_SRC/rbac/manager_secrets_role.yaml" 2>>"$LOGS/kubectl.log" \
    | python3 "$HERE/kueue-objects.py" "https://127.0.0.1:$P_KUEUE_WH" "$PKI/ca.crt" ddpjob-kueue "$KUEUE_NS_LABEL" \
      >"$KDIR/objects.json" || fail kube-apiserver "rewriting Kueue's webhook and RBAC manifests (hack/kueue-objects.py)"
  { kc create namespace kueue-system && kc apply -f "$KDIR/objects.json"; } >>"$LOGS/kubectl.log" 2>&1 \
    || fail kube-apiserver "applying Kueue's webhooks and RBAC (see $LOGS/kubectl.log)"
  crds_established() {
    [ "$(kc get crd -o jsonpath='{range .items[*]}{.spec.group} {.status.conditions[?(@.type=="Established")].status}{"\n"}{end}' \
          | grep -c '^kueue.x-k8s.io True$')" -ge "$(find "$KUEUE_SRC/crd/bases" -name '*.yaml' | wc -l)" ]
  }
  wait_healthy kube-apiserver "Kueue's CRDs Established" crds_established
  start kueue "$KUEUE_DIR/kueue" --config "$KDIR/config.yaml" --kubeconfig "$KDIR/kubeconfig"
  wait_healthy kueue "GET /readyz on :$P_KUEUE_HEALTH" curl_ok "http://127.0.0.1:$P_KUEUE_HEALTH/readyz"
  cat >"$STATE/kueue.env" <<EOF
KUEUE_VERSION=$KUEUE_VERSION
KUEUE_NAMESPACE_LABEL=$KUEUE_NS_LABEL
KUEUE_WEBHOOK_PORT=$P_KUEUE_WH
KUEUE_HEALTH_PORT=$P_KUEUE_HEALTH
EOF
  log "kueue: $KUEUE_VERSION up in $((SECONDS - t_kueue))s (pods managed in namespaces labelled $KUEUE_NS_LABEL=true)"
fi

if [ "$REAL_NODES" -gt 0 ]; then
  # The registry the nodes pull our images from: before them, since their containerd are told where.
  "$HERE/registry.sh" up || fail registry "the local registry did not start (hack/registry.sh)"
  "$HERE/nodes-up.sh" || fail kube-apiserver "real nodes did not come up (hack/nodes-up.sh; DDPJOB_REAL_NODES=0 skips them)"
fi

log "up in $((SECONDS - T0))s: Kubernetes $CP_VERSION, API server https://127.0.0.1:$P_API, $NODES fake nodes x 8 nvidia.com/gpu, $REAL_NODES real nodes$([ "$KUEUE" = 0 ] || echo ", Kueue $KUEUE_VERSION")"
log "export KUBECONFIG=$KUBECONFIG_FILE   (binaries: $BIN)"
