#!/usr/bin/env bash
# The local cluster has no storage provisioner, so an example's PersistentVolumeClaims would stay
# Pending and its pods unschedulable. This gives every claim in FILE... a hostPath PersistentVolume
# pre-bound to it in NAMESPACE (a directory under .cache/cluster/volumes/, which cluster-down
# removes). Both real nodes are this one machine, so such a volume is shared the way a
# ReadWriteMany volume (NFS, CephFS, EFS) is on a real cluster; kwok's pods never mount anything.
# Idempotent: a volume left Released by an earlier claim of the same name is made afresh.
#   hack/local-volumes.sh NAMESPACE FILE...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 2 ] || { echo "usage: $0 NAMESPACE FILE..." >&2; exit 2; }
NS="$1"
shift
export KUBECONFIG="${KUBECONFIG:-$ROOT/.cache/cluster/kubeconfig}"
PATH="$ROOT/.cache/bin:$PATH"
VOLUMES="$ROOT/.cache/cluster/volumes"

files=()
for f in "$@"; do files+=(-f "$f"); done
# name, requested size and access modes of each claim, read from the files as kubectl parses them
claims="$(kubectl create --dry-run=client -o jsonpath='{.kind}{"\t"}{.metadata.name}{"\t"}{.spec.resources.requests.storage}{"\t"}{.spec.accessModes}{"\n"}' "${files[@]}" \
  | awk -F'\t' -v OFS='\t' '$1 == "PersistentVolumeClaim" { print $2, $3, $4 }')"
[ -n "$claims" ] || { echo "local-volumes: no PersistentVolumeClaim in $*" >&2; exit 0; }

while IFS=$'\t' read -r claim size modes; do
  pv="local-$NS-$claim"
  dir="$VOLUMES/$NS/$claim"
  phase="$(kubectl get pv "$pv" -o jsonpath='{.status.phase}' 2>/dev/null || true)"
  case "$phase" in
    Bound|Available|Pending) echo "persistentvolume/$pv ($phase) for $NS/$claim"; continue ;;
    "") ;;
    *) kubectl delete pv "$pv" --wait=true >/dev/null ;;  # Released or Failed: its claim is gone
  esac
  mkdir -p "$dir"
  chmod 1777 "$dir"  # images run as non-root users; hostPath volumes ignore fsGroup
  kubectl apply -f - <<EOF
apiVersion: v1
kind: PersistentVolume
metadata:
  name: $pv
  labels: {ddpjob.dev/local-volume: "true"}
spec:
  capacity: {storage: $size}
  accessModes: $modes
  storageClassName: ""
  persistentVolumeReclaimPolicy: Retain
  claimRef: {namespace: $NS, name: $claim}
  hostPath: {path: $dir, type: Directory}
EOF
done <<<"$claims"
