#!/usr/bin/env bash
# `make images`: build the Dockerfile's `operator` and `trainer` targets, unchanged, with buildah
# (no Docker engine here), on bases made locally, push them to the local registry (hack/registry.sh)
# and have every real node pull them from it.
#   localhost/ddpjob/python:3.11-bookworm   debootstrap'd Debian bookworm + python3 (the PYTHON_IMAGE)
#   localhost/ddpjob/torch:<ver>            that + versions.env's torch/torchvision from PyPI (the TORCH_IMAGE)
#   localhost/ddpjob/pause:<kube ver>       the pod sandbox: Kubernetes' pause.c, static, FROM scratch
#   localhost/ddpjob/operator:dev, localhost/ddpjob/trainer:dev   the product images
# Cached machine-wide: buildah's storage keeps the images, each tagged with a hash of its inputs
# (`:in-<hash>`), so an unchanged tree builds nothing; the registry's storage and each node record
# what they were given.
# Env: DDPJOB_BUILD_CA — a CA bundle that pip inside the build must trust (users behind a
#      TLS-intercepting proxy; defaults to $SSL_CERT_FILE when set). Empty: pip's own CAs.
# Usage: hack/images.sh [build|products|publish|pause|all]   (default all; publish needs running real nodes;
#        pause: only the sandbox image, which hack/nodes-up.sh needs before any pod can start)
#        hack/images.sh release SRC VERSION REPO [--insecure]   (make release: see release_images)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
CACHE="${DDPJOB_CACHE:-$HOME/.cache/ddpjob}"
IMG_CACHE="$CACHE/images"
LOGS="$IMG_CACHE/logs"
# shellcheck source=state-lib.sh
source "$HERE/state-lib.sh"
STATE="$(cluster_state_dir)"   # the main cluster: the real nodes and the registry are its
mkdir -p "$IMG_CACHE" "$LOGS"
exec 7>"$IMG_CACHE/images.lock"
flock 7

PYTHON_BASE=localhost/ddpjob/python:3.11-bookworm
PAUSE_IMAGE="localhost/ddpjob/pause:$KUBE_VERSION"
OPERATOR_IMAGE=localhost/ddpjob/operator:dev
TRAINER_IMAGE=localhost/ddpjob/trainer:dev
CA="${DDPJOB_BUILD_CA-${SSL_CERT_FILE:-}}"

log() { printf '[hack/images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
# push_failed IMAGE REF: a registry answers a full disk with a bare "500 Internal Server Error", so
# the message says how much room its storage has left.
push_failed() {
  local free
  free="$(df -BG --output=avail "$CACHE" 2>/dev/null | tail -1 | tr -d ' G')"
  die "pushing $1 to $2 failed (see $LOGS/push.log; ${free:-?} GiB free under $CACHE, where the local registry stores what it is sent): $(tail -3 "$LOGS/push.log")"
}
has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }
"$HERE/ensure-node-packages.sh"

# Build-time volumes: a CA bundle and a pip.conf naming it, so pip inside every RUN trusts it.
build_volumes=()
if [ -n "$CA" ]; then
  [ -r "$CA" ] || die "DDPJOB_BUILD_CA=$CA is not a readable file"
  printf '[global]\ncert = /etc/ssl/certs/ddpjob-build-ca.crt\n' >"$IMG_CACHE/pip.conf"
  build_volumes+=(-v "$CA:/etc/ssl/certs/ddpjob-build-ca.crt:ro" -v "$IMG_CACHE/pip.conf:/etc/pip.conf:ro")
fi

# The tree the product images are built from: this checkout, or with `release SRC ...` another
# (an earlier release's source).
SRC="$ROOT"

