#!/usr/bin/env bash
# Installs non-Python tools the tests need into .tools/ (git-ignored). Idempotent; safe offline once installed.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin
