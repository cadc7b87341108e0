# Shared by hack/nodes-up.sh, hack/nodes-down.sh and hack/images.sh: where the real nodes live.
# Sourced, not run. Needs HERE, ROOT and versions.env already loaded.
CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
KUBE_DIR="$CACHE/bin/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
KUBELET_BIN="$KUBE_DIR/kubelet"
COREDNS_BIN="$CACHE/bin/coredns-$COREDNS_VERSION/coredns"
# The main cluster's state, or the second control plane's (DDPJOB_CLUSTER=oldest, hack/cluster-up.sh):
# cluster-up sources this file for write_kubeconfig, and must keep its own cluster's paths.
# shellcheck source=state-lib.sh
source "$HERE/state-lib.sh"
PIDS="$STATE/pids"
LOGS="$STATE/logs"
PKI="$STATE/pki"
KUBECONFIG_FILE="$STATE/kubeconfig"
KUBECTL="$ROOT/.cache/bin/kubectl"
# Sockets have a 108-byte path limit, so runtime state lives under a short path named by a hash of
# this clone's state dir (several clones on one machine do not collide).
STATE_ID="$(printf '%s' "$STATE" | sha256sum | cut -c1-10)"
NODES_RUN="/run/ddpjob-$STATE_ID"
NODES_VAR="/var/lib/ddpjob-$STATE_ID"
# containerd roots (content store and snapshots, i.e. the imported images) outlive cluster-down,
# so the multi-GB trainer image is imported once per machine, not once per cluster-up.
CONTAINERD_CACHE="$CACHE/containerd"
POD_RANGE=10.248.0.0/16
DNS_IP=10.248.0.1
IPT_TAG="ddpjob-nodes-$STATE_ID"

# unmount_under DIR: every mount below DIR (network namespaces, volumes, rootfs), deepest first.
unmount_under() {
  awk -v d="$1/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
  done
}

# delete_ipt_rules TAG: the FORWARD and nat PREROUTING rules whose comment is TAG.
delete_ipt_rules() {
  local spec table chain rule
  for spec in filter:FORWARD nat:PREROUTING; do
    table="${spec%%:*}"; chain="${spec#*:}"
    while read -r rule; do
      [ -n "$rule" ] || continue
      eval "iptables -t $table ${rule/-A /-D }" 2>/dev/null || true
    done < <(iptables -t "$table" -S "$chain" 2>/dev/null | grep -F -- "--comment $1 " || true)
  done
}

# sweep_dead_clusters: what the real nodes of a cluster that was never stopped leave behind. A
# session's (or CI's) processes are killed when it ends, but mounts, runtime dirs and iptables rules
# are kernel state and outlive them; a dead cluster's DNAT of 10.96.0.1 comes first in PREROUTING
# and sends every pod's API traffic to a port nobody serves (CI's in-cluster operator crash-looped
# on exactly that). Only clusters none of whose processes is alive are swept.
sweep_dead_clusters() {
  local path id ids
  ids="$( { for path in /run/ddpjob-* /var/lib/ddpjob-*; do [ -d "$path" ] && echo "${path##*-}"; done
            # No rule at all is the common case: grep's "no match" must not end the script.
            iptables-save 2>/dev/null | { grep -o 'ddpjob-nodes-[0-9a-f]\{10\}' || true; } | sed 's/^ddpjob-nodes-//'
          } | sort -u)"
  for id in $ids; do
    [ "$id" = "$STATE_ID" ] && continue
    # kubelet and containerd of a live cluster name its runtime dirs on their command lines.
    pgrep -f -- "/ddpjob-$id/" >/dev/null && continue
    for path in "/run/ddpjob-$id" "/var/lib/ddpjob-$id"; do
      [ -d "$path" ] || continue
      unmount_under "$path"
      rm -rf "$path"
    done
    delete_ipt_rules "ddpjob-nodes-$id"
    log "removed what the real nodes of a cluster that was not stopped left behind (ddpjob-$id)"
  done
}

# sign_node_cert NODE: a kubelet client certificate (group system:nodes, for the Node authorizer).
sign_node_cert() {
  local n="$1"
  [ -f "$PKI/$n.crt" ] && return
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$n.key" -out "$PKI/$n.csr" \
    -subj "/O=system:nodes/CN=system:node:$n" >>"$LOGS/openssl.log" 2>&1
  printf '%s\n' 'basicConstraints=CA:FALSE' 'keyUsage=critical,digitalSignature,keyEncipherment' \
    'extendedKeyUsage=clientAuth' >"$PKI/$n.ext"
  openssl x509 -req -in "$PKI/$n.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$PKI/$n.ext" -out "$PKI/$n.crt" >>"$LOGS/openssl.log" 2>&1
}

# write_kubeconfig FILE USER: client cert/key $PKI/USER.{crt,key} and the CA embedded; the server
# is the API server's loopback port ($APISERVER_PORT).
write_kubeconfig() {
  cat >"$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: ddpjob-local
  cluster:
    server: https://127.0.0.1:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$2.crt")
    client-key-data: $(base64 -w0 "$PKI/$2.key")
contexts:
- name: ddpjob-local
  context: {cluster: ddpjob-local, user: $2}
current-context: ddpjob-local
KC
  chmod 600 "$1"
}
