#!/usr/bin/env bash
# Build the local control plane from Go modules and cache the binaries machine-wide.
# Reuses ${DDPJOB_CACHE:-$HOME/.cache/ddpjob}/bin/<versions>/ when present, so a fresh
# clone on the same machine never rebuilds. A binary is rebuilt only when missing or when its
# build recipe (the -ldflags that stamp versions) changed: `.<name>.recipe` beside it records it.
# Concurrent runs (two `make cluster-up`s) wait for each other on a lock.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
KUBE_DIR="$CACHE/bin/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
KWOK_DIR="$CACHE/bin/kwok-$KWOK_VERSION"
HELM_DIR="$CACHE/bin/helm-$HELM_VERSION"
COREDNS_DIR="$CACHE/bin/coredns-$COREDNS_VERSION"
SP_DIR="$CACHE/bin/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION"
SP_SCRATCH="$CACHE/src/scheduler-plugins-$SCHEDULER_PLUGINS_VERSION"
KUEUE_DIR="$CACHE/bin/kueue-$KUEUE_VERSION"
PROM_OP_DIR="$CACHE/bin/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION"
ACTIONLINT_DIR="$CACHE/bin/actionlint-$ACTIONLINT_VERSION"
SCRATCH="$CACHE/src/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
KUBE_OLDEST_DIR="$CACHE/bin/kube-$KUBE_OLDEST_VERSION"
OLDEST_SCRATCH="$CACHE/src/kube-$KUBE_OLDEST_VERSION"
LOGS="$CACHE/build-logs"
mkdir -p "$KUBE_DIR" "$KWOK_DIR" "$HELM_DIR" "$COREDNS_DIR" "$SP_DIR" "$KUEUE_DIR" "$PROM_OP_DIR" "$ACTIONLINT_DIR" "$LOGS"
exec 8>"$CACHE/build.lock"
flock 8

