#!/usr/bin/env bash
# Type-check the package as it is installed: hypermesh/, with agent/ and chunkfs/ as
# hypermesh.agent and hypermesh.chunkfs (pyproject.toml's package-dir). mypy cannot follow
# that mapping in the source tree (it would read `agent/` as a top-level package and every
# `hypermesh.agent...` import as unknown), so it runs on a tree of links laid out the
# installed way.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/hypermesh"
for entry in hypermesh/*; do ln -s "$repo/$entry" "$tree/hypermesh/"; done
ln -s "$repo/agent" "$tree/hypermesh/agent"
ln -s "$repo/chunkfs" "$tree/hypermesh/chunkfs"
cd "$tree"
exec "$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" \
  -p hypermesh "$@"
