#!/usr/bin/env bash
# Install what is missing, then run the linter and the whole test suite.
# Tests start their own etcd and agents on loopback and stop them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