# inputs_hash FILES...: what a product image is built from (tracked and untracked, not ignored;
# every file when SRC is not a git checkout).
inputs_hash() {
  (cd "$SRC" || exit 1
   # A path this source tree lacks adds nothing (the previous release's has no api/).
   local paths=() p
   for p in "$@"; do if [ -e "$p" ]; then paths+=("$p"); fi; done
   if [ -e .git ]; then git ls-files -co --exclude-standard -z -- "${paths[@]}"; else find "${paths[@]}" \( -type f -o -type l \) -print0; fi \
    | sort -z | while IFS= read -r -d '' f; do
    if [ -L "$f" ]; then echo "link $f -> $(readlink "$f")"; elif [ -f "$f" ]; then sha256sum "$f"; fi
  done) | sha256sum | cut -c1-16
}

build_python_base() {
  has_image "$PYTHON_BASE" && { log "$PYTHON_BASE: cached"; return; }
  log "$PYTHON_BASE: debootstrap bookworm (minbase + python3; ~3 min)"
  local rootfs="$IMG_CACHE/rootfs.tmp"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >"$LOGS/debootstrap.log" 2>&1 \
    || die "debootstrap failed (see $LOGS/debootstrap.log): $(tail -3 "$LOGS/debootstrap.log")"
  # Behave like the official python image: pip may install into the system interpreter.
  rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | podman import --change 'CMD ["python3"]' - "$PYTHON_BASE" >"$LOGS/import.log" 2>&1 \
    || die "podman import of the base failed (see $LOGS/import.log)"
  rm -rf "$rootfs"
}

# The trainer image's torch is the one users run (versions.env), not the venv's: the real-pod tier
# tests what ships, and the venv's newer torch is covered by the other tiers.
build_torch_base() {
  local uv
  TORCH_BASE="localhost/ddpjob/torch:${TORCH_VERSION//+/-}"
  has_image "$TORCH_BASE" && { log "$TORCH_BASE: cached"; return; }
  uv="$ROOT/.venv/bin/uv"
  [ -x "$uv" ] || die "no uv in $ROOT/.venv (run make install)"
  log "$TORCH_BASE: torch $TORCH_VERSION + torchvision $TORCHVISION_VERSION from the uv cache (~3 min)"
  buildah bud --isolation chroot --layers -f "$HERE/images/torch-base.Containerfile" \
    --build-arg PYTHON_IMAGE="$PYTHON_BASE" --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCHVISION_VERSION="$TORCHVISION_VERSION" \
    "${build_volumes[@]}" -v "$uv:/usr/local/bin/uv:ro" -v "${UV_CACHE_DIR:-$HOME/.cache/uv}:/uv-cache" \
    ${CA:+--env SSL_CERT_FILE=/etc/ssl/certs/ddpjob-build-ca.crt} \
    -t "$TORCH_BASE" "$HERE/images" >"$LOGS/torch-base.log" 2>&1 \
    || die "torch base failed (see $LOGS/torch-base.log): $(tail -3 "$LOGS/torch-base.log")"
}

build_pause() {
  has_image "$PAUSE_IMAGE" && { log "$PAUSE_IMAGE: cached"; return; }
  local bin="$CACHE/bin/kube-$KUBE_VERSION-etcd-$ETCD_VERSION/pause" c
  [ -x "$bin" ] || die "$bin missing (hack/build.sh nodes builds it)"
  c="$(buildah from scratch)"
  buildah copy "$c" "$bin" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$c"
  buildah commit -q "$c" "$PAUSE_IMAGE" >/dev/null
  buildah rm "$c" >/dev/null
  log "$PAUSE_IMAGE: built"
}

# build_target TARGET IMAGE: the Dockerfile's target, unchanged; bases come in through its ARGs.
# No --layers: buildah 1.28 mounts an empty directory for `RUN --mount=type=bind,from=<stage>` when
# that stage came from its layer cache, and the trainer target would install no wheel.
build_target() {
  local target="$1" image="$2" hash
  hash="$(inputs_hash Dockerfile .dockerignore pyproject.toml README.md api operator trainer cli requirements charts/ddpjob-operator/crds)"
  if has_image "${image%:*}:in-$hash"; then
    has_image "$image" || buildah tag "${image%:*}:in-$hash" "$image"
    log "$image: cached (inputs $hash)"; return
  fi
  log "$image: buildah bud --target $target (inputs $hash)"
  (cd "$SRC" && buildah bud --isolation chroot --format docker --target "$target" \
    --build-arg PYTHON_IMAGE="$PYTHON_BASE" --build-arg TORCH_IMAGE="${TORCH_BASE:-}" \
    "${build_volumes[@]}" -t "$image" -t "${image%:*}:in-$hash" -f Dockerfile . ) >"$LOGS/$target.log" 2>&1 \
    || die "$image failed (see $LOGS/$target.log): $(tail -5 "$LOGS/$target.log")"
  # Earlier builds of this image are never used again: each trainer build is a few hundred MB
  # over the torch base, and this machine's disk is shared with everything else.
  buildah images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep -F "${image%:*}:in-" \
    | grep -vF ":in-$hash" | xargs -r buildah rmi >/dev/null 2>&1 || true
  buildah rmi --prune >/dev/null 2>&1 || true
}

build_products() {
  build_python_base
  build_torch_base
  build_target operator "$OPERATOR_IMAGE"
  build_target trainer "$TRAINER_IMAGE"
}

build_all() {
  local t0=$SECONDS
  build_products
  build_pause
  log "images ready in $((SECONDS - t0))s"
}

# release SRC VERSION REPO [--insecure]: the operator and trainer images of the tree in SRC, built
# as build_all builds ours, pushed as REPO/operator:VERSION and REPO/trainer:VERSION (make release;
# the upgrade test's earlier release). --insecure: REPO is plain HTTP (a registry on loopback).
release_images() {
  local src="$1" version="$2" repo="$3" tls=true target image
  [ "${4:-}" = --insecure ] && tls=false
  [ -f "$src/Dockerfile" ] || die "release: $src has no Dockerfile"
  SRC="$(cd "$src" && pwd)"
  build_python_base
  build_torch_base
  for target in operator trainer; do
    # Another tree's images get local names of their own: they must not move :dev, nor evict its
    # cached build (build_target keeps one build per repository).
    image="localhost/ddpjob-release/$target:$version"
    [ "$SRC" = "$ROOT" ] && image="localhost/ddpjob/$target:dev"
    build_target "$target" "$image"
    log "$image: pushing to $repo/$target:$version"
    buildah push -q --tls-verify="$tls" --format oci "$image" "docker://$repo/$target:$version" \
      >"$LOGS/push.log" 2>&1 || push_failed "$image" "$repo/$target:$version"
  done
}

# publish_images IMAGE...: push each image to the local registry (hack/registry.sh), then have every
# running real node's containerd pull it from there, as a cluster gets its images (skipped where the
# registry or the node already has that image id). buildah 1.28 gzips every layer it pushes to a
# registry (its --disable-compression applies only to its blob cache; the manifest says tar+gzip):
# the trainer image's push took 184 CPU-s and its pulls about 2 CPU-min a node in rehearsal 42 (cold).
# A layer pushed once is found at the same registry address by buildah's blob-info cache, one HEAD
# (a re-push of :dev: 0.2 s), which is why hack/registry.sh keeps its port.
publish_images() {
  local nodes_env="$STATE/nodes.env" reg_env="$STATE/registry.env" node img id pid pids
  [ -f "$nodes_env" ] || { log "no real nodes running ($nodes_env missing): nothing to publish"; return; }
  [ -f "$reg_env" ] || die "no local registry ($reg_env missing): hack/registry.sh up"
  # shellcheck disable=SC1090
  source "$nodes_env"
  # shellcheck disable=SC1090
  source "$reg_env"
  for img in "$@"; do
    has_image "$img" || die "$img: not built (hack/images.sh build)"
    id="$(buildah inspect --type image --format '{{.FromImageID}}' "$img")"
    push_image "$img" "$REGISTRY/${img#localhost/}" "$id"
    # The nodes pull side by side: each pull is mostly one core unpacking layers (2.5 minutes each
    # for the trainer image, one after the other, in rehearsal 24).
    pids=()
    for node in $REAL_NODE_NAMES; do
      pull_image "$node" "$img" "$id" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
  done
}

# pull_image NODE IMAGE ID: NODE's containerd pulls IMAGE from the local registry (unless the node
# records that it holds ID already).
pull_image() {
  local node="$1" img="$2" id="$3" sock hosts mark
  sock="$(eval echo "\$CONTAINERD_SOCK_${node//-/_}")"
  hosts="$(eval echo "\$CONTAINERD_HOSTS_${node//-/_}")"
  mark="$(eval echo "\$CONTAINERD_ROOT_${node//-/_}")/.ddpjob-pulled-$(echo "$img" | tr '/:' '__')"
  [ "$(cat "$mark" 2>/dev/null)" = "$id" ] && return
  log "$img: $node pulls it from $REGISTRY"
  ctr -a "$sock" -n k8s.io images pull --hosts-dir "$hosts" "$img" >"$LOGS/pull-$node.log" 2>&1 \
    || die "$node could not pull $img from $REGISTRY (see $LOGS/pull-$node.log): $(tail -3 "$LOGS/pull-$node.log")"
  echo "$id" >"$mark"
  prune_node_images "$sock"
  log "$img: $node has it"
}

# push_image IMAGE REF [ID]: IMAGE to the registry as REF (unless the registry's storage records that
# it holds ID there already).
push_image() {
  local img="$1" ref="$2" id="${3:-}" mark
  # The mark names the repository without the registry's address (a new port at each cluster-up).
  mark="$CACHE/registry/.ddpjob-pushed-$(echo "${ref#*/}" | tr '/:' '__')"
  if [ -n "$id" ] && [ "$(cat "$mark" 2>/dev/null)" = "$id" ]; then return; fi
  log "$img: pushing to $ref"
  buildah push -q --tls-verify=false --format oci "$img" "docker://$ref" \
    >"$LOGS/push.log" 2>&1 || push_failed "$img" "$ref"
  [ -z "$id" ] || echo "$id" >"$mark"
}

# prune_node_images SOCK: the CRI plugin keeps an image-id reference ("sha256:<config>") for every
# image it has seen, which would hold each replaced build (GBs) forever; drop those that no named
# image points at any more, and let containerd's GC take their layers.
prune_node_images() {
  local sock="$1" named ref digest
  named="$(ctr -a "$sock" -n k8s.io images ls 2>/dev/null | awk 'NR > 1 && $1 !~ /^sha256:/ {print $3}')"
  ctr -a "$sock" -n k8s.io images ls 2>/dev/null | awk 'NR > 1 && $1 ~ /^sha256:/ {print $1, $3}' \
    | while read -r ref digest; do
        grep -qxF "$digest" <<<"$named" || ctr -a "$sock" -n k8s.io images rm "$ref" >/dev/null 2>&1 || true
      done
}

case "${1:-all}" in
  build) build_all ;;
  # The product images and their bases only (no cluster needed; make test builds them while the
  # control planes compile).
  products) build_products ;;
  publish) publish_images "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$TRAINER_IMAGE" ;;
  pause) build_pause; publish_images "$PAUSE_IMAGE" ;;
  all) build_all; publish_images "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$TRAINER_IMAGE" ;;
  release) shift; [ "$#" -ge 3 ] || die "usage: hack/images.sh release SRC VERSION REPO [--insecure]"; release_images "$@" ;;
  *) die "unknown command '$1' (build | products | publish | pause | all | release)" ;;
esac