log() { printf '[hack/build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
command -v go >/dev/null || die "go is not on PATH (needed to build the control plane)"

export GOFLAGS="${GOFLAGS:-} -trimpath"
export CGO_ENABLED=0

# Version stamps, as Kubernetes' hack/lib/version.sh sets them: without them the API server reports
# v0.0.0-master+$Format:%H$, which breaks `kubectl version` and Helm charts' kubeVersion checks.
kube_ldflags() {  # [VERSION, default KUBE_VERSION]
  local v="${1:-$KUBE_VERSION}" major minor pkg out=""
  major="${v#v}"; major="${major%%.*}"
  minor="${v#v*.}"; minor="${minor%%.*}"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    out+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
    out+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit="
  done
  echo "-s -w$out"
}
KUBE_LDFLAGS="$(kube_ldflags)"

# recipe_ok BIN RECIPE: BIN exists and was built with RECIPE.
recipe_ok() { [ -x "$1" ] && [ -f "$(dirname "$1")/.$(basename "$1").recipe" ] \
  && [ "$(cat "$(dirname "$1")/.$(basename "$1").recipe")" = "$2" ]; }
recipe_write() { printf '%s' "$2" >"$(dirname "$1")/.$(basename "$1").recipe"; }

# Every k8s.io module that k8s.io/kubernetes replaces with ./staging/src/...: these are
# published as v0.X.Y; k8s.io/utils and k8s.io/kube-openapi are not, and must not be replaced.
staging_modules() {  # staging_modules VERSION SCRATCH
  local gomod
  gomod="$(go env GOMODCACHE)/cache/download/k8s.io/kubernetes/@v/$1.mod"
  [ -f "$gomod" ] || (cd "$2" && go mod download -json "k8s.io/kubernetes@$1" >/dev/null)
  grep -E '^\s*k8s.io/[a-z0-9-]+ => \./staging/src/' "$gomod" | awk '{print $1}' | sort -u
}

# build_kube_at VERSION STAGING_VERSION OUT_DIR SCRATCH [ETCD_VERSION] -- BINARY...: the named
# k8s.io/kubernetes commands of VERSION (and etcd when ETCD_VERSION is given) into OUT_DIR, in a
# scratch module of their own whose staging modules are pinned to STAGING_VERSION.
build_kube_at() {
  local version="$1" staging="$2" out="$3" scratch="$4" etcd="" ldflags b missing=0
  shift 4
  if [ "$1" != "--" ]; then etcd="$1"; shift; fi
  shift  # --
  local want=("$@")
  ldflags="$(kube_ldflags "$version")"
  for b in "${want[@]}"; do recipe_ok "$out/$b" "$ldflags" || missing=1; done
  [ -z "$etcd" ] || [ -x "$out/etcd" ] || missing=1
  if [ "$missing" = 0 ]; then log "kubernetes $version${etcd:+ + etcd $etcd}: cached in $out"; return; fi
  log "kubernetes $version${etcd:+ + etcd $etcd}: building ${want[*]} (cold: ~7 min on 2 cores)"
  mkdir -p "$out" "$scratch"
  cd "$scratch"
  if [ ! -f go.mod ]; then
    go mod init ddpjob.dev/hack/kube >/dev/null 2>&1
  fi
  local mods
  mods="$(staging_modules "$version" "$scratch")" || die "kubernetes: could not read k8s.io/kubernetes@$version go.mod"
  [ -n "$mods" ] || die "kubernetes: no staging modules found in k8s.io/kubernetes@$version go.mod"
  local m args=()
  for m in $mods; do args+=("-replace=$m=$m@$staging"); done
  go mod edit "${args[@]}"
  log "pinned $(echo "$mods" | wc -l) staging modules to $staging"
  for b in "${want[@]}"; do
    go get "k8s.io/kubernetes/cmd/$b@$version" >>"$LOGS/go-get.log" 2>&1 \
      || die "$b: go get k8s.io/kubernetes/cmd/$b@$version failed (see $LOGS/go-get.log)"
  done
  if [ -n "$etcd" ]; then
    go get "go.etcd.io/etcd/server/v3@$etcd" >>"$LOGS/go-get.log" 2>&1 \
      || die "etcd: go get go.etcd.io/etcd/server/v3@$etcd failed (see $LOGS/go-get.log)"
  fi
  for b in "${want[@]}"; do
    recipe_ok "$out/$b" "$ldflags" && continue
    log "building $b $version"
    go build -ldflags "$ldflags" -o "$out/$b.tmp" "k8s.io/kubernetes/cmd/$b" >"$LOGS/$b-$version.log" 2>&1 \
      || die "$b: go build failed (see $LOGS/$b-$version.log): $(tail -3 "$LOGS/$b-$version.log")"
    mv "$out/$b.tmp" "$out/$b"
    recipe_write "$out/$b" "$ldflags"
  done
  if [ -n "$etcd" ] && [ ! -x "$out/etcd" ]; then
    log "building etcd"
    go build -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3 >"$LOGS/etcd.log" 2>&1 \
      || die "etcd: go build failed (see $LOGS/etcd.log): $(tail -3 "$LOGS/etcd.log")"
    mv "$out/etcd.tmp" "$out/etcd"
  fi
}

# The control plane the project runs on, with etcd and kubectl.
build_kube() {
  build_kube_at "$KUBE_VERSION" "$KUBE_STAGING_VERSION" "$KUBE_DIR" "$SCRATCH" "$ETCD_VERSION" -- \
    kube-apiserver kube-controller-manager kube-scheduler kubectl
}

# The oldest Kubernetes the chart allows: the three components whose API and behaviour the
# `versioned` tests check (DDPJOB_CLUSTER=oldest). etcd (its wire API is stable) and kubectl (the
# newest client works against older servers) are the newest's.
build_kube_oldest() {
  build_kube_at "$KUBE_OLDEST_VERSION" "$KUBE_OLDEST_STAGING_VERSION" "$KUBE_OLDEST_DIR" "$OLDEST_SCRATCH" -- \
    kube-apiserver kube-controller-manager kube-scheduler
}

# scheduler-plugins' kube-scheduler (Coscheduling, for gang scheduling), a second scheduler beside
# the control plane's, and its controller (it keeps PodGroups' status). Its go.mod replaces every
# k8s.io staging module (and k8s.io/kubernetes) with a published version, which
# `go install pkg@version` refuses, so both are built in a scratch module given those replace
# directives, with the Kubernetes patch release moved to SCHEDULER_PLUGINS_KUBE_VERSION (same minor;
# see versions.env). Its own scratch module: those versions (1.34) are not the control plane's (1.36).
build_scheduler_plugins() {
  local json gomod src kube="$SCHEDULER_PLUGINS_KUBE_VERSION" ldflags replaces crd b missing=0
  local -A want=([kube-scheduler]=scheduler [controller]=controller)  # binary -> cmd/<package>
  # Stamped as the Kubernetes release it is built from (what kube-scheduler --version reports, and
  # consistent with the 1.<minor> its feature gates assume), not as v0.34.x.
  ldflags="$(kube_ldflags "$kube")"
  for b in "${!want[@]}"; do recipe_ok "$SP_DIR/$b" "$ldflags" || missing=1; done
  if [ "$missing" = 0 ]; then
    log "scheduler-plugins $SCHEDULER_PLUGINS_VERSION (kubernetes $kube): cached in $SP_DIR"; return
  fi
  json="$(cd "$CACHE" && go mod download -json "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION")" \
    || die "scheduler-plugins: could not download sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION"
  gomod="$(sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' <<<"$json")"
  src="$(sed -n 's/.*"Dir": "\(.*\)".*/\1/p' <<<"$json")"
  { [ -f "$gomod" ] && [ -d "$src" ]; } || die "scheduler-plugins: no go.mod or source in: $json"
  # cluster-up applies the repository's copies of the CRDs (no download at cluster-up time): they
  # must be the ones this scheduler was released with.
  for crd in scheduling.x-k8s.io_podgroups.yaml scheduling.x-k8s.io_elasticquotas.yaml; do
    diff -q <(grep -v '^#' "$HERE/crds/$crd") <(grep -v '^#' "$src/config/crd/bases/$crd") >/dev/null \
      || die "hack/crds/$crd differs from scheduler-plugins $SCHEDULER_PLUGINS_VERSION's config/crd/bases/$crd: copy it again (keep the header)"
  done
  local upstream staging="v0.${kube#v1.}"
  upstream="$(awk '$1 == "k8s.io/kubernetes" && $2 == "=>" {print $4; exit}' "$gomod")"
  [ "${upstream%.*}" = "${kube%.*}" ] \
    || die "scheduler-plugins $SCHEDULER_PLUGINS_VERSION is built on Kubernetes ${upstream:-?}, not on ${kube%.*}.x: set SCHEDULER_PLUGINS_KUBE_VERSION in hack/versions.env"
  log "scheduler-plugins $SCHEDULER_PLUGINS_VERSION (kubernetes $kube): building (cold: ~2 min on 2 cores after the control plane, plus downloads)"
  local t0=$SECONDS
  mkdir -p "$SP_SCRATCH"
  cd "$SP_SCRATCH"
  [ -f go.mod ] || go mod init ddpjob.dev/hack/scheduler-plugins >/dev/null 2>&1
  # "old => new version" lines, in the replace block or on their own; path replacements (=> ./x)
  # have no version and would not resolve outside its repository: none in the releases we pin.
  # k8s.io/kubernetes and the staging modules of its minor move to our patch release; others (an
  # older k8s.io/legacy-cloud-providers) stay as upstream pins them.
  replaces="$(awk -v kube="$kube" -v staging="$staging" -v minor="${staging%.*}." '/=>/ {
      sub(/^[ \t]*replace[ \t]+/, ""); if (NF != 4 || $2 != "=>") next
      v = $4
      if ($3 == "k8s.io/kubernetes") v = kube
      else if ($3 ~ /^k8s\.io\// && index(v, minor) == 1) v = staging
      print "-replace=" $1 "=" $3 "@" v }' "$gomod")"
  [ -n "$replaces" ] || die "scheduler-plugins: no replace directives found in $gomod"
  # shellcheck disable=SC2086  # one -replace=... word per line
  go mod edit $replaces
  local pkg
  for b in "${!want[@]}"; do
    pkg="sigs.k8s.io/scheduler-plugins/cmd/${want[$b]}"
    go get "$pkg@$SCHEDULER_PLUGINS_VERSION" >>"$LOGS/go-get.log" 2>&1 \
      || die "scheduler-plugins: go get $pkg@$SCHEDULER_PLUGINS_VERSION failed (see $LOGS/go-get.log)"
  done
  for b in "${!want[@]}"; do
    recipe_ok "$SP_DIR/$b" "$ldflags" && continue
    pkg="sigs.k8s.io/scheduler-plugins/cmd/${want[$b]}"
    go build -ldflags "$ldflags" -o "$SP_DIR/$b.tmp" "$pkg" >"$LOGS/scheduler-plugins-$b.log" 2>&1 \
      || die "scheduler-plugins: go build $pkg failed (see $LOGS/scheduler-plugins-$b.log): $(tail -3 "$LOGS/scheduler-plugins-$b.log")"
    mv "$SP_DIR/$b.tmp" "$SP_DIR/$b"
    recipe_write "$SP_DIR/$b" "$ldflags"
    log "scheduler-plugins: $b built ($((SECONDS - t0))s so far)"
  done
}

# kubelet and the pod sandbox ("pause") binary, for the real nodes (hack/nodes-up.sh). kubelet is
# built in the control plane's scratch module (same pinned staging modules, same build cache).
build_node_binaries() {
  build_kube
  if ! recipe_ok "$KUBE_DIR/kubelet" "$KUBE_LDFLAGS"; then
    log "building kubelet (cold: ~5 min after the control plane)"
    cd "$SCRATCH"
    go get "k8s.io/kubernetes/cmd/kubelet@$KUBE_VERSION" >>"$LOGS/go-get.log" 2>&1 \
      || die "kubelet: go get k8s.io/kubernetes/cmd/kubelet@$KUBE_VERSION failed (see $LOGS/go-get.log)"
    go build -ldflags "$KUBE_LDFLAGS" -o "$KUBE_DIR/kubelet.tmp" k8s.io/kubernetes/cmd/kubelet >"$LOGS/kubelet.log" 2>&1 \
      || die "kubelet: go build failed (see $LOGS/kubelet.log): $(tail -3 "$LOGS/kubelet.log")"
    mv "$KUBE_DIR/kubelet.tmp" "$KUBE_DIR/kubelet"
    recipe_write "$KUBE_DIR/kubelet" "$KUBE_LDFLAGS"
  fi
  # The sandbox image's only binary: Kubernetes' own pause.c, static so the image is FROM scratch
  # (no registry here to pull registry.k8s.io/pause from).
  if [ ! -x "$KUBE_DIR/pause" ]; then
    local src
    src="$(go env GOMODCACHE)/k8s.io/kubernetes@$KUBE_VERSION/build/pause/linux/pause.c"
    [ -f "$src" ] || (cd "$SCRATCH" && go mod download "k8s.io/kubernetes@$KUBE_VERSION")
    command -v gcc >/dev/null || die "pause: gcc is not installed (needed for the pod sandbox binary)"
    gcc -Os -static -DVERSION="$KUBE_VERSION" -o "$KUBE_DIR/pause.tmp" "$src" >"$LOGS/pause.log" 2>&1 \
      || die "pause: gcc -static $src failed (see $LOGS/pause.log)"
    mv "$KUBE_DIR/pause.tmp" "$KUBE_DIR/pause"
  fi
  build_simple coredns "$COREDNS_DIR" github.com/coredns/coredns "$COREDNS_VERSION"
}

build_simple() {  # name dir pkg version [ldflags]
  local name="$1" dir="$2" pkg="$3" ver="$4" ldflags="${5:-}"
  if [ -x "$dir/$name" ] && { [ -z "$ldflags" ] || recipe_ok "$dir/$name" "$ldflags"; }; then
    log "$name $ver: cached in $dir"; return
  fi
  log "$name $ver: building"
  GOBIN="$dir" go install -ldflags "$ldflags" "$pkg@$ver" >"$LOGS/$name.log" 2>&1 \
    || die "$name: go install $pkg@$ver failed (see $LOGS/$name.log): $(tail -3 "$LOGS/$name.log")"
  [ -z "$ldflags" ] || recipe_write "$dir/$name" "$ldflags"
}

# Helm stamps its own version and the Kubernetes version that `helm template`/`helm lint` assume
# (1.<minor of its client-go>, as Helm's Makefile does); unstamped it reports v3.22 and assumes 1.20.
helm_ldflags() {
  local gomod cg minor h=helm.sh/helm/v3
  gomod="$(cd "$CACHE" && go mod download -json "$h@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')" \
    || die "helm: could not download $h@$HELM_VERSION"
  cg="$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$gomod")"
  minor="${cg#v0.}"; minor="${minor%%.*}"
  [ -n "$minor" ] || die "helm: no k8s.io/client-go version in $gomod"
  echo "-s -w -X $h/internal/version.version=$HELM_VERSION -X $h/internal/version.gitTreeState=clean" \
    "-X $h/pkg/lint/rules.k8sVersionMajor=1 -X $h/pkg/lint/rules.k8sVersionMinor=$minor" \
    "-X $h/pkg/chartutil.k8sVersionMajor=1 -X $h/pkg/chartutil.k8sVersionMinor=$minor"
}

