#!/usr/bin/env bash
# Regenerates the Python stubs in specdec/v1/ from proto/specdec/v1/*.proto (needs grpcio-tools).
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: the repo root, so the modules land in specdec/v1/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out/specdec/v1"
python -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/specdec/v1/*.proto
