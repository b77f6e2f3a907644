#!/usr/bin/env bash
# Install what is missing, then run the linter and the type checker, build the docs site and
# run the whole test suite.
# Tests start their own etcd and agents on loopback and stop them afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
# The docs site (mkdocs.yml): --strict turns a broken link or anchor into a failure.
site=$(mktemp -d)
if ! NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site" >"$site.log" 2>&1; then
  cat "$site.log" >&2
  rm -rf "$site" "$site.log"
  echo "test: the docs do not build (mkdocs build --strict, above)" >&2
  exit 1
fi
rm -rf "$site" "$site.log"
echo "test: docs built (mkdocs build --strict)" >&2
exec .venv/bin/python -m pytest -q --durations=25 "$@"