# Kueue (DDPJOB_KUEUE=1 clusters). Not `go install pkg@version`: that also reads the module's
# version list for deprecation notices, which the module proxy here refuses for sigs.k8s.io/kueue
# (403). A scratch module built with `go get` + `go build` needs only the pinned version.
build_kueue() {
  local src="$CACHE/src/kueue-$KUEUE_VERSION" pkg=sigs.k8s.io/kueue/cmd/kueue
  local ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
  if recipe_ok "$KUEUE_DIR/kueue" "$ldflags"; then
    # cluster-up applies Kueue's CRDs, webhooks and RBAC from the module's source.
    [ -d "$(go env GOMODCACHE)/sigs.k8s.io/kueue@$KUEUE_VERSION/config" ] \
      || go mod download "sigs.k8s.io/kueue@$KUEUE_VERSION" >"$LOGS/kueue.log" 2>&1 \
      || die "kueue: go mod download sigs.k8s.io/kueue@$KUEUE_VERSION failed (see $LOGS/kueue.log)"
    log "kueue $KUEUE_VERSION: cached in $KUEUE_DIR"; return
  fi
  log "kueue $KUEUE_VERSION: building (cold: ~3.5 min on 2 cores)"
  mkdir -p "$src"
  cd "$src"
  [ -f go.mod ] || go mod init ddpjob.dev/hack/kueue >/dev/null 2>&1
  go get "$pkg@$KUEUE_VERSION" >"$LOGS/kueue.log" 2>&1 \
    || die "kueue: go get $pkg@$KUEUE_VERSION failed (see $LOGS/kueue.log): $(tail -3 "$LOGS/kueue.log")"
  go build -ldflags "$ldflags" -o "$KUEUE_DIR/kueue.tmp" "$pkg" >>"$LOGS/kueue.log" 2>&1 \
    || die "kueue: go build failed (see $LOGS/kueue.log): $(tail -3 "$LOGS/kueue.log")"
  mv "$KUEUE_DIR/kueue.tmp" "$KUEUE_DIR/kueue"
  recipe_write "$KUEUE_DIR/kueue" "$ldflags"
}

# prometheus-operator, for the e2e test that has it turn the chart's monitors and rules into a
# Prometheus configuration. Its go.mod replaces its own pkg/apis/monitoring and pkg/client with
# ./ paths, which `go install pkg@version` refuses (and which are separate modules, absent from the
# root module's source): a scratch module requires the published ones of the same version. Its
# CRDs (the module's example/prometheus-operator-crd) are copied beside it: the tests apply them.
build_prometheus_operator() {
  local v="$PROMETHEUS_OPERATOR_VERSION" m=github.com/prometheus-operator/prometheus-operator
  local src="$CACHE/src/prometheus-operator-$v" pkg="$m/cmd/operator"
  local ldflags="-s -w -X github.com/prometheus/common/version.Version=${v#v}"
  if recipe_ok "$PROM_OP_DIR/prometheus-operator" "$ldflags" && [ -d "$PROM_OP_DIR/crds" ]; then
    log "prometheus-operator $v: cached in $PROM_OP_DIR"; return
  fi
  log "prometheus-operator $v: building (cold: 4.2 CPU-min, 8.5 min on 2 busy cores)"
  local t0=$SECONDS
  mkdir -p "$src"
  cd "$src"
  [ -f go.mod ] || go mod init ddpjob.dev/hack/prometheus-operator >/dev/null 2>&1
  go get "$pkg@$v" "$m/pkg/apis/monitoring@$v" "$m/pkg/client@$v" >"$LOGS/prometheus-operator.log" 2>&1 \
    || die "prometheus-operator: go get $pkg@$v failed (see $LOGS/prometheus-operator.log): $(tail -3 "$LOGS/prometheus-operator.log")"
  go build -ldflags "$ldflags" -o "$PROM_OP_DIR/prometheus-operator.tmp" "$pkg" >>"$LOGS/prometheus-operator.log" 2>&1 \
    || die "prometheus-operator: go build failed (see $LOGS/prometheus-operator.log): $(tail -3 "$LOGS/prometheus-operator.log")"
  mv "$PROM_OP_DIR/prometheus-operator.tmp" "$PROM_OP_DIR/prometheus-operator"
  recipe_write "$PROM_OP_DIR/prometheus-operator" "$ldflags"
  rm -rf "$PROM_OP_DIR/crds.tmp" && mkdir "$PROM_OP_DIR/crds.tmp"
  cp "$(go env GOMODCACHE)/$m@$v/example/prometheus-operator-crd/"*.yaml "$PROM_OP_DIR/crds.tmp/" \
    || die "prometheus-operator: no CRDs in $m@$v's example/prometheus-operator-crd"
  chmod u+w "$PROM_OP_DIR/crds.tmp/"*.yaml
  mv "$PROM_OP_DIR/crds.tmp" "$PROM_OP_DIR/crds"
  log "prometheus-operator $v: built in $((SECONDS - t0))s"
}

