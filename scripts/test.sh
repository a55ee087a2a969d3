#!/usr/bin/env bash
# The project's test command: installs the tools the tests use (idempotent), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_ci_tools.sh
exec python -m pytest -q "$@"
