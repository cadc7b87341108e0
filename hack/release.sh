#!/usr/bin/env bash
# `make release VERSION=X REGISTRY=R`: publish release X of this checkout to the OCI registry R
# (a repository prefix, e.g. ghcr.io/ddpjob):
#   R/operator:X, R/trainer:X          the Dockerfile's two targets (hack/images.sh, as make images)
#   oci://R/charts/ddpjob-operator:X   the chart: version and appVersion X, R/operator its default image
#   dist/ddpjob-X-py3-none-any.whl, dist/ddpjob-X.tar.gz   the Python package (CLI, operator, trainer)
# X must be pyproject's version and have an entry in CHANGELOG.md, and the tree must be clean: a
# release names one commit. On GitHub, .github/workflows/release.yml does the same on a tag push.
# Env: RELEASE_INSECURE=1  R is plain HTTP (a registry on loopback, as in the tests)
#      RELEASE_ALLOW_DIRTY=1  skip the clean-tree check (a test of a working tree; never for a release)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
VERSION="${1:-${VERSION:-}}"
REGISTRY="${2:-${REGISTRY:-}}"
DIST="$ROOT/dist"

log() { printf '[hack/release %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }

[ -n "$VERSION" ] && [ -n "$REGISTRY" ] || die "usage: make release VERSION=X REGISTRY=R (e.g. VERSION=0.2.0 REGISTRY=ghcr.io/ddpjob)"
[[ "$REGISTRY" != *://* ]] || die "REGISTRY=$REGISTRY: a repository prefix such as ghcr.io/ddpjob, without a scheme"
REGISTRY="${REGISTRY%/}"
PYPROJECT_VERSION="$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$ROOT/pyproject.toml")"
[ "$VERSION" = "$PYPROJECT_VERSION" ] \
  || die "VERSION=$VERSION is not pyproject.toml's version ($PYPROJECT_VERSION): bump it there (and in CHANGELOG.md) first"
grep -qE "^## \[$(printf '%s' "$VERSION" | sed 's/\./\\./g')\]" "$ROOT/CHANGELOG.md" \
  || die "CHANGELOG.md has no '## [$VERSION]' entry"
if [ "${RELEASE_ALLOW_DIRTY:-}" != 1 ] && [ -n "$(git -C "$ROOT" status --porcelain)" ]; then
  die "the tree has uncommitted changes: a release is built from a commit (git status)"
fi
insecure=()
helm_http=()
if [ "${RELEASE_INSECURE:-}" = 1 ]; then insecure=(--insecure); helm_http=(--plain-http); fi
HELM="$ROOT/.cache/bin/helm"
[ -x "$HELM" ] || HELM="$(command -v helm || true)"
[ -n "$HELM" ] || die "helm not found (.cache/bin/helm: make build-cluster)"

# 1. Images.
"$HERE/images.sh" release "$ROOT" "$VERSION" "$REGISTRY" "${insecure[@]}"

# 2. The chart, its default image this release's operator.
chart="$("$HERE/package-chart.sh" "$VERSION" "$REGISTRY" "$DIST" "$HELM")"
"$HELM" push "$chart" "oci://$REGISTRY/charts" "${helm_http[@]}" >&2 \
  || die "helm push of $chart to oci://$REGISTRY/charts failed"

# 3. The Python package.
UV="$ROOT/.venv/bin/uv"
[ -x "$UV" ] || die "no uv in $ROOT/.venv (make install)"
"$UV" build --quiet --out-dir "$DIST" "$ROOT" >&2 || die "uv build failed"
[ -f "$DIST/ddpjob-$VERSION-py3-none-any.whl" ] && [ -f "$DIST/ddpjob-$VERSION.tar.gz" ] \
  || die "uv build wrote no ddpjob-$VERSION wheel and sdist into $DIST"

log "released $VERSION: $REGISTRY/operator:$VERSION, $REGISTRY/trainer:$VERSION, oci://$REGISTRY/charts/ddpjob-operator --version $VERSION, $DIST/ddpjob-$VERSION{-py3-none-any.whl,.tar.gz}"
