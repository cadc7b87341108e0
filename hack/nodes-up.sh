#!/usr/bin/env bash
# Start the real nodes of the local cluster (called by hack/cluster-up.sh once the control plane is
# up): per node its own containerd (root, state, socket, CNI network and bridge) and its own kubelet
# (root dir, ports, node name), plus one CoreDNS for the cluster. Pods on these nodes really run
# our images; kwok's fake GPU nodes stay for scheduling and scale tests.
#   node i: name ddpjob-node-<i>, bridge ddpbr<i>, pod subnet 10.248.<i>.0/24, node IP 10.248.<i>.1
#   label ddpjob.dev/node-kind=real, taint ddpjob.dev/real-node=true:NoSchedule (tests opt in)
#   cluster DNS: CoreDNS on 10.248.0.1:53 (cluster.local; nothing is forwarded anywhere else)
# Pod traffic stays between our bridges and the host: ipMasq off and iptables drops any forward
# from the pod range to another destination (this workplace allows no other traffic).
# Env: DDPJOB_REAL_NODES (default 2; 0 starts none). Everything is undone by hack/cluster-down.sh.
set -Eeuo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
source "$HERE/nodes-lib.sh"
COUNT="${DDPJOB_REAL_NODES:-2}"
TIMEOUT="${DDPJOB_CLUSTER_TIMEOUT:-90}"
[ "$COUNT" -gt 0 ] || exit 0
[ "$COUNT" -le 16 ] || { echo "DDPJOB_REAL_NODES=$COUNT: at most 16" >&2; exit 1; }
source "$STATE/ports.env"
T0=$SECONDS