start=$(date +%s)
case "${1:-all}" in
  kube) build_kube ;;
  oldest) build_kube_oldest ;;
  scheduler-plugins) build_scheduler_plugins ;;
  kwok) build_simple kwok "$KWOK_DIR" sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION" ;;
  nodes) build_node_binaries ;;
  kueue) build_kueue ;;
  prometheus-operator) build_prometheus_operator ;;
  # make lint: prints the binary's path.
  actionlint) build_simple actionlint "$ACTIONLINT_DIR" github.com/rhysd/actionlint/cmd/actionlint "$ACTIONLINT_VERSION" \
                "-s -w -X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"; echo "$ACTIONLINT_DIR/actionlint" ;;
  helm) HELM_LDFLAGS="$(helm_ldflags)"; build_simple helm "$HELM_DIR" helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$HELM_LDFLAGS" ;;
  all)
    build_kube
    build_scheduler_plugins
    build_simple kwok "$KWOK_DIR" sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
    HELM_LDFLAGS="$(helm_ldflags)"
    build_simple helm "$HELM_DIR" helm.sh/helm/v3/cmd/helm "$HELM_VERSION" "$HELM_LDFLAGS"
    # DDPJOB_REAL_NODES=0: a control plane with kwok nodes only needs no kubelet or CoreDNS.
    [ "${DDPJOB_REAL_NODES:-2}" = 0 ] || build_node_binaries
    [ "${DDPJOB_KUEUE:-1}" = 0 ] || build_kueue
    # The e2e tier's monitors test needs it (cold: about 4 CPU-min, once per machine). make test
    # builds it beside the tiers instead (DDPJOB_PROMETHEUS_OPERATOR=0 here; hack/test.sh).
    [ "${DDPJOB_PROMETHEUS_OPERATOR:-1}" = 0 ] || build_prometheus_operator
    ;;
  *) die "unknown target '$1' (kube | oldest | actionlint | scheduler-plugins | kwok | helm | nodes | kueue | prometheus-operator | all)" ;;
esac
log "done in $(( $(date +%s) - start ))s"
