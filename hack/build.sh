#!/usr/bin/env bash
# Build the local control plane from Go modules and cache the binaries machine-wide.
# Reuses ${DDPJOB_CACHE:-$HOME/.cache/ddpjob}/bin/<versions>/ when present, so a fresh
# clone on the same machine never rebuilds. Prints the bin dir on the last line of stdout.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
KUBE_DIR="$CACHE/bin/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
KWOK_DIR="$CACHE/bin/kwok-$KWOK_VERSION"
HELM_DIR="$CACHE/bin/helm-$HELM_VERSION"
SCRATCH="$CACHE/src/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
LOGS="$CACHE/build-logs"
mkdir -p "$KUBE_DIR" "$KWOK_DIR" "$HELM_DIR" "$LOGS"

log() { printf '[hack/build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
command -v go >/dev/null || die "go is not on PATH (needed to build the control plane)"

export GOFLAGS="${GOFLAGS:-} -trimpath"
export CGO_ENABLED=0

# Every k8s.io module that k8s.io/kubernetes replaces with ./staging/src/...: these are
# published as v0.X.Y; k8s.io/utils and k8s.io/kube-openapi are not, and must not be replaced.
staging_modules() {
  local gomod
  gomod="$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/$KUBE_VERSION.mod"
  [ -f "$gomod" ] || (cd "$SCRATCH" && go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" >/dev/null)
  grep -E '^\s*k8s.io/[a-z0-9-]+ => \./staging/src/' "$gomod" | awk '{print $1}' | sort -u
}

build_kube() {
  local want=(kube-apiserver kube-controller-manager kube-scheduler etcd) missing=0 b
  for b in "${want[@]}"; do [ -x "$KUBE_DIR/$b" ] || missing=1; done
  if [ "$missing" = 0 ]; then log "kubernetes $KUBE_VERSION + etcd $ETCD_VERSION: cached in $KUBE_DIR"; return; fi
  log "kubernetes $KUBE_VERSION + etcd $ETCD_VERSION: building (cold: ~15 min on 2 cores)"
  mkdir -p "$SCRATCH"
  cd "$SCRATCH"
  if [ ! -f go.mod ]; then
    go mod init ddpjob.dev/hack/kube >/dev/null 2>&1
  fi
  local mods
  mods="$(staging_modules)" || die "kubernetes: could not read k8s.io/kubernetes@$KUBE_VERSION go.mod"
  [ -n "$mods" ] || die "kubernetes: no staging modules found in k8s.io/kubernetes@$KUBE_VERSION go.mod"
  local m args=()
  for m in $mods; do args+=("-replace=$m=$m@$KUBE_STAGING_VERSION"); done
  go mod edit "${args[@]}"
  log "pinned $(echo "$mods" | wc -l) staging modules to $KUBE_STAGING_VERSION"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    go get "k8s.io/kubernetes/cmd/$b@$KUBE_VERSION" >>"$LOGS/go-get.log" 2>&1 \
      || die "$b: go get k8s.io/kubernetes/cmd/$b@$KUBE_VERSION failed (see $LOGS/go-get.log)"
  done
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >>"$LOGS/go-get.log" 2>&1 \
    || die "etcd: go get go.etcd.io/etcd/server/v3@$ETCD_VERSION failed (see $LOGS/go-get.log)"
  for b in kube-apiserver kube-controller-manager kube-scheduler; do
    [ -x "$KUBE_DIR/$b" ] && continue
    log "building $b"
    go build -o "$KUBE_DIR/$b.tmp" "k8s.io/kubernetes/cmd/$b" >"$LOGS/$b.log" 2>&1 \
      || die "$b: go build failed (see $LOGS/$b.log): $(tail -3 "$LOGS/$b.log")"
    mv "$KUBE_DIR/$b.tmp" "$KUBE_DIR/$b"
  done
  if [ ! -x "$KUBE_DIR/etcd" ]; then
    log "building etcd"
    go build -o "$KUBE_DIR/etcd.tmp" go.etcd.io/etcd/server/v3 >"$LOGS/etcd.log" 2>&1 \
      || die "etcd: go build failed (see $LOGS/etcd.log): $(tail -3 "$LOGS/etcd.log")"
    mv "$KUBE_DIR/etcd.tmp" "$KUBE_DIR/etcd"
  fi
}

build_simple() {  # name dir pkg version
  local name="$1" dir="$2" pkg="$3" ver="$4"
  if [ -x "$dir/$name" ]; then log "$name $ver: cached in $dir"; return; fi
  log "$name $ver: building"
  GOBIN="$dir" go install "$pkg@$ver" >"$LOGS/$name.log" 2>&1 \
    || die "$name: go install $pkg@$ver failed (see $LOGS/$name.log): $(tail -3 "$LOGS/$name.log")"
}

start=$(date +%s)
case "${1:-all}" in
  kube) build_kube ;;
  kwok) build_simple kwok "$KWOK_DIR" sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" ;;
  helm) build_simple helm "$HELM_DIR" helm.sh/helm/v3/cmd/helm "$HELM_VERSION" ;;
  all)
    build_kube
    build_simple kwok "$KWOK_DIR" sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
    build_simple helm "$HELM_DIR" helm.sh/helm/v3/cmd/helm "$HELM_VERSION"
    ;;
  *) die "unknown target '$1' (kube | kwok | helm | all)" ;;
esac
log "done in $(( $(date +%s) - start ))s"