log() { printf '[hack/nodes-up %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# set -e ends the script silently; say where, or cluster-up can only report "did not come up".
trap 'log "FAILED: line $LINENO: $BASH_COMMAND (exit $?)"' ERR
fail() {
  log "FAILED: $1: $2"
  if [ -f "$LOGS/$1.log" ]; then
    log "last lines of $LOGS/$1.log:"; tail -n 15 "$LOGS/$1.log" | cut -c1-400 | sed 's/^/    /' >&2
  fi
  exit 1
}
start() {  # start NAME BINARY ARGS...: own session, output to its log, pid recorded for cluster-down
  local name="$1" bin="$2"; shift 2
  setsid "$bin" "$@" </dev/null >"$LOGS/$name.log" 2>&1 9>&- 8>&- 7>&- &
  echo $! >"$PIDS/$name.pid"
}
alive() { local p; p="$(cat "$PIDS/$1.pid" 2>/dev/null)" && [ -d "/proc/$p" ]; }
wait_for() {  # wait_for NAME WHAT CMD...
  local name="$1" what="$2" end=$((SECONDS + TIMEOUT)); shift 2
  until "$@" >/dev/null 2>&1; do
    alive "$name" || fail "$name" "exited while waiting for $what"
    [ "$SECONDS" -lt "$end" ] || fail "$name" "not ready after ${TIMEOUT}s ($what)"
    sleep 0.3
  done
  log "$name: $what"
}

"$HERE/ensure-node-packages.sh"
[ "${DDPJOB_BUILT:-0}" = 1 ] || "$HERE/build.sh" nodes >&2   # hack/cluster-up.sh built them (all)
command -v runc >/dev/null || fail nodes "runc is not installed"
# One set of real nodes per machine: their containerd roots (which keep the imported images
# between cluster-up runs) are machine-wide.
owner_running() {  # owner_running STATE_DIR: a containerd recorded there is alive and is ours
  local f pid
  for f in "$1"/pids/containerd-*.pid; do
    [ -f "$f" ] || continue
    pid="$(cat "$f")"
    tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q containerd && return 0
  done
  return 1
}
for i in $(seq 0 $((COUNT - 1))); do
  other="$(cat "$CONTAINERD_CACHE/node-$i.owner" 2>/dev/null || true)"
  if [ -n "$other" ] && [ "$other" != "$STATE" ] && owner_running "$other"; then
    fail nodes "real nodes of another cluster ($other) are running on this machine; stop them with its cluster-down first"
  fi
done
sweep_dead_clusters
mkdir -p "$NODES_RUN" "$NODES_VAR" "$CONTAINERD_CACHE"
sysctl -qw net.ipv4.ip_forward=1

# --- network: one bridge per node, traffic kept between them -------------------------------
iptables -C FORWARD -s "$POD_RANGE" -d "$POD_RANGE" -m comment --comment "$IPT_TAG" -j ACCEPT 2>/dev/null \
  || iptables -I FORWARD 1 -s "$POD_RANGE" -d "$POD_RANGE" -m comment --comment "$IPT_TAG" -j ACCEPT
iptables -C FORWARD -s "$POD_RANGE" -m comment --comment "$IPT_TAG" -j DROP 2>/dev/null \
  || iptables -I FORWARD 2 -s "$POD_RANGE" -m comment --comment "$IPT_TAG" -j DROP
iptables -C FORWARD -d "$POD_RANGE" -m comment --comment "$IPT_TAG" -j DROP 2>/dev/null \
  || iptables -I FORWARD 3 -d "$POD_RANGE" -m comment --comment "$IPT_TAG" -j DROP

# No kube-proxy here: the one ClusterIP pods need is the API server's (in-cluster clients such as
# the operator use KUBERNETES_SERVICE_HOST=10.96.0.1:443), so map it the way kube-proxy would.
iptables -t nat -C PREROUTING -s "$POD_RANGE" -d 10.96.0.1/32 -p tcp --dport 443 -m comment --comment "$IPT_TAG" \
    -j DNAT --to-destination "$DNS_IP:$APISERVER_PORT" 2>/dev/null \
  || iptables -t nat -A PREROUTING -s "$POD_RANGE" -d 10.96.0.1/32 -p tcp --dport 443 -m comment --comment "$IPT_TAG" \
    -j DNAT --to-destination "$DNS_IP:$APISERVER_PORT"

# write_registry_hosts DIR: containerd's hosts.toml for the local registry, under its own
# address and under `localhost` (the development images' registry name, localhost/ddpjob/*).
[ -f "$STATE/registry.env" ] || fail nodes "no local registry ($STATE/registry.env missing: hack/registry.sh up)"
source "$STATE/registry.env"
write_registry_hosts() {
  local host
  rm -rf "$1" && mkdir -p "$1"
  for host in localhost "$REGISTRY"; do
    mkdir -p "$1/$host"
    printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
      "$REGISTRY" "$REGISTRY" >"$1/$host/hosts.toml"
  done
}

names=()
{
  echo "REAL_NODE_COUNT=$COUNT"
  echo "CLUSTER_DNS=$DNS_IP"
  echo "REGISTRY=$REGISTRY"
} >"$STATE/nodes.env.tmp"
for i in $(seq 0 $((COUNT - 1))); do
  node="ddpjob-node-$i"; names+=("$node")
  br="ddpbr$i"; gw="10.248.$i.1"
  ip link show "$br" >/dev/null 2>&1 || ip link add "$br" type bridge
  ip addr show dev "$br" | grep -q "inet $gw/24" || ip addr add "$gw/24" dev "$br"
  ip link set "$br" up
  run="$NODES_RUN/$node"; var="$NODES_VAR/$node"; croot="$CONTAINERD_CACHE/node-$i"
  mkdir -p "$run" "$var/kubelet" "$var/pod-logs" "$var/cni-ipam" "$run/net.d" "$croot"
  echo "$STATE" >"$CONTAINERD_CACHE/node-$i.owner"
  cat >"$run/net.d/10-ddpjob.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "ddpjob-$i",
  "plugins": [
    {"type": "bridge", "bridge": "$br", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$var/cni-ipam",
              "ranges": [[{"subnet": "10.248.$i.0/24", "gateway": "$gw"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}}
  ]
}
JSON
  cat >"$run/containerd.toml" <<TOML
version = 2
root = "$croot"
state = "$run/state"
[grpc]
  address = "$run/containerd.sock"
[ttrpc]
  address = "$run/containerd-ttrpc.sock"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/ddpjob/pause:$KUBE_VERSION"
  # Without CAP_SYS_RESOURCE (this sandbox) runc cannot set the negative oom_score_adj kubelet asks
  # for: "can't get final child's PID from pipe". Clamp it instead.
  restrict_oom_score_adj = true
  # Network namespaces under our state dir, so cluster-down finds (and removes) exactly ours.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$run/net.d"
  # Where images come from: the local registry (hack/registry.sh), plain HTTP on loopback, under
  # its own address and as the registry of our localhost/ddpjob/* development images.
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$run/certs.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
TOML
  write_registry_hosts "$run/certs.d"
  start "containerd-$i" containerd --config "$run/containerd.toml"
  {
    echo "CONTAINERD_SOCK_${node//-/_}=$run/containerd.sock"
    echo "CONTAINERD_ROOT_${node//-/_}=$croot"
    echo "CONTAINERD_HOSTS_${node//-/_}=$run/certs.d"
  } >>"$STATE/nodes.env.tmp"
done
echo "REAL_NODE_NAMES=\"${names[*]}\"" >>"$STATE/nodes.env.tmp"
mv "$STATE/nodes.env.tmp" "$STATE/nodes.env"
for i in $(seq 0 $((COUNT - 1))); do
  wait_for "containerd-$i" "serving on its socket" ctr -a "$NODES_RUN/ddpjob-node-$i/containerd.sock" version
done

# --- images: the pod sandbox at least (the product images come with `make images`) ----------
"$HERE/images.sh" pause >&2

# --- CoreDNS ----------------------------------------------------------------------------------
read -r P_DNS_HEALTH < <(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat >"$STATE/Corefile" <<EOF2
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $DNS_IP
    errors
    health 127.0.0.1:$P_DNS_HEALTH
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $KUBECONFIG_FILE ddpjob-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 5
}
.:53 {
    bind $DNS_IP
    # No upstream: names outside the cluster get an immediate NXDOMAIN, never a forward.
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF2
start coredns "$COREDNS_BIN" -conf "$STATE/Corefile"
wait_for coredns "healthy, serving cluster.local on $DNS_IP:53" curl -fsS --max-time 2 "http://127.0.0.1:$P_DNS_HEALTH/health"

# --- kubelets ---------------------------------------------------------------------------------
for i in $(seq 0 $((COUNT - 1))); do
  node="ddpjob-node-$i"; run="$NODES_RUN/$node"; var="$NODES_VAR/$node"; gw="10.248.$i.1"
  read -r P_KUBELET P_HEALTHZ < <(python3 -c 'import socket
ss=[socket.socket() for _ in range(2)]
[s.bind(("127.0.0.1",0)) for s in ss]
print(*[s.getsockname()[1] for s in ss])')
  sign_node_cert "$node"
  write_kubeconfig "$var/kubeconfig" "$node"
  printf 'search cluster.local\noptions ndots:5\n' >"$var/resolv.conf"
  cat >"$var/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This VM: cgroup v1 (hybrid), no systemd, no CAP_SYS_RESOURCE, two kubelets on one host.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix://$run/containerd.sock
address: $gw
port: $P_KUBELET
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $P_HEALTHZ
podLogsDir: $var/pod-logs
clusterDNS: [$DNS_IP]
clusterDomain: cluster.local
resolvConf: $var/resolv.conf
# A local test node: the API server (our own, on loopback) is its only client.
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
registerWithTaints:
- {key: ddpjob.dev/real-node, value: "true", effect: NoSchedule}
# Never garbage-collect images (a pull of the multi-GB trainer image costs minutes on this VM) and do
# not evict on this shared VM's disk or memory levels.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
maxPods: 30
serializeImagePulls: false
YAML
  start "kubelet-$i" "$KUBELET_BIN" --config "$var/kubelet.yaml" --kubeconfig "$var/kubeconfig" \
    --root-dir "$var/kubelet" --cert-dir "$var/kubelet/pki" --hostname-override "$node" --node-ip "$gw" \
    --node-labels "ddpjob.dev/node-kind=real" --v 1
done
node_ready() {
  [ "$("$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" get node "$1" \
        -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}
for i in $(seq 0 $((COUNT - 1))); do
  wait_for "kubelet-$i" "node ddpjob-node-$i Ready" node_ready "ddpjob-node-$i"
done
log "$COUNT real nodes up in $((SECONDS - T0))s (pods 10.248.<i>.0/24, DNS $DNS_IP)"
