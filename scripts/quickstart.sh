#!/usr/bin/env bash
# Install everything, start a local mesh (etcd, an S3 server and 2 agents on
# loopback), put the example's raw data set into the object store, run the
# preprocess -> sweep -> inference workflow (prep reads the data set through the
# agents' chunkfs mounts) with live progress, show the result, and stop the mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python examples/pipeline/make_raw.py .mesh-raw/pipeline-raw
exec .venv/bin/python scripts/local_mesh.py run examples/pipeline/pipeline.yaml --agents 2 --slots 2 \
  --data pipeline-raw=.mesh-raw/pipeline-raw "$@"
