#!/usr/bin/env bash
# Install everything, start a local mesh (etcd + 2 agents on loopback), run the
# example preprocess -> sweep -> inference workflow with live progress, show the
# result, and stop the mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/local_mesh.py run examples/pipeline/pipeline.yaml --agents 2 --slots 2 "$@"
