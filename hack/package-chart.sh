#!/usr/bin/env bash
# Package the chart as release VERSION: version and appVersion VERSION, REPO/operator the default
# image (REPO a repository prefix such as ghcr.io/ddpjob), into OUTDIR. One home for what a
# released chart says about its images: make release (hack/release.sh) and the release workflow
# (.github/workflows/release.yml) both call it.
# Usage: hack/package-chart.sh VERSION REPO OUTDIR [HELM]   (prints the .tgz's path)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="$1" REPO="${2%/}" OUT="$3" HELM="${4:-helm}"
CHART_NAME=ddpjob-operator
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$ROOT/charts/$CHART_NAME" "$work/$CHART_NAME"
python3 - "$work/$CHART_NAME/values.yaml" "$REPO/operator" <<'PY'
import re
import sys
from pathlib import Path

values, repository = Path(sys.argv[1]), sys.argv[2]
text = values.read_text()
# Only the value of image.repository changes (the first key of `image:` after its comments), so
# the packaged values.yaml keeps every comment.
new, n = re.subn(r"(?m)^(image:\n(?:  #.*\n)*  repository: ).*$", lambda m: m.group(1) + repository, text, count=1)
if n != 1:
    raise SystemExit(f"{values}: no image.repository line to set")
values.write_text(new)
PY
mkdir -p "$OUT"
"$HELM" package "$work/$CHART_NAME" --version "$VERSION" --app-version "$VERSION" -d "$OUT" >&2
echo "$OUT/$CHART_NAME-$VERSION.tgz"
